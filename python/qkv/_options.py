"""The keyword arguments shared by every attention function, as one bound Options.

Masks follow PyTorch: shape [B|1, H|1, Nq|1, Nk] over the score matrix, whatever the
layout of q, k and v, with fewer dimensions broadcast from the left. A boolean (or uint8)
mask says which keys take part (True = attend); a float mask is added to the scaled
logits (-inf removes a key). qkv adds float masks in float32: a float64 mask is rounded
to float32 first (one copy), which is exact for 0 and ±inf; a float16 or bfloat16 mask is
widened to float32 (one copy, exact).
"""

from __future__ import annotations

from ._qkv import Backend, Causal, Error, Options

# Options is qkv._qkv.Options, the one bound object a call hands to the library: built
# once per call by make_options (or the torch operators), read by C++. Every entry point
# (attention, varlen, decode, KVCache.attend, the torch operators) builds it here, and
# every field goes through one C++ setter (python/src/options.cpp), which checks its type
# and range before narrowing it, so a bad value gets the same error everywhere. Python
# only converts what needs the array framework (masks, key lengths, per-head vectors) and
# draws a dropout seed. The causal mode and backend are the library's enums, named by its
# one name table (qkv/names.hpp), which the `qkv` command line reads too.
__all__ = ["Backend", "Causal", "Error", "Options", "make_options"]


def mask_arrays(function: str, fw, mask):
    """(keep, bias): the mask as the library's 4-D boolean or float32 mask."""
    if mask is None:
        return None, None
    if not fw.owns(mask):
        raise TypeError(
            f"{function}: mask: expected a {fw.name} array like q, got "
            f"{type(mask).__module__}.{type(mask).__qualname__}"
        )
    if not 1 <= mask.ndim <= 4:
        raise Error(
            f"{function}: mask: expected 1 to 4 dimensions [B|1, H|1, Nq|1, Nk], "
            f"got shape {tuple(mask.shape)}"
        )
    mask = fw.add_leading_axes(mask, 4 - mask.ndim)
    if fw.is_bool_or_uint8(mask):
        return mask, None
    if fw.is_float32(mask):
        return None, mask
    if fw.is_float64(mask) or fw.is_half(mask):
        return None, fw.to_float32(mask)
    raise TypeError(
        f"{function}: mask: expected dtype bool or uint8 (True = attend) or float32, float64, "
        f"float16 or bfloat16 (added to the logits), got {fw.dtype_name(mask)}"
    )


def key_lengths_array(function: str, fw, key_lengths):
    """Per-batch key lengths as a contiguous int64 vector (integers only: no rounding)."""
    if key_lengths is None:
        return None
    lengths = fw.integer_vector(key_lengths)
    if lengths is None:
        raise TypeError(
            f"{function}: key_lengths: expected integers, one per batch entry, "
            f"got {key_lengths!r}"
        )
    return lengths


def per_head_vector(function: str, fw, name: str, values):
    """One value per query head as a float32 array of the caller's type (torch: keeps
    requires_grad through .float()); its shape and length are checked in C++."""
    if values is None:
        return None
    if fw.owns(values):
        return values if fw.is_float32(values) else fw.to_float32(values)
    vector = fw.float_vector(values)
    if vector is None:
        raise TypeError(f"{function}: {name}: expected one float per query head, got {values!r}")
    return vector


def make_options(
    function: str,
    fw,
    *,
    mask=None,
    key_lengths=None,
    scale=None,
    causal=None,
    backend="auto",
    threads=None,
    check_finite=False,
    window=None,
    alibi_slopes=None,
    softcap=None,
    sinks=None,
    dropout_p=0.0,
    seed=None,
    fixed_key_split=False,
    precision=None,
) -> Options:
    """The bound Options of one call; `function` names the caller in messages. Python
    only converts what needs the array framework (masks, key lengths, per-head vectors)
    and draws a dropout seed; every value is checked by the C++ setter."""
    keep = bias = None
    if mask is not None:
        keep, bias = mask_arrays(function, fw, mask)
    if key_lengths is not None:
        key_lengths = key_lengths_array(function, fw, key_lengths)
    # precision (None: "fast") only by keyword when given: the common call stays positional.
    extra = {} if precision is None else {"precision": precision}
    if (window is None and alibi_slopes is None and softcap is None and sinks is None
            and seed is None and (dropout_p is None or (type(dropout_p) in (int, float)
                                                        and dropout_p == 0))):
        options = Options(function, causal, scale, backend, threads, check_finite, keep, bias,
                          key_lengths, **extra)
    else:
        if seed is None and dropout_p:
            seed = fw.random_seed()
        options = Options(function, causal, scale, backend, threads, check_finite, keep, bias,
                          key_lengths, window, per_head_vector(function, fw, "alibi_slopes", alibi_slopes),
                          softcap, per_head_vector(function, fw, "sinks", sinks), dropout_p, seed, **extra)
    return options.replace(fixed_key_split=fixed_key_split) if fixed_key_split else options
