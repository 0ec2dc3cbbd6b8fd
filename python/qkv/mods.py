"""qkv.mods — the score_mods qkv.flex_attention compiles into its kernels.

FlexAttention's ``score_mod`` is an arbitrary Python function of (score, b, h, q_idx,
kv_idx); qkv cannot run Python inside its C++ kernels, so qkv.flex_attention takes
these objects instead, each one of qkv's fused variants (forward and backward, and its
gradient where it has a parameter)::

    qkv.flex_attention(q, k, v, score_mod=qkv.mods.softcap(30.0), block_mask=mask)
    qkv.flex_attention(q, k, v, score_mod=[qkv.mods.softcap(30.0), qkv.mods.alibi(slopes)])
    qkv.flex_attention(q, k, v, score_mod=qkv.mods.bias(relative_position_bias))

A plain Python function raises TypeError naming these (there is no slow path: run
torch's own flex_attention for a score_mod qkv does not have).
"""

from __future__ import annotations

from typing import NamedTuple


class Softcap(NamedTuple):
    """score → cap·tanh(score/cap) (Gemma 2's logit soft-capping), cap > 0."""
    cap: float


class Alibi(NamedTuple):
    """score → score − slope[h]·|i + S − L − j| (ALiBi, aligned bottom-right as in
    FlashAttention; i, j the query and key positions, L, S the lengths): one slope per
    query head; a tensor that requires grad gets its gradient."""
    slopes: object


class Bias(NamedTuple):
    """score → score + bias[b, h, i, j]: a float tensor broadcasting to
    ``[B, Hq, L, S]`` (an additive mask; -inf removes the key). One that requires grad
    gets its gradient (``P ⊙ (dP − δ)``), computed by PyTorch from the weights P it
    materializes — as large as the bias itself; that path takes no other score_mod.
    No block_mask with a bias (qkv's kernels do not combine the two)."""
    bias: object


def bias(tensor) -> Bias:
    return Bias(tensor)


def softcap(cap: float) -> Softcap:
    return Softcap(cap)


def alibi(slopes) -> Alibi:
    return Alibi(slopes)


# The keyword arguments of qkv's attention each mod sets.
def as_options(score_mod) -> dict:
    """qkv.attention's keywords for `score_mod` (None, one mod or a list of mods)."""
    if score_mod is None:
        return {}
    mods = list(score_mod) if isinstance(score_mod, (list, tuple)) and not isinstance(
        score_mod, (Softcap, Alibi, Bias)) else [score_mod]
    options = {}
    for mod in mods:
        if isinstance(mod, Softcap):
            key, value = "softcap", float(mod.cap)
        elif isinstance(mod, Alibi):
            key, value = "alibi_slopes", mod.slopes
        elif isinstance(mod, Bias):
            key, value = "mask", mod.bias
        else:
            raise TypeError(
                "qkv.flex_attention: score_mod: expected None, qkv.mods.softcap(cap), "
                "qkv.mods.alibi(slopes), qkv.mods.bias(tensor) or a list of them, got "
                f"{type(mod).__module__}.{type(mod).__qualname__}: qkv runs no Python "
                "inside its kernels (use torch.nn.attention.flex_attention for other "
                "score_mods)")
        if key in options:
            raise TypeError(f"qkv.flex_attention: score_mod: {key} given twice")
        options[key] = value
    return options


__all__ = ["Alibi", "Bias", "Softcap", "alibi", "as_options", "bias", "softcap"]
