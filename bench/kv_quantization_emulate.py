"""Emulated KV-cache storages for bench/kv_quantization.py: K and V fake-quantized in
torch (quantize, then dequantize to float32) and written into a float32 cache that
qkv.decode reads in place, so an emulated row differs from the float32 row only by the
storage's rounding. These rows guide the design of storages qkv does not have yet; the
bench labels them "emulated" and never mixes them with the real caches' rows.

What is emulated, exactly (the bench appends a window chunk by chunk, as decode would):
- "row" scales: one scale (and zero point, if asymmetric) per token, per head, per group
  of `group` channels (group = head_dim: the whole row). A token's rows are final once
  appended.
- "channel" scales (keys, KIVI): one scale per channel, per head, per group of `group`
  tokens, groups aligned at the window's first token. A full group is quantized with the
  scales of its `group` tokens. The newest, not yet full group is quantized with scales
  from the tokens present so far, recomputed at every append (the cache keeps that
  group's float copy), and the chunk's queries see that.
- residual "partial": the keys of the not yet full group stay float (KIVI's residual);
  values are stored at once (per-token scales have no partial groups).
- residual R (an int): the newest R tokens' keys and values stay float, whatever the
  groups; older tokens are stored as above.
- Hadamard ("rotate"): keys are multiplied by a fixed orthonormal Hadamard matrix H
  (head_dim × head_dim) before quantization and by Hᵀ after, i.e. the kernel would
  rotate q and k alike (q·k = qH·kH); the scores change only by the rounding.
- Scales (and zero points) are rounded to `scale_dtype` before the values are
  quantized with them, as a cache that stores them so would; levels are clamped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import qkv


@dataclass(frozen=True)
class Quantizer:
    """How one of K or V is stored. kind: "float" (float32), "sym" (levels ±(2^(bits-1)-1),
    scale = max|x| / that), "asym" (levels 0..2^bits-1, scale = (max-min)/(2^bits-1),
    zero = min) or "q4_0" (llama.cpp's block format: blocks of 32 along the row, one fp16
    scale d = m/-8 where m is the block's value of largest magnitude, levels 0..15,
    x = (q-8)·d). "channel+row" (int8 keys as this build's key_scales="channel" stores them:
    per group of tokens, c = each channel's max|k|, then per row r = max|k/c| / 127 and
    q = round(k / (r·c)), both float32)."""

    kind: str = "float"
    bits: int = 8
    axis: str = "row"  # "row": groups of channels of one token; "channel": groups of tokens
    group: int = 0  # channels per group (row; 0: the whole row) or tokens per group (channel)
    scale_dtype: torch.dtype = torch.float32
    rotate: bool = False

    def bytes_per_value(self, head_dim: int) -> float:
        if self.kind == "float":
            return 4.0
        if self.kind == "q4_0":
            return 0.5 + 2 / 32
        if self.kind == "channel+row":
            return 1 + 4 / head_dim + 4 / self.group
        per_group = self.group or head_dim
        params = 2 if self.kind == "asym" else 1
        scale_bytes = torch.finfo(self.scale_dtype).bits // 8
        return self.bits / 8 + params * scale_bytes / per_group

    def store(self, x: torch.Tensor) -> torch.Tensor:
        """x [H, T, d] float32, a window from its first token: what the cache holds once
        every group is full (a partial last group is quantized over its own rows)."""
        if self.kind == "float":
            return x
        y = x @ hadamard(x.shape[-1]) if self.rotate else x
        if self.axis == "row":
            h, t, d = y.shape
            c = self.group or d
            out = self._quantize(y.reshape(h, t, d // c, c), dim=-1).reshape(h, t, d)
        else:
            parts = [self._quantize(y[:, s:s + self.group], dim=1) for s in range(0, y.shape[1], self.group)]
            out = torch.cat(parts, dim=1)
        return out @ hadamard(x.shape[-1]).T if self.rotate else out

    def partial_start(self, end: int) -> int:
        """First token of the group that is not full when `end` tokens are cached
        (== end when there is none: row scales, or end a multiple of the group)."""
        if self.kind == "float" or self.axis == "row" or end % self.group == 0:
            return end
        return end - end % self.group

    def _quantize(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """x quantized and dequantized with one scale (and zero) per slice along dim."""
        if self.kind == "channel+row":  # x [H, tokens, d], dim = 1: the tokens of a group
            channel = x.abs().amax(dim=dim, keepdim=True)
            channel = torch.where(channel == 0, torch.ones_like(channel), channel)
            scaled = x / channel
            row = scaled.abs().amax(dim=-1, keepdim=True) / 127
            step = row.double() * channel.double()
            safe = torch.where(step == 0, torch.ones_like(step), step)
            return (torch.clamp(torch.round(x.double() / safe), -127, 127) * step).float()
        if self.kind == "q4_0":
            index = x.abs().argmax(dim=dim, keepdim=True)
            d = (x.gather(dim, index) / -8).to(torch.float16).float()
            inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
            q = torch.clamp(torch.floor(x * inv + 8.5), 0, 15)
            return (q - 8) * d
        if self.kind == "sym":
            top = 2 ** (self.bits - 1) - 1
            scale = (x.abs().amax(dim=dim, keepdim=True) / top).to(self.scale_dtype).float()
            safe = torch.where(scale == 0, torch.ones_like(scale), scale)
            return torch.clamp(torch.round(x / safe), -top, top) * scale
        top = 2 ** self.bits - 1
        low = x.amin(dim=dim, keepdim=True).to(self.scale_dtype).float()
        scale = ((x.amax(dim=dim, keepdim=True) - low) / top).to(self.scale_dtype).float()
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        return torch.clamp(torch.round((x - low) / safe), 0, top) * scale + low


@dataclass(frozen=True)
class Scheme:
    """An emulated storage: how K and V are stored, and which newest tokens stay float
    (None; "partial": the keys' not yet full group; an int R: the newest R tokens)."""

    label: str
    k: Quantizer
    v: Quantizer
    residual: object = None

    def bytes_per_value(self, head_dim: int) -> float:
        return (self.k.bytes_per_value(head_dim) + self.v.bytes_per_value(head_dim)) / 2

    def float_from(self, end: int) -> int:
        """First token whose K and V are still float when `end` tokens are cached."""
        if isinstance(self.residual, int):
            return max(0, end - self.residual)
        return end

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, threads=None) -> torch.Tensor:
        """Attention of q [1, Hq, T, d] over k, v [1, Hkv, T, d] (post-RoPE), appended and
        attended `chunk` tokens at a time, bottom-right causal, through a float32 cache
        holding what this storage would hold after each append."""
        final_k, final_v = self.k.store(k[0]), self.v.store(v[0])
        cache_k, cache_v = final_k.clone().unsqueeze(0), final_v.clone().unsqueeze(0)
        out = torch.empty_like(q)
        dirty = q.shape[2]  # rows [dirty, ...) hold an override of the final storage
        for start in range(0, q.shape[2], chunk):
            end = min(q.shape[2], start + chunk)
            if dirty < end:  # overrides of the previous append: back to the final storage
                cache_k[0, :, dirty:end], cache_v[0, :, dirty:end] = final_k[:, dirty:end], final_v[:, dirty:end]
            dirty = end
            partial = self.k.partial_start(end)
            if partial < end:
                if self.residual == "partial":
                    cache_k[0, :, partial:end] = k[0, :, partial:end]
                else:
                    cache_k[0, :, partial:end] = self.k.store(k[0, :, partial:end])
                dirty = partial
            fresh = self.float_from(end)
            if fresh < end:
                cache_k[0, :, fresh:end], cache_v[0, :, fresh:end] = k[0, :, fresh:end], v[0, :, fresh:end]
                dirty = min(dirty, fresh)
            out[:, :, start:end] = qkv.decode(q[:, :, start:end], cache_k, cache_v, [end], causal="bottom_right",
                                                    threads=threads)
        return out


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of order n (a power of two)."""
    if n & (n - 1):
        raise ValueError(f"hadamard: the order must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def schemes(sets) -> list[Scheme]:
    """The emulated rows of the sets named in `sets` (a list of letters: a-d, as in the brief; "v":
    the validation rows; "s": K and V's shares of the 4-bit error; "l": int8 keys stored as
    this build's key_scales="channel" stores them; "f": int4 with fp32 scales)."""
    f16, f32 = torch.float16, torch.float32
    v_row8 = Quantizer("sym", 8, "row")
    rows: list[Scheme] = []
    if "v" in sets:  # the emulator against the real int8 cache, and int8 on V only
        rows.append(Scheme("int8 K row, V row (as the real int8)", v_row8, v_row8))
        rows.append(Scheme("int8 V row, K float", Quantizer(), v_row8))
    if "a" in sets:
        for g in (32, 64, 128):
            rows.append(Scheme(f"int8 K channel G={g}, V row", Quantizer("sym", 8, "channel", g), v_row8))
        rows.append(Scheme("int8 asym K channel G=64, V row", Quantizer("asym", 8, "channel", 64), v_row8))
        rows.append(Scheme("int8 K channel G=64, V row, newest 32 float", Quantizer("sym", 8, "channel", 64),
                           v_row8, 32))
    if "l" in sets:  # int8 K as the lead's key_scales="channel" build stores them
        for g in (32, 64, 128):
            rows.append(Scheme(f"int8 K channel G={g} then row (two-level), V row",
                               Quantizer("channel+row", 8, "channel", g), v_row8))
        for g in (32, 64):  # the cache keeps the partial group's float keys: attended from them
            rows.append(Scheme(f"int8 K channel G={g} then row (two-level), V row, K partial group float",
                               Quantizer("channel+row", 8, "channel", g), v_row8, "partial"))
    if "s" in sets:  # which of K and V the 4-bit error comes from
        k4 = Quantizer("asym", 4, "channel", 64, f16)
        rows.append(Scheme("int4 asym K channel G=64 fp16, V float", k4, Quantizer()))
        for kind in ("sym", "asym"):
            rows.append(Scheme(f"int4 {kind} V row/32 fp16, K float", Quantizer(), Quantizer(kind, 4, "row", 32, f16)))
        rows.append(Scheme("int4 asym K channel G=64 fp16, int8 V row", k4, v_row8))
    for kind in ("sym", "asym"):
        v4 = Quantizer(kind, 4, "row", 32, f16)
        for letter, dt, name in (("b", f16, "fp16"), ("f", f32, "fp32")):
            for g in (32, 64, 128) if letter in sets else ():
                rows.append(Scheme(f"int4 {kind} K channel G={g}, V row/32, {name} scales",
                                   Quantizer(kind, 4, "channel", g, dt), Quantizer(kind, 4, "row", 32, dt)))
        if "c" in sets:
            for g in (32, 64, 128):
                for residual in ("partial", 32, 128):
                    what = "K partial group float" if residual == "partial" else f"newest {residual} float"
                    rows.append(Scheme(f"int4 {kind} K channel G={g}, V row/32, fp16, {what}",
                                       Quantizer(kind, 4, "channel", g, f16), v4, residual))
    if "d" in sets:
        q40 = Quantizer("q4_0", 4, "row", 32)
        rows.append(Scheme("q4_0-style K and V (blocks of 32)", q40, q40))
        for kind in ("sym", "asym"):
            v4 = Quantizer(kind, 4, "row", 32, f16)
            for c in (0, 32):
                span = "row" if c == 0 else "row/32"
                rows.append(Scheme(f"Hadamard K, int4 {kind} K {span}, V row/32, fp16",
                                   Quantizer(kind, 4, "row", c, f16, rotate=True), v4))
            rows.append(Scheme(f"Hadamard K, int4 {kind} K channel G=64, V row/32, fp16",
                               Quantizer(kind, 4, "channel", 64, f16, rotate=True), v4))
    return rows
