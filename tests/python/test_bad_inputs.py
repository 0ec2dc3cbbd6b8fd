"""Bad inputs, each in its own process: every case must raise qkv.Error (a ValueError) or
TypeError naming the argument — a crash (a signal: segfault, abort) is a failure, and so
is a call that returns.

One runner subprocess imports qkv and torch once, then forks a child per case (the
parent never computes, so no OpenMP or torch thread pool exists to be forked); the child
runs the snippet and reports what it raised through a pipe. A child that dies reports
nothing and its signal is the result.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PENDING = "issue 22 item {}, fixed on branch pyoptions/validator"

# Names every snippet may use.
PRELUDE = """
import numpy as np, torch, qkv
f32 = np.float32
def qkv4(b=1, h=2, n=4, d=8, hk=None, nk=None, dtype=f32):
    rng = np.random.default_rng(0)
    hk = h if hk is None else hk
    nk = n if nk is None else nk
    return (rng.standard_normal((b, h, n, d)).astype(dtype), rng.standard_normal((b, hk, nk, d)).astype(dtype),
            rng.standard_normal((b, hk, nk, d)).astype(dtype))
q, k, v = qkv4()
def cache(**kw):
    return qkv.KVCache(2, 8, 1, 4, **kw)
kc = np.zeros((2, 1, 8, 4), f32); vc = np.zeros((2, 1, 8, 4), f32)
dq = np.zeros((2, 1, 1, 4), f32)
pool = np.zeros((4, 4, 1, 4), f32)
"""

# (id, snippet, expected exception: "Error" or "TypeError" or None = must return, needle
# the message must contain, pending item or None)
CASES = [
    # KVCache construction: sizes checked before anything is allocated (item 1).
    ("cache_capacity_wraps", "qkv.KVCache(1, 2**62 + 1, 1, 4)", "Error", "config.capacity", None),
    ("cache_product_overflows", "qkv.KVCache(2**20, 2**20, 2**20, 2**20)", "Error", "overflows", None),
    ("cache_append_after_wrap", "c = qkv.KVCache(1, 2**62 + 1, 1, 4); c.append(np.ones((1,1,1,4), f32), np.ones((1,1,1,4), f32))",
     "Error", "config.capacity", None),
    ("cache_too_big_to_allocate", "qkv.KVCache(1, 2**40, 1, 2**20)", "Error", "could not be allocated", None),
    ("cache_batch_zero", "qkv.KVCache(0, 8, 1, 4)", "Error", "config.batch", None),
    ("cache_capacity_negative", "qkv.KVCache(1, -3, 1, 4)", "Error", "config.capacity", None),
    ("cache_head_dim_zero", "qkv.KVCache(1, 8, 1, 0)", "Error", "config.head_dim", None),
    ("cache_block_size_zero", "cache(paged=True, block_size=0)", "Error", "config.block_size", None),
    ("cache_block_size_huge", "cache(paged=True, block_size=2**20)", "Error", "config.block_size", None),
    ("cache_num_blocks_negative", "cache(paged=True, num_blocks=-1)", "Error", "config.num_blocks", None),
    ("cache_num_blocks_past_int32", "qkv.KVCache(1, 2**40, 1, 1, paged=True, block_size=1)", "Error",
     "config.num_blocks", None),
    ("cache_dtype_unknown", "cache(dtype='float64')", "Error", "dtype", None),
    ("cache_append_wrong_head_dim", "cache().append(np.ones((2,1,1,5), f32), np.ones((2,1,1,5), f32))", "Error",
     "head_dim", None),
    ("cache_append_past_capacity", "cache().append(np.ones((2,1,9,4), f32), np.ones((2,1,9,4), f32))", "Error",
     "do not fit", None),
    ("cache_append_unknown_seq", "cache().append(np.ones((1,1,1,4), f32), np.ones((1,1,1,4), f32), seq=5)",
     "Error", "seqs[0]", None),
    ("cache_append_pool_exhausted",
     "cache(paged=True, block_size=4, num_blocks=1).append(np.ones((2,1,1,4), f32), np.ones((2,1,1,4), f32))",
     "Error", "num_blocks", None),
    ("cache_reset_unknown_seq", "cache().reset(7)", "Error", "seq", None),
    ("cache_attend_wrong_dim", "c = cache(); c.append(np.ones((2,1,1,4), f32), np.ones((2,1,1,4), f32)); "
     "c.attend(np.ones((2,1,1,3), f32))", "Error", "head_dim", None),
    # attention
    ("attention_rank3", "qkv.attention(q[0], k[0], v[0])", "Error", "q", None),
    ("attention_batch_mismatch", "qkv.attention(q, np.concatenate([k, k]), np.concatenate([v, v]))", "Error",
     "k.shape[0]", None),
    ("attention_head_dim_mismatch", "qkv.attention(q, k[..., :4].copy(), v)", "Error", "k.shape", None),
    ("attention_heads_not_a_multiple", "q3, k3, v3 = qkv4(h=3, hk=2); qkv.attention(q3, k3, v3)", "Error",
     "heads", None),
    ("attention_int_dtype", "qkv.attention(q.astype(np.int32), k, v)", "TypeError", "q", None),
    ("attention_mixed_dtypes", "qkv.attention(q, k.astype(np.float64), v)", "TypeError", "k", None),
    ("attention_mixed_frameworks", "qkv.attention(torch.from_numpy(q), k, v)", "TypeError", "k", None),
    ("attention_scale_zero", "qkv.attention(q, k, v, scale=0.0)", "Error", "scale", None),
    ("attention_scale_nan", "qkv.attention(q, k, v, scale=float('nan'))", "Error", "scale", None),
    ("attention_scale_past_float", "qkv.attention(q, k, v, scale=1e39)", "Error", "scale", None),
    ("attention_causal_unknown", "qkv.attention(q, k, v, causal='sideways')", "Error", "causal", None),
    ("attention_layout_unknown", "qkv.attention(q, k, v, layout='hbsd')", "Error", "layout", None),
    ("attention_mask_shape", "qkv.attention(q, k, v, mask=np.ones((1, 1, 4, 5), bool))", "Error", "mask", None),
    ("attention_mask_dtype", "qkv.attention(q, k, v, mask=np.ones((1, 1, 4, 4), np.int32))", "TypeError", "mask",
     None),
    ("attention_key_lengths_count", "qkv.attention(q, k, v, key_lengths=[1, 2])", "Error", "key_lengths", None),
    ("attention_key_lengths_negative", "qkv.attention(q, k, v, key_lengths=[-1])", "Error", "key_lengths", None),
    ("attention_key_lengths_past_nk", "qkv.attention(q, k, v, key_lengths=[5])", "Error", "key_lengths", None),
    ("attention_threads_negative", "qkv.attention(q, k, v, threads=-1)", "Error", "threads", None),
    ("attention_threads_huge", "qkv.attention(q, k, v, threads=2**40)", "Error", "threads", None),
    ("attention_window_past_int64", "qkv.attention(q, k, v, window=(2**63, 0))", "Error", "window", None),
    ("attention_window_below_minus_one", "qkv.attention(q, k, v, window=(-5, 0))", "Error", "window", None),
    ("attention_softcap_negative", "qkv.attention(q, k, v, softcap=-1.0)", "Error", "softcap", None),
    ("attention_alibi_count", "qkv.attention(q, k, v, alibi_slopes=[0.5])", "Error", "alibi_slopes", None),
    ("attention_alibi_empty", "qkv.attention(q, k, v, alibi_slopes=[])", "Error", "alibi_slopes", None),
    ("attention_sinks_empty", "qkv.attention(q, k, v, sinks=[])", "Error", "sinks", None),
    ("attention_sinks_nan", "qkv.attention(q, k, v, sinks=[float('nan'), 0.0])", "Error", "sinks", None),
    ("attention_dropout_above_one", "qkv.attention(q, k, v, dropout_p=1.5)", "Error", "dropout", None),
    ("attention_big_endian", "qkv.attention(q.astype('>f4'), k, v)", "Error", "q", None),
    ("attention_backend_unknown", "qkv.attention(q, k, v, backend='gpu')", "Error", "backend", None),
    ("attention_check_finite", "q[0, 0, 0, 0] = np.nan; qkv.attention(q, k, v, check_finite=True)", "Error",
     "q[0, 0, 0, 0]", None),
    ("backward_dout_shape", "o, l = qkv.attention(q, k, v, return_lse=True); "
     "qkv.attention_backward(q, k, v, o, l, o[:, :1].copy())", "Error", "dout", None),
    # varlen
    ("varlen_cu_decreasing", "x = np.ones((6, 2, 4), f32); "
     "qkv.varlen_attention(x, x, x, np.array([0, 4, 2, 6], np.int32), np.array([0, 2, 4, 6], np.int32))",
     "Error", "cu_seqlens_q", None),
    ("varlen_cu_past_total", "x = np.ones((6, 2, 4), f32); "
     "qkv.varlen_attention(x, x, x, np.array([0, 9], np.int32), np.array([0, 6], np.int32))", "Error",
     "cu_seqlens_q", None),
    # decode
    ("decode_lengths_past_capacity", "qkv.decode(dq, kc, vc, [9, 1])", "Error", "cache_lengths", None),
    ("decode_lengths_negative", "qkv.decode(dq, kc, vc, [-1, 1])", "Error", "cache_lengths", None),
    ("decode_lengths_count", "qkv.decode(dq, kc, vc, [1])", "Error", "cache_lengths", None),
    ("decode_block_out_of_pool", "qkv.decode(dq, pool, pool, [3, 3], block_table=np.array([[0], [9]], np.int32))",
     "Error", "block_table", None),
    ("decode_block_table_int64_wraps",
     "qkv.decode(dq, pool, pool, [3, 3], block_table=np.array([[0], [2**32 + 1]], np.int64))", "Error",
     "block_table", None),
    ("decode_threads_past_int32", "qkv.decode(dq, kc, vc, [1, 1], threads=2**31)", "Error", "threads", None),
    ("decode_window_none_left", "qkv.decode(dq, kc, vc, [1, 1], window=(None, 3))", None, "", None),
    ("decode_sinks_empty", "qkv.decode(dq, kc, vc, [1, 1], sinks=[])", "Error", "sinks", None),
    ("decode_int8_without_scales", "qkv.decode(dq, kc.astype(np.int8), vc.astype(np.int8), [1, 1])", "Error",
     "k_scale", None),
]

RUNNER = r"""
import json, os, signal, sys, traceback
cases = json.loads(sys.stdin.read())
prelude = cases.pop("__prelude__")
namespace = {}
exec(prelude, namespace)
import qkv
results = {}
for name, snippet in cases.items():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            exec(snippet, dict(namespace))
            outcome = {"kind": "returned"}
        except BaseException as e:
            kind = "Error" if isinstance(e, qkv.Error) else type(e).__name__
            outcome = {"kind": kind, "message": str(e)}
        os.write(write, json.dumps(outcome).encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        results[name] = {"kind": "signal", "message": signal.Signals(os.WTERMSIG(status)).name}
    else:
        results[name] = json.loads(data) if data else {"kind": "no report", "message": str(status)}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def outcomes():
    payload = {name: textwrap.dedent(snippet) for name, snippet, *_ in CASES}
    payload["__prelude__"] = PRELUDE
    done = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(payload), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _param(name, snippet, expected, needle, pending):
    marks = [pytest.mark.xfail(strict=True, reason=PENDING.format(pending))] if pending else []
    return pytest.param(name, snippet, expected, needle, id=name, marks=marks)


@pytest.mark.parametrize("name, snippet, expected, needle", [_param(*case) for case in CASES])
def test_bad_input_raises_naming_the_argument(outcomes, name, snippet, expected, needle):
    outcome = outcomes[name]
    assert outcome["kind"] != "signal", f"{snippet!r} crashed the process ({outcome['message']})"
    if expected is None:
        assert outcome["kind"] == "returned", f"{snippet!r}: {outcome}"
        return
    assert outcome["kind"] == expected, f"{snippet!r}: expected {expected}, got {outcome}"
    assert needle in outcome["message"], f"{snippet!r}: {needle!r} not in {outcome['message']!r}"


def test_the_table_names_each_case_once():
    names = [name for name, *_ in CASES]
    assert len(names) == len(set(names))
    assert len(names) >= 40
