"""qkv.index_topk against the PyTorch formula (transformers' DeepseekV32Indexer math) and
torch.topk, both in float64.

Rule: qkv computes scores in float32, which may differ from the exact ones by up to
tol = (di + Hi + 8)·2⁻²⁴·max_j Σ_h |w_h|·scale·Σ_c |q_hc·k_jc| per row. So (1) the -1
padding is exact, (2) every listed key is allowed and listed once, (3) listed exact scores
never increase by more than 2·tol, and (4) no unlisted allowed key beats the last listed one
by more than 2·tol. Where the k-th and (k+1)-th exact scores are more than 2·tol apart the
set is then exactly torch.topk's, which is checked too.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import qkv  # noqa: E402


def exact_scores(q, k, w, scale):
    """[B, Nq, Nk] float64 scores and a per-row magnitude bound, by the formula."""
    q, k, w = q.double(), k.double(), w.double()
    logits = torch.einsum("bihc,bjc->bihj", q, k)
    scores = torch.einsum("bih,bihj->bij", w, torch.relu(scale * logits))
    bound = torch.einsum("bih,bihj->bij", w.abs(), scale * torch.einsum("bihc,bjc->bihj", q.abs(), k.abs()))
    return scores, bound.amax(dim=-1)


def allowed_mask(batch, nq, nk, causal, key_lengths):
    lengths = torch.full((batch,), nk) if key_lengths is None else torch.as_tensor(key_lengths)
    i = torch.arange(nq)[None, :, None]
    j = torch.arange(nk)[None, None, :]
    valid = lengths[:, None, None]
    allowed = j < valid
    if causal == "top_left":
        allowed = allowed & (j <= i)
    elif causal == "bottom_right":
        allowed = allowed & (j <= i + valid - nq)
    return allowed.expand(batch, nq, nk)


def check_against_torch(q, k, w, got, topk, causal="bottom_right", key_lengths=None, scale=None):
    batch, nq, heads, di = q.shape
    nk = k.shape[1]
    scale = di ** -0.5 if scale is None else scale
    scores, bound = exact_scores(q.float(), k.float(), w.float(), scale)
    tol = 2 * (di + heads + 8) * 2.0 ** -24 * bound
    allowed = allowed_mask(batch, nq, nk, causal, key_lengths)
    masked = scores.masked_fill(~allowed, float("-inf"))
    kk = min(topk, nk)
    ref_values, ref_indices = torch.topk(masked, kk, dim=-1) if kk else (None, None)
    got = torch.as_tensor(np.asarray(got)).long()
    assert got.shape == (batch, nq, topk)
    for b in range(batch):
        for i in range(nq):
            row_allowed = int(allowed[b, i].sum())
            listed = min(row_allowed, topk)
            row = got[b, i]
            assert (row[listed:] == -1).all(), (b, i)
            keys = row[:listed]
            assert (keys >= 0).all() and bool(allowed[b, i][keys].all()), (b, i)
            assert len(set(keys.tolist())) == listed, (b, i)
            if listed == 0:
                continue
            s = scores[b, i]
            t = float(tol[b, i])
            assert (s[keys][1:] <= s[keys][:-1] + t).all(), (b, i)
            unlisted = allowed[b, i].clone()
            unlisted[keys] = False
            last = float(s[keys[-1]])
            assert (s[unlisted] <= last + t).all(), (b, i)
            if listed < row_allowed:
                beyond = float(s[unlisted].max())
                if last - beyond > t:  # no near-tie at the boundary: torch.topk's very set
                    assert set(keys.tolist()) == set(ref_indices[b, i, :listed].tolist()), (b, i)
            else:
                assert set(keys.tolist()) == set(torch.nonzero(allowed[b, i]).flatten().tolist())


def inputs(batch, nq, nk, heads, di, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, nq, heads, di, generator=g).to(dtype)
    k = torch.randn(batch, nk, di, generator=g).to(dtype)
    w = torch.randn(batch, nq, heads, generator=g) * heads ** -0.5
    return q, k, w


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_torch_formula(causal, dtype):
    q, k, w = inputs(2, 21, 333, 6, 40, dtype)
    got = qkv.index_topk(q, k, w, 50, causal=causal, threads=2)
    assert got.dtype == torch.int32
    check_against_torch(q, k, w, got, 50, causal=causal)


def test_numpy_key_lengths_and_scale():
    q, k, w = inputs(3, 9, 200, 4, 16)
    lengths = [200, 7, 0]
    got = qkv.index_topk(q.numpy(), k.numpy(), w.numpy(), 12, key_lengths=lengths, scale=0.3,
                         threads=2)
    assert isinstance(got, np.ndarray) and got.dtype == np.int32
    check_against_torch(q, k, w, got, 12, key_lengths=lengths, scale=0.3)


def test_decode_one_query_many_keys():
    q, k, w = inputs(1, 1, 9000, 16, 64)
    got = qkv.index_topk(q, k, w, 512, threads=2)
    check_against_torch(q, k, w, got, 512)


def test_topk_beyond_the_keys_pads_with_minus_one():
    q, k, w = inputs(1, 5, 4, 2, 8)
    got = qkv.index_topk(q, k, w, 7, causal="top_left")
    check_against_torch(q, k, w, got, 7, causal="top_left")
    assert (got[0, 0, 1:] == -1).all() and (got[0, 4, 4:] == -1).all()


def test_same_result_for_any_thread_count():
    q, k, w = inputs(2, 37, 2500, 8, 32)
    one = qkv.index_topk(q, k, w, 100, threads=1)
    for threads in (2, 5):
        assert torch.equal(one, qkv.index_topk(q, k, w, 100, threads=threads))


def test_errors_name_the_function_and_argument():
    q, k, w = inputs(1, 3, 10, 2, 8)
    with pytest.raises(qkv.Error, match=r"qkv.index_topk: k: expected 3 dimensions"):
        qkv.index_topk(q, k[None], w, 4)
    with pytest.raises(qkv.Error, match=r"qkv::index_topk: k.shape\[2\] \(head_dim\)"):
        qkv.index_topk(q, k[..., :4], w, 4)
    with pytest.raises(qkv.Error, match=r"qkv.index_topk: topk: expected an int in \[0, 2147483647\]"):
        qkv.index_topk(q, k, w, -1)
    with pytest.raises(TypeError, match=r"qkv.index_topk: topk"):
        qkv.index_topk(q, k, w, 2.5)
    with pytest.raises(TypeError, match=r"qkv.index_topk: k"):
        qkv.index_topk(q, k.double(), w, 4)
    with pytest.raises(qkv.Error, match=r"options.key_lengths\[0\]"):
        qkv.index_topk(q, k, w, 4, key_lengths=[11])
    with pytest.raises(qkv.Error, match=r"causal"):
        qkv.index_topk(q, k, w, 4, causal="diagonal")
    with pytest.raises(TypeError, match=r"qkv.index_topk: every array must be of one type"):
        qkv.index_topk(q, k, w.numpy(), 4)


def test_large_keys_small_topk_never_builds_the_score_matrix():
    # [Nq, Nk] float32 scores would be 512 MiB; the running top-k keeps 4096·64 candidates.
    # (That no Nq×Nk buffer exists is by construction, src/cpu/index_topk.cpp; this checks
    # that such a call completes quickly.)
    q, k, w = inputs(1, 4096, 32768, 4, 32)
    start = time.perf_counter()
    got = qkv.index_topk(q, k, w, 64, threads=2)
    elapsed = time.perf_counter() - start
    assert got.shape == (1, 4096, 64)
    assert elapsed < 60, elapsed
    check_against_torch(q[:, -3:], k, w[:, -3:], got[:, -3:], 64)  # the same rows, bottom-right


def test_torch_operator_compiles_and_passes_opcheck():
    from qkv import _torch_ops_index  # noqa: F401

    q, k, w = inputs(1, 6, 40, 2, 8)
    eager = qkv.index_topk(q, k, w, 5)
    torch.library.opcheck(torch.ops.qkv.index_topk.default, (q, k, w, 5, None, "bottom_right", None, None))
    compiled = torch.compile(lambda q, k, w: qkv.index_topk(q, k, w, 5), fullgraph=True)
    assert torch.equal(compiled(q, k, w), eager)


@pytest.mark.parametrize("nq, nk", [(1, 9000), (21, 333)])
def test_bf16_precision_fast_and_exact(nq, nk):
    """bfloat16 q and k: "fast" (the default; on an AVX512-BF16 AMD CPU each head's logit is
    summed on vdpbf16ps from exact products) and "exact" (the float32 FMAs) both meet the
    float32 rule above: the same scores up to float32 summation order. Either is the same
    for any thread count; a bad precision is refused by name; under torch.compile only the
    default is taken (the operator does not carry it)."""
    q, k, w = inputs(1, nq, nk, 64, 128, torch.bfloat16, seed=3)
    for precision in (None, "fast", "exact"):
        got = qkv.index_topk(q, k, w, 256, precision=precision, threads=2)
        check_against_torch(q, k, w, got, 256)
        assert torch.equal(got, qkv.index_topk(q, k, w, 256, precision=precision, threads=1))
    with pytest.raises(qkv.Error, match="precision"):
        qkv.index_topk(q, k, w, 4, precision="fastest")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, pytest.raises(NotImplementedError, match="precision= is not traced"):
        qkv.index_topk(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(w), 4, precision="exact")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="precision= is not traced"):
        torch.compile(lambda q: qkv.index_topk(q, k, w, 4, precision="exact"), fullgraph=True,
                      backend="eager")(q)
