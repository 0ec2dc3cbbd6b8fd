"""qkv.dist — exact ring attention over torch.distributed (context parallelism).

Each rank of a process group holds a shard of the sequence; ``ring_attention`` passes
the key/value shards around the ring (non-blocking ``isend``/``irecv``, overlapping the
compute on the shard at hand) and merges the partial results by their log-sum-exp. The
result is attention over the whole sequence, exact up to fp32 rounding, with autograd:
its backward runs the ring backward (dq stays, dk/dv travel home with their shard).

The schedule — which rows a rank holds, which (query chunk, key chunk) pairs are full,
diagonal or empty at each step — and the merge are the C++ library's
(``qkv::dist::ring_block_calls``, ``qkv::merge_partials``), the very code the MPI ring
``qkv::dist`` runs; each block is computed by ``qkv.attention``/``qkv.attention_backward``.

    import torch.distributed as dist, qkv.dist
    q, k, v = (qkv.dist.shard(t) for t in (q_full, k_full, v_full))   # [B, H, S, D]
    out = qkv.dist.ring_attention(q, k, v, causal=True)              # this rank's rows
    out_full = qkv.dist.unshard(out)

Sharding: "zigzag" (default; rank r of W holds chunks r and 2W−1−r of 2W, which gives
every rank the same causal work) or "contiguous" (chunk r of W). CPU float32 tensors in
PyTorch's [batch, heads, seq, dim] layout; any process group whose backend does
point-to-point messages (gloo on CPU).
"""

from __future__ import annotations

import math
import struct

import torch
import torch.distributed as dist

from . import _qkv
from ._attention import attention, attention_backward
from ._qkv import Error

__all__ = ["ring_attention", "shard", "unshard", "shard_length"]

_SHARDINGS = ("zigzag", "contiguous")
_TAG_KEYS_VALUES = 7101
_TAG_GRADIENTS = 7102


def _world_rank(group):
    return dist.get_world_size(group), dist.get_rank(group)


def _global_rank(group, rank):
    return rank if group is None else dist.get_global_rank(group, rank)


def _check_sharding(fn, sharding):
    if sharding not in _SHARDINGS:
        raise Error(f"{fn}: sharding: expected 'zigzag' or 'contiguous', got {sharding!r}")


def shard_length(length: int, world: int, rank: int, sharding: str = "zigzag") -> int:
    """Rows of a sequence of `length` rows that rank `rank` of `world` holds."""
    _check_sharding("qkv.dist.shard_length", sharding)
    return sum(n for _, n, _ in _qkv.ring_shard_segments(length, world, rank, sharding))


def shard(x: torch.Tensor, *, dim: int = 2, group=None, sharding: str = "zigzag") -> torch.Tensor:
    """This rank's rows of the full tensor `x` along `dim` (a new contiguous tensor).
    Every rank passes the same `x`."""
    _check_sharding("qkv.dist.shard", sharding)
    world, rank = _world_rank(group)
    segments = _qkv.ring_shard_segments(x.shape[dim], world, rank, sharding)
    return torch.cat([x.narrow(dim, begin, n) for begin, n, _ in segments], dim=dim).contiguous()


def unshard(x: torch.Tensor, *, dim: int = 2, group=None, sharding: str = "zigzag") -> torch.Tensor:
    """The full tensor, on every rank, from each rank's shard `x` (collective: every
    rank's shard must have the same shape but along `dim`). Not differentiable."""
    _check_sharding("qkv.dist.unshard", sharding)
    world, rank = _world_rank(group)
    dim = dim % x.dim()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([x.shape[dim]], dtype=torch.int64), group=group)
    lengths = [int(n) for n in lengths]
    total, longest = sum(lengths), max(lengths)
    # all_gather wants equal shapes: pad every shard to the longest one.
    padded_shape = list(x.shape)
    padded_shape[dim] = longest
    padded = torch.zeros(padded_shape, dtype=x.dtype)
    padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    full_shape = list(x.shape)
    full_shape[dim] = total
    full = torch.empty(full_shape, dtype=x.dtype)
    for r in range(world):
        expected = shard_length(total, world, r, sharding)
        if lengths[r] != expected:
            raise Error(f"qkv.dist.unshard: rank {r} holds {lengths[r]} rows, but its "
                        f"{sharding} shard of {total} rows has {expected}")
        for begin, n, local in _qkv.ring_shard_segments(total, world, r, sharding):
            full.narrow(dim, begin, n).copy_(gathered[r].narrow(dim, local, n))
    return full


class _Ring:
    """One call's agreed geometry: who is where, the global problem, the options."""

    def __init__(self, q, k, v, *, group, causal, scale, key_lengths, sharding, threads):
        fn = "qkv.dist.ring_attention"
        self.group = group
        self.world, self.rank = _world_rank(group)
        self.next = _global_rank(group, (self.rank + 1) % self.world)
        self.prev = _global_rank(group, (self.rank - 1) % self.world)
        self.causal = causal
        self.scale = scale
        self.sharding = sharding
        self.threads = threads
        self.key_lengths = key_lengths

        # Local checks, then one all_gather of (signature, error): every rank sees the
        # same facts and raises the same error, so none is left waiting in the ring.
        error = _local_error(fn, q, k, v, scale, threads)
        shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape)) if error is None else None
        mine = (error, shapes, causal, _scale_bits(scale), sharding, tuple(key_lengths))
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=group)
        for r, (err, *_rest) in enumerate(everyone):
            if err is not None:
                raise Error(f"{fn}: rank {r}: {err}")
        names = ("shapes", "causal", "scale", "sharding", "key_lengths")
        for r, theirs in enumerate(everyone):
            (qs, ks, vs), *options = theirs[1:]
            (q0, k0, v0), *options0 = everyone[0][1:]
            for name, a, b in (("q.shape[0] (batch)", qs[0], q0[0]), ("q.shape[1] (heads)", qs[1], q0[1]),
                               ("q.shape[3] (head_dim)", qs[3], q0[3]), ("k.shape[1] (heads)", ks[1], k0[1]),
                               ("v.shape[3] (value head_dim)", vs[3], v0[3])):
                if a != b:
                    raise Error(f"{fn}: rank {r}: {name} is {a}, rank 0's is {b}; every rank "
                                "must pass the same")
            for name, a, b in zip(names[1:], options, options0):
                if a != b:
                    raise Error(f"{fn}: rank {r}: {name} differs from rank 0's; every rank must "
                                "pass the same")
        self.q_rows = [s[1][0][2] for s in everyone]
        self.k_rows = [s[1][1][2] for s in everyone]
        self.q_len, self.k_len = sum(self.q_rows), sum(self.k_rows)
        for r in range(self.world):
            for what, rows, total in (("query", self.q_rows[r], self.q_len),
                                      ("key", self.k_rows[r], self.k_len)):
                expected = shard_length(total, self.world, r, sharding)
                if rows != expected:
                    raise Error(f"{fn}: rank {r} holds {rows} {what} rows, but {sharding} sharding "
                                f"of {total} rows over {self.world} ranks gives it {expected} "
                                "(see qkv.dist.shard)")
        self.batch, self.q_heads, _, self.dim = q.shape
        self.kv_heads, self.v_dim = k.shape[1], v.shape[3]
        # Checks key_lengths against the global key length (same verdict on every rank).
        self.calls = [_qkv.ring_block_calls(self.world, sharding, self.batch, self.q_len, self.k_len,
                                            causal, list(key_lengths), self.rank, owner)
                      for owner in range(self.world)]

    def owner(self, step):
        return (self.rank - step) % self.world

    def block_floats(self, rows):
        return self.batch * self.kv_heads * rows * (self.dim + self.v_dim)

    def unpack(self, block, rows):
        """K [B, Hkv, rows, d] and V [B, Hkv, rows, dv] views of a travelling block."""
        split = self.batch * self.kv_heads * rows * self.dim
        keys = block[:split].view(self.batch, self.kv_heads, rows, self.dim)
        values = block[split:self.block_floats(rows)].view(self.batch, self.kv_heads, rows, self.v_dim)
        return keys, values

    def pack(self, k, v):
        return torch.cat([k.reshape(-1), v.reshape(-1)])

    def pass_block(self, block, step, tag):
        """Starts sending `block` to the next rank and receiving the next step's block."""
        incoming = torch.empty(self.block_floats(self.k_rows[self.owner(step + 1)]))
        works = [dist.isend(block, self.next, group=self.group, tag=tag),
                 dist.irecv(incoming, self.prev, group=self.group, tag=tag)]
        return incoming, works

    def call_kwargs(self, bottom_right):
        return dict(causal="bottom_right" if bottom_right else None, scale=self.scale,
                    threads=self.threads)


def _scale_bits(scale):
    return None if scale is None else struct.pack("<d", float(scale))


def _local_error(fn, q, k, v, scale, threads):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name}: expected a torch.Tensor, got {type(t).__name__}"
        if t.dtype != torch.float32:
            return f"{name}: expected dtype float32, got {t.dtype}"
        if t.device.type != "cpu":
            return f"{name}: expected a CPU tensor, got device {t.device}"
        if t.dim() != 4:
            return f"{name}: expected 4 dimensions [batch, heads, seq, dim], got {t.dim()}"
    if k.shape[2] != v.shape[2]:
        return f"v.shape[2] (seq): expected {k.shape[2]} (as k.shape[2]), got {v.shape[2]}"
    try:  # the library's own checks of heads, dims, batch and options, on no rows
        attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], scale=scale, threads=threads)
    except (Error, TypeError) as e:
        return str(e)
    return None


def _forward(ring: _Ring, q, k, v):
    out = torch.zeros(ring.batch, ring.q_heads, q.shape[2], ring.v_dim)
    lse = torch.full((ring.batch, ring.q_heads, q.shape[2]), -math.inf)
    block = ring.pack(k, v)
    for step in range(ring.world):
        rows = ring.k_rows[ring.owner(step)]
        incoming, works = (ring.pass_block(block, step, _TAG_KEYS_VALUES)
                           if step + 1 < ring.world else (None, []))
        keys, values = ring.unpack(block, rows)
        for b0, b1, q0, q1, k0, k1, bottom_right in ring.calls[ring.owner(step)]:
            part, part_lse = attention(q[b0:b1, :, q0:q1], keys[b0:b1, :, k0:k1], values[b0:b1, :, k0:k1],
                                       return_lse=True, **ring.call_kwargs(bottom_right))
            _qkv.merge_partials(out[b0:b1, :, q0:q1], lse[b0:b1, :, q0:q1], part, part_lse)
        for work in works:
            work.wait()
        block = incoming
    return out, lse


def _backward(ring: _Ring, q, k, v, out, lse, dout):
    dq = torch.zeros_like(q)
    block = ring.pack(k, v)
    grads_out, grads_out_work = None, None
    for step in range(ring.world):
        owner = ring.owner(step)
        rows = ring.k_rows[owner]
        incoming, works = (ring.pass_block(block, step, _TAG_KEYS_VALUES)
                           if step + 1 < ring.world else (None, []))
        grads_in, grads_in_work = None, None
        if step >= 1:  # what the ranks before us accumulated for this block
            grads_in = torch.empty(ring.block_floats(rows))
            grads_in_work = dist.irecv(grads_in, ring.prev, group=ring.group, tag=_TAG_GRADIENTS)
        keys, values = ring.unpack(block, rows)
        grads = torch.zeros(ring.block_floats(rows))
        dkeys, dvalues = ring.unpack(grads, rows)
        for b0, b1, q0, q1, k0, k1, bottom_right in ring.calls[owner]:
            rows_q, rows_k = (slice(b0, b1), slice(None), slice(q0, q1)), (slice(b0, b1), slice(None), slice(k0, k1))
            part_dq, part_dk, part_dv = attention_backward(
                q[rows_q], keys[rows_k], values[rows_k], out[rows_q], lse[rows_q], dout[rows_q],
                **ring.call_kwargs(bottom_right))
            dq[rows_q] += part_dq
            dkeys[rows_k] += part_dk
            dvalues[rows_k] += part_dv
        if grads_in_work is not None:
            grads_in_work.wait()
            grads += grads_in
        if grads_out_work is not None:
            grads_out_work.wait()
        grads_out = grads
        if ring.world > 1:
            grads_out_work = dist.isend(grads_out, ring.next, group=ring.group, tag=_TAG_GRADIENTS)
        for work in works:
            work.wait()
        block = incoming
    # Our own block's dk/dv, complete after a full turn (on one rank: what we just summed).
    own = grads_out
    if ring.world > 1:
        own = torch.empty(ring.block_floats(ring.k_rows[ring.rank]))
        dist.irecv(own, ring.prev, group=ring.group, tag=_TAG_GRADIENTS).wait()
        grads_out_work.wait()
    dk, dv = ring.unpack(own, ring.k_rows[ring.rank])
    return dq, dk.clone(), dv.clone()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        q, k, v = q.detach(), k.detach(), v.detach()
        out, lse = _forward(ring, q, k, v)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.ring, q, k, v, out, lse, dout.contiguous())
        return dq, dk, dv, None


def ring_attention(q, k, v, *, group=None, causal=None, scale=None, key_lengths=None,
                   sharding: str = "zigzag", threads=None):
    """Attention over the whole sharded sequence, for this rank's query rows.

    q ``[B, Hq, nq_r, d]``, k ``[B, Hkv, nk_r, d]``, v ``[B, Hkv, nk_r, dv]``: this rank's
    shards (``qkv.dist.shard``) of the global q, k, v, CPU float32. Collective: every
    rank of `group` (default: the default group) calls it with the same options.
    Returns this rank's rows of ``softmax(scale·q·kᵀ)·v`` ``[B, Hq, nq_r, dv]``,
    differentiable with respect to q, k and v (the backward is collective too).

    causal: None/False, True or "top_left" (PyTorch's ``is_causal``), "bottom_right";
        positions are global. key_lengths: per batch entry, global keys
        [0, key_lengths[b]) take part. scale: default 1/sqrt(d). GQA when Hq is a
        multiple of Hkv. threads: per rank, None = every hardware thread.

    Every rank raises the same qkv.Error when any rank's arguments are bad.
    """
    fn = "qkv.dist.ring_attention"
    _check_sharding(fn, sharding)
    if causal is None or causal is False:
        causal = "none"
    elif causal is True:
        causal = "top_left"
    elif causal not in ("top_left", "bottom_right"):
        raise Error(f"{fn}: causal: expected None, True, 'top_left' or 'bottom_right', got {causal!r}")
    lengths = [] if key_lengths is None else [int(n) for n in key_lengths]
    ring = _Ring(q, k, v, group=group, causal=causal, scale=scale, key_lengths=lengths,
                 sharding=sharding, threads=threads)
    return _RingAttention.apply(q, k, v, ring)
