"""The keyword arguments shared by every attention function, checked and normalized once.

Masks follow PyTorch: shape [B|1, H|1, Nq|1, Nk] over the score matrix, whatever the
layout of q, k and v, with fewer dimensions broadcast from the left. A boolean (or uint8)
mask says which keys take part (True = attend); a float mask is added to the scaled
logits (-inf removes a key). qkv adds float masks in float32: a float64 mask is rounded
to float32 first (one copy), which is exact for 0 and ±inf; a float16 or bfloat16 mask is
widened to float32 (one copy, exact).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

from ._qkv import Error

CAUSAL_MODES = ("none", "top_left", "bottom_right")
BACKENDS = ("auto", "reference", "cpu")


@dataclass(frozen=True)
class Options:
    """Everything but q, k, v that one library call takes (arrays still the caller's)."""

    keep: Any = None
    bias: Any = None
    key_lengths: Any = None
    scale: Optional[float] = None
    causal: str = "none"
    backend: str = "auto"
    threads: int = 0
    check_finite: bool = False
    # Variants (see qkv.attention): inert defaults.
    window: tuple = (-1, -1)
    alibi_slopes: Any = None  # float32 [Hq] array of the caller's type
    softcap: float = 0.0
    sinks: Any = None         # float32 [Hq]; for torch, may require grad
    dropout_p: float = 0.0
    seed: int = 0

    def has_variants(self) -> bool:
        return (self.window != (-1, -1) or self.alibi_slopes is not None or self.softcap != 0.0
                or self.sinks is not None or self.dropout_p != 0.0)

    def variants_for_library(self, fw) -> dict:
        if not self.has_variants():
            return {}
        return dict(window_left=self.window[0], window_right=self.window[1],
                    alibi_slopes=None if self.alibi_slopes is None else fw.for_library(self.alibi_slopes),
                    softcap=self.softcap,
                    sinks=None if self.sinks is None else fw.for_library(self.sinks),
                    dropout_p=self.dropout_p, dropout_seed=self.seed)

    def for_library(self, fw) -> dict:
        """Keyword arguments for qkv._qkv.forward / backward."""

        def array(x):
            return None if x is None else fw.for_library(x)

        return dict(
            keep=array(self.keep),
            bias=array(self.bias),
            key_lengths=array(self.key_lengths),
            scale=self.scale,
            causal=self.causal,
            backend=self.backend,
            threads=self.threads,
            check_finite=self.check_finite,
            **self.variants_for_library(fw),
        )


def causal_mode(function: str, causal) -> str:
    if causal is None:
        return "none"
    if not isinstance(causal, str):
        raise TypeError(
            f"{function}: causal: expected None, 'top_left' or 'bottom_right', "
            f"got {type(causal).__name__} {causal!r}"
        )
    if causal not in CAUSAL_MODES:
        raise Error(
            f"{function}: causal: expected None, 'top_left' or 'bottom_right', got {causal!r}"
        )
    return causal


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


def window_pair(function: str, window) -> tuple:
    """(left, right) with None → -1 (unbounded), as FlashAttention's window_size."""
    if window is None:
        return (-1, -1)
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"{function}: window: expected (left, right), got {window!r}") from None
    pair = tuple(-1 if x is None else x for x in (left, right))
    for x in pair:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{function}: window: expected two ints or None, got {window!r}")
    return tuple(int(x) for x in pair)


def per_head_vector(function: str, fw, name: str, values):
    """A float32 1-D array of the caller's type (torch: keeps requires_grad through .float())."""
    if values is None:
        return None
    if fw.owns(values):
        if values.ndim != 1:
            raise Error(f"{function}: {name}: expected one value per query head (1-D), "
                        f"got shape {tuple(values.shape)}")
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
) -> Options:
    keep, bias = mask_arrays(function, fw, mask)
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, numbers.Real)
    ):
        raise TypeError(f"{function}: scale: expected None or a number, got {scale!r}")
    if not isinstance(backend, str):
        raise TypeError(f"{function}: backend: expected one of {BACKENDS}, got {backend!r}")
    if backend not in BACKENDS:
        raise Error(f"{function}: backend: expected one of {BACKENDS}, got {backend!r}")
    if threads is None:
        threads = 0
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"{function}: threads: expected None or an int, got {threads!r}")
    for name, value in (("softcap", softcap), ("dropout_p", dropout_p)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"{function}: {name}: expected a number, got {value!r}")
    dropout_p = float(dropout_p or 0.0)
    if seed is None:
        seed = fw.random_seed() if dropout_p > 0.0 else 0
    elif isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise TypeError(f"{function}: seed: expected None or an int >= 0, got {seed!r}")
    return Options(
        keep=keep,
        bias=bias,
        key_lengths=key_lengths_array(function, fw, key_lengths),
        scale=None if scale is None else float(scale),
        causal=causal_mode(function, causal),
        backend=backend,
        threads=int(threads),
        check_finite=bool(check_finite),
        window=window_pair(function, window),
        alibi_slopes=per_head_vector(function, fw, "alibi_slopes", alibi_slopes),
        softcap=float(softcap or 0.0),
        sinks=per_head_vector(function, fw, "sinks", sinks),
        dropout_p=dropout_p,
        seed=int(seed) % (1 << 64),
    )
