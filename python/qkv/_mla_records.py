"""qkv.pack_mla_records: latent rows written as FlashMLA's FP8 records (the layout
qkv.mla_decode(..., cache_format="fp8_ds_mla") reads; vLLM's "fp8_ds_mla" cache)."""

from ._arrays import Error

_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn


def pack_mla_records(c_kv, k_pe, *, power_of_two_scales=True):
    """Records ``uint8 [..., dc + 4*dc/128 + 2*dr]`` from torch tensors ``c_kv [..., dc]``
    and ``k_pe [..., dr]`` (any float dtype; dc a multiple of 128): per 128 latent values a
    float32 scale max|x| / 448 (power_of_two_scales: the power of two at or above it,
    DeepSeek's UE8M0 scales, the default — every stored value is then a bfloat16 value and
    mla_decode's "fast" path runs on the bf16 dot products where the CPU has them), the
    values x / scale rounded to float8_e4m3fn (torch's cast), k_pe rounded to bfloat16.
    Write the result into a cache's rows (``cache[blocks, slots] = records``)."""
    import torch

    fn = "qkv.pack_mla_records"
    for name, x in (("c_kv", c_kv), ("k_pe", k_pe)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{fn}: {name}: expected a torch tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{fn}: {name}: expected a floating-point dtype, got {x.dtype}")
        if x.ndim < 1:
            raise Error(f"{fn}: {name}: expected [..., {'dc' if name == 'c_kv' else 'dr'}] (rank >= 1), got rank 0")
    dc, dr = c_kv.shape[-1], k_pe.shape[-1]
    if dc == 0 or dc % 128 != 0:
        raise Error(f"{fn}: c_kv.shape[-1] (dc): expected a positive multiple of 128 (a scale per 128 values), "
                    f"got {dc}")
    if c_kv.shape[:-1] != k_pe.shape[:-1]:
        raise Error(f"{fn}: k_pe: expected the leading shape of c_kv {tuple(c_kv.shape[:-1])}, got "
                    f"{tuple(k_pe.shape[:-1])}")
    lead = c_kv.shape[:-1]
    groups = c_kv.detach().float().reshape(*lead, dc // 128, 128)
    if not bool(torch.isfinite(groups).all()):
        raise Error(f"{fn}: c_kv: expected finite values (a scale per 128 values cannot hold inf or NaN)")
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / _E4M3_MAX
    if power_of_two_scales:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    e4m3 = (groups / scale).to(torch.float8_e4m3fn)
    return torch.cat([e4m3.reshape(*lead, dc).view(torch.uint8),
                      scale.reshape(*lead, dc // 128).contiguous().view(torch.uint8),
                      k_pe.detach().to(torch.bfloat16).contiguous().view(torch.uint8)], dim=-1)
