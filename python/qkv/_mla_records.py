"""qkv.pack_mla_records: latent rows written as FlashMLA's FP8 records (the layout
qkv.mla_decode(..., cache_format="fp8_ds_mla") reads; vLLM's "fp8_ds_mla" cache), by the
library's qkv::pack_mla_records."""

import numpy as np

from . import _qkv
from ._arrays import Error
from ._decode_eager import _is_torch


def pack_mla_records(c_kv, k_pe, *, power_of_two_scales=True):
    """Records ``uint8 [..., dc + 4*dc/128 + 2*dr]`` from ``c_kv [..., dc]`` and
    ``k_pe [..., dr]`` (NumPy arrays or torch tensors, any float dtype, computed from
    float32; dc a multiple of 128; the result is of the inputs' kind): per 128 latent values
    a float32 scale max|x| / 448 (power_of_two_scales: the power of two at or above it,
    DeepSeek's UE8M0 scales, the default — every stored value is then a bfloat16 value and
    mla_decode's "fast" path runs on the bf16 dot products where the CPU has them), the
    values x / scale rounded to float8_e4m3fn, k_pe to bfloat16 (both to nearest even:
    PyTorch's casts give the same bytes). Write the result into a cache's rows
    (``cache[blocks, slots] = records``)."""
    fn = "qkv.pack_mla_records"
    torch_in = _is_torch(c_kv)
    arrays = []
    for name, x in (("c_kv", c_kv), ("k_pe", k_pe)):
        if _is_torch(x):
            if x.device.type != "cpu":
                raise TypeError(f"{fn}: {name}: expected a CPU tensor, got device {x.device}")
            if not x.is_floating_point():
                raise TypeError(f"{fn}: {name}: expected a floating-point dtype, got {x.dtype}")
            x = x.detach().float().numpy()
        else:
            x = np.asarray(x)
            if x.dtype.kind != "f" and "bfloat16" not in str(x.dtype):
                raise TypeError(f"{fn}: {name}: expected a floating-point dtype, got {x.dtype}")
            x = x.astype(np.float32, copy=False)
        if x.ndim < 1:
            raise Error(f"{fn}: {name}: expected [..., {'dc' if name == 'c_kv' else 'dr'}] (rank >= 1), got rank 0")
        arrays.append(x)
    latent, rope = arrays
    if latent.shape[:-1] != rope.shape[:-1]:
        raise Error(f"{fn}: k_pe: expected the leading shape of c_kv {tuple(latent.shape[:-1])}, got "
                    f"{tuple(rope.shape[:-1])}")
    lead, dc, dr = latent.shape[:-1], latent.shape[-1], rope.shape[-1]
    if dc == 0 or dc % 128:  # (the library's words; reshaping below needs dc > 0)
        raise Error(f"qkv::pack_mla_records: c_kv.shape[-1] (dc): expected a positive multiple of 128 (a scale per "
                    f"128 values), got {dc}")
    record = dc + 4 * (dc // 128) + 2 * dr
    out = np.empty((*lead, record), dtype=np.uint8)
    _qkv.pack_mla_records(np.ascontiguousarray(latent.reshape(-1, dc)), np.ascontiguousarray(rope.reshape(-1, dr)),
                          out.reshape(-1, record), bool(power_of_two_scales))
    if torch_in:
        import torch

        return torch.from_numpy(out)
    return out
