"""qkv.KVCache(dtype="int8", key_scales="channel"): the stored keys (int8 · the group's
channel scale + its zero point, read from the cache's own memory) are each within half
a step of the appended ones; attend() equals float64 attention over the stored values to
float32 rounding; on keys with outlier channels it is closer to the unquantized
attention than one scale per row; bad configurations get the C++ library's messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from test_decode import sdpa, sdpa32_error


def outlier_keys(batch, hkv, n, d, seed):
    """N(0, 1) keys [B, Hkv, n, d] with channels 3 and 17 20× larger (as post-RoPE keys)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, hkv, n, d, generator=g)
    k[..., [3, 17]] *= 20
    return k


def locate(cache, seq, j):
    """(block or sequence, row) of key j of sequence seq in the cache's storage."""
    if cache.paged:
        return cache.block_table()[seq][j // cache.block_size], j % cache.block_size
    return seq, j


def stored(cache, n):
    """[B, Hkv, n, d] float64, from the cache's own memory: the stored keys (row scale ·
    (int8 · the group's channel scale + its zero point)), half a step of each key (channel
    scale / 2, plus the zero point's float rounding), and the stored values (int8 · row
    scale)."""
    (keys, values), (k_scale, v_scale), (channel, zero) = cache.storage(), cache.scales(), cache.channel_scales()
    k_rows, half_steps, v_rows = [], [], []
    eps = np.finfo(np.float32).eps
    for seq in range(cache.batch):
        for j in range(n):
            block, row = locate(cache, seq, j)
            step = channel[block, row // cache.group_size].astype(np.float64)
            z = zero[block, row // cache.group_size].astype(np.float64)
            k_rows.append(k_scale[block, row][:, None].astype(np.float64) * (keys[block, row] * step + z))
            half_steps.append(step / 2 + eps * np.abs(z))
            v_rows.append(values[block, row] * v_scale[block, row][:, None].astype(np.float64))
    shape = (cache.batch, n) + keys.shape[2:]
    return [torch.from_numpy(np.stack(x).reshape(shape)).transpose(1, 2) for x in (k_rows, half_steps, v_rows)]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("group_size", [16, 5])
def test_channel_scaled_cache_matches_attention_over_its_stored_values(paged, group_size):
    batch, hq, hkv, d, n = 2, 8, 2, 64, 83
    if paged and group_size == 5:
        pytest.skip("a paged cache's block size must be a multiple of group_size (test_bad_config)")
    cache = qkv.KVCache(batch, 128, hkv, d, dtype="int8", paged=paged, block_size=32, key_scales="channel",
                        group_size=group_size)
    assert (cache.key_scales, cache.group_size) == ("channel", group_size)
    k, v = outlier_keys(batch, hkv, n, d, 1), torch.randn(batch, hkv, n, d)
    cache.append(k[:, :, :50], v[:, :, :50])  # a partial group, then more tokens into it
    cache.append(k[:, :, 50:], v[:, :, 50:])
    k_stored, half_step, v_stored = stored(cache, n)
    assert ((k_stored - k.double()).abs() <= half_step * (1 + 1e-6)).all()
    assert cache.storage()[0].min() == -128 and cache.storage()[0].max() == 127

    q = torch.randn(batch, hq, 3, d)
    out = cache.attend(q)
    ref = sdpa(q, k_stored, v_stored, [n] * batch)
    # Twice PyTorch's float32 error on the same stored values, plus 1e-6 absolute.
    limit = 2 * sdpa32_error(q, k_stored.float(), v_stored.float(), [n] * batch, ref) + 1e-6
    assert (out.double() - ref).abs().max().item() <= limit


def test_channel_scales_beat_row_scales_on_outlier_channels():
    batch, hq, hkv, d, n = 1, 8, 2, 64, 200
    k, v = outlier_keys(batch, hkv, n, d, 2), torch.randn(batch, hkv, n, d)
    q = torch.randn(batch, hq, 1, d)
    exact = sdpa(q, k.double(), v.double(), [n], causal=False)

    def error(**config):
        cache = qkv.KVCache(batch, n, hkv, d, dtype="int8", **config)
        cache.append(k, v)
        return (cache.attend(q, causal=None).double() - exact).norm().item()

    assert 3 * error(key_scales="channel", group_size=32) < error()


def test_bad_config():
    with pytest.raises(qkv.Error, match="config.key_scales: channel scales are for int8 and int4 caches, got dtype bfloat16"):
        qkv.KVCache(1, 64, 1, 16, dtype="bfloat16", key_scales="channel")
    with pytest.raises(qkv.Error, match="config.key_scales: expected 'row' or 'channel', got 'column'"):
        qkv.KVCache(1, 64, 1, 16, dtype="int8", key_scales="column")
    with pytest.raises(qkv.Error, match=r"config.group_size: must divide config.block_size \(16\)"):
        qkv.KVCache(1, 64, 1, 16, dtype="int8", key_scales="channel", group_size=12, paged=True, block_size=16)
    with pytest.raises(qkv.Error, match=r"config.group_size: expected 1..64"):
        qkv.KVCache(1, 64, 1, 16, dtype="int8", key_scales="channel", group_size=0)
    assert qkv.KVCache(1, 64, 1, 16, dtype="int8").channel_scales() is None
