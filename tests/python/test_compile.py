"""qkv under torch.compile (fullgraph) and torch.export: every entry point is a
torch.library operator with a fake implementation and an autograd formula
(torch.library.opcheck checks them), so tracing has no graph break inside qkv, and a
compiled call computes what the eager call computes, bitwise where the kernels are the
same (dropout included: the compiled graph draws its seed as the eager call does).

The compiled tests use backend="aot_eager" (dynamo and AOTAutograd, what decides graph
breaks and the operators' registrations; no C++ code generation, which would cost a
minute a test on the 2-core CI machine). QKV_INDUCTOR_TESTS=1 adds the same checks
under the default backend (inductor).
"""

from __future__ import annotations

import os

import pytest
import torch

import qkv
import qkv.torch as qt

transformers = pytest.importorskip("transformers")
import qkv.transformers  # noqa: E402  (registers attn_implementation="qkv")

HEADS, DIM = 4, 8
inductor = pytest.mark.skipif(not os.environ.get("QKV_INDUCTOR_TESTS"),
                              reason="set QKV_INDUCTOR_TESTS=1 (a minute per test)")


def _qkv(*shape, grad=True):
    return tuple(torch.randn(*shape).requires_grad_(grad) for _ in range(3))


def _vectors():
    return torch.rand(HEADS).requires_grad_(), torch.randn(HEADS).requires_grad_()


def _eager_and_compiled(f, inputs, backend="aot_eager"):
    """((value, grads) eager, (value, grads) compiled), each after torch.manual_seed(5),
    grads of sum(value²) with respect to `inputs`."""
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    results = []
    for fn in (f, compiled):
        torch.manual_seed(5)
        value = fn()
        grads = torch.autograd.grad(value.pow(2).sum(), inputs)
        results.append((value, grads))
    return results


def _assert_same(eager, compiled):
    (a, grads_a), (b, grads_b) = eager, compiled
    assert torch.equal(a, b)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.equal(ga, gb)


# -- the operators ---------------------------------------------------------------------


def _op_cases():
    q, k, v = _qkv(1, HEADS, 5, DIM)
    slopes, sinks = _vectors()
    seed = torch.tensor(7)
    dense = (None, None, None, None, "top_left", "bhsd", "auto", 1, False)
    variants = (2, 0, slopes, 3.0, sinks, 0.25, seed)
    constant = (2, 0, slopes.detach(), 3.0, sinks.detach(), 0.25, seed)  # backward: no graph
    grads = dict(grad_sinks=True, grad_slopes=True)
    fwd = torch.ops.qkv.attention_forward
    out, lse = fwd(q, k, v, *dense, *variants)
    detached = (q.detach(), k.detach(), v.detach(), out.detach(), lse, torch.randn_like(out))
    cu = torch.tensor([0, 2, 5])
    packed = [x[0].transpose(0, 1).detach().requires_grad_() for x in (q, k, v)]
    vout, vlse = torch.ops.qkv.varlen_forward(*packed, cu, cu, 0, 0, *dense, *variants)
    caches = [torch.randn(2, 2, 16, DIM) for _ in range(2)]
    cache = qkv.KVCache(2, 64, 2, DIM)
    cache.append(torch.randn(2, 2, 3, DIM), torch.randn(2, 2, 3, DIM))
    return {
        "attention_forward": (fwd, (q, k, v, *dense, *variants)),
        "attention_backward": (torch.ops.qkv.attention_backward,
                               (*detached, *dense, *constant), grads),
        "attention_forward_stats": (torch.ops.qkv.attention_forward_stats,
                                    (q, k, v, *dense, *variants, None, None, None, 0, 0, 0.9,
                                     True)),
        "varlen_forward": (torch.ops.qkv.varlen_forward, (*packed, cu, cu, 0, 0, *dense, *variants)),
        "varlen_backward": (torch.ops.qkv.varlen_backward,
                            (*(x.detach() for x in packed), vout.detach(), vlse,
                             torch.randn_like(vout), cu, cu, 3, 3, *dense, *constant), grads),
        "decode": (torch.ops.qkv.decode,
                   (torch.randn(2, HEADS, 1, DIM), *caches, torch.tensor([9, 16]), None, None,
                    None, None, "bottom_right", "bhsd", 1, 4, -1, None, 2.0, sinks.detach())),
        "kv_cache_attend": (torch.ops.qkv.kv_cache_attend,
                            (cache.torch_state(), cache.handle, torch.randn(2, HEADS, 2, DIM),
                             "bhsd", DIM, None, "bottom_right", 1, -1, -1, slopes.detach()), cache),
    }


@pytest.mark.parametrize("name", ["attention_forward", "attention_backward",
                                  "attention_forward_stats", "varlen_forward",
                                  "varlen_backward", "decode", "kv_cache_attend"])
def test_operators_pass_opcheck(name):
    """Schema, fake implementation and autograd registration of each operator agree with
    what it computes (torch.library.opcheck), variants and gradients included."""
    op, args, *rest = _op_cases()[name]
    kwargs = rest[0] if rest and isinstance(rest[0], dict) else {}
    torch.library.opcheck(op.default, args, kwargs)  # (rest: a KVCache lives while used)


def test_kv_cache_append_declares_its_mutation():
    """kv_cache_append writes the new lengths into its state tensor (its declared
    mutation, which orders it before the attends that read the state); opcheck checks
    that it mutates what it says and nothing else (each of its runs appends again)."""
    cache = qkv.KVCache(2, 64, 2, DIM)
    state = cache.torch_state()
    torch.library.opcheck(torch.ops.qkv.kv_cache_append.default,
                          (state, cache.handle, torch.randn(2, 2, 3, DIM),
                           torch.randn(2, 2, 3, DIM), None))
    torch.ops.qkv.kv_cache_append(state, cache.handle, torch.randn(1, 2, 1, DIM),
                                  torch.randn(1, 2, 1, DIM), [1])
    first, second = cache.lengths
    assert state.tolist() == [first, second] and second == first + 1 and first % 3 == 0


# -- the entry points under torch.compile ----------------------------------------------


@pytest.mark.parametrize("variant", ["window_alibi", "softcap_sinks", "dropout"])
def test_sdpa_variants_compile_to_the_eager_result(variant):
    q, k, v = _qkv(2, HEADS, 9, DIM)
    slopes, sinks = _vectors()
    kwargs, grads_of = {
        "window_alibi": (dict(window=(3, 1), alibi_slopes=slopes), (slopes,)),
        "softcap_sinks": (dict(softcap=4.0, sinks=sinks), (sinks,)),
        "dropout": (dict(dropout_p=0.3, is_causal=True), ()),
    }[variant]
    _assert_same(*_eager_and_compiled(
        lambda: qt.scaled_dot_product_attention(q, k, v, **kwargs), (q, k, v, *grads_of)))


def test_attention_and_varlen_with_every_variant_compile_to_the_eager_result():
    slopes, sinks = _vectors()
    variants = dict(window=(2, 0), alibi_slopes=slopes, softcap=3.0, sinks=sinks, dropout_p=0.2)
    q, k, v = _qkv(2, 7, HEADS, DIM)  # bshd
    _assert_same(*_eager_and_compiled(
        lambda: qkv.attention(q, k, v, layout="bshd", causal="bottom_right", **variants),
        (q, k, v, slopes, sinks)))
    q, k, v = _qkv(11, HEADS, DIM)
    cu = torch.tensor([0, 4, 11])
    _assert_same(*_eager_and_compiled(
        lambda: qkv.varlen_attention(q, k, v, cu, cu, causal="top_left", **variants),
        (q, k, v, slopes, sinks)))


def test_decode_and_a_kv_cache_loop_compile_to_the_eager_result():
    """qkv.decode, and a generation step (append, attend) of a KVCache: the compiled
    step on one cache, the eager on another, give the same outputs and lengths."""
    torch._dynamo.reset()
    k_cache, v_cache = torch.randn(2, 2, 32, DIM), torch.randn(2, 2, 32, DIM)
    lengths = torch.tensor([5, 9])
    q = torch.randn(2, HEADS, 1, DIM)

    def f(q):
        return qkv.decode(q, k_cache, v_cache, lengths, window=(3, -1), softcap=5.0,
                          return_lse=True)

    for a, b in zip(f(q), torch.compile(f, backend="aot_eager", fullgraph=True)(q)):
        assert torch.equal(a, b)

    def step(cache, k, v, q):
        cache.append(k, v)
        return cache.attend(q)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    eager_cache, traced_cache = (qkv.KVCache(2, 32, 2, DIM, dtype="bfloat16") for _ in range(2))
    for tokens in (3, 1, 1):
        k, v, q = torch.randn(2, 2, tokens, DIM), torch.randn(2, 2, tokens, DIM), torch.randn(2, HEADS, tokens, DIM)
        assert torch.equal(step(eager_cache, k, v, q), compiled(traced_cache, k, v, q))
        assert traced_cache.lengths == eager_cache.lengths == traced_cache.torch_state().tolist()


# -- one compiled function, many plans and caches (issue 45) ----------------------------


def _counting(backend):
    """(a backend that compiles with `backend` and counts the graphs it is given, the list
    of those graphs): one graph per compilation, so len(graphs) counts recompilations."""
    graphs = []

    def compile_fn(gm, example_inputs):
        graphs.append(gm)
        if backend == "eager":
            return gm.forward
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return torch._dynamo.backends.registry.lookup_backend(backend)(gm, example_inputs)

    return compile_fn, graphs


# Five serving steps over the same caches: each its own plan (other sequence splits and
# cache lengths), three new queries per step.
STEPS = [([0, 1, 3], [4, 9]), ([0, 2, 3], [5, 16]), ([0, 0, 3], [2, 3]), ([0, 3, 3], [8, 1]),
         ([0, 1, 3], [1, 2])]


def _plans_compiled_once(backend):
    torch._dynamo.reset()
    counted, graphs = _counting(backend)
    layer = torch.compile(lambda plan, q, k, v: plan.run(q, k, v), fullgraph=True, backend=counted)
    g = torch.Generator().manual_seed(45)
    k, v = torch.randn(2, 16, 1, DIM, generator=g), torch.randn(2, 16, 1, DIM, generator=g)
    for cu, lengths in STEPS:
        plan = qkv.BatchPlan(torch.tensor(cu), torch.tensor(lengths), num_heads=2, num_kv_heads=1, head_dim=DIM)
        q = torch.randn(3, 2, DIM, generator=g)
        assert torch.equal(layer(plan, q, k, v), plan.run(q, k, v))
    assert len(graphs) == 1, f"{len(graphs)} compilations for {len(STEPS)} plans"


def _caches_compiled_once(backend):
    """Three caches (float32, bfloat16, int8; other lengths each) through one compiled
    generation step; each against an eager twin fed the same tokens."""
    torch._dynamo.reset()
    counted, graphs = _counting(backend)

    def step(cache, k, v, q):
        cache.append(k, v)
        return cache.attend(q)

    compiled = torch.compile(step, fullgraph=True, backend=counted)
    g = torch.Generator().manual_seed(46)
    for dtype, prompt in (("float32", 3), ("bfloat16", 7), ("int8", 1)):
        traced, eager = (qkv.KVCache(2, 32, 2, DIM, dtype=dtype) for _ in range(2))
        k, v = torch.randn(2, 2, prompt, DIM, generator=g), torch.randn(2, 2, prompt, DIM, generator=g)
        traced.append(k, v)
        eager.append(k, v)
        for _ in range(2):
            k, v, q = (torch.randn(2, heads, 1, DIM, generator=g) for heads in (2, 2, HEADS))
            assert torch.equal(compiled(traced, k, v, q), step(eager, k, v, q))
            assert traced.lengths == eager.lengths == traced.torch_state().tolist()
    assert len(graphs) == 1, f"{len(graphs)} compilations for 3 caches"


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_one_compiled_layer_runs_a_new_plan_every_step_without_recompiling(backend):
    """A plan is named in the graph by a tensor handle (a graph input), never by an int
    the graph would specialize on: the second plan used to fail ('unhashable type:
    non-nested SymInt'), and each plan would otherwise cost a compilation."""
    _plans_compiled_once(backend)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_one_compiled_step_serves_many_kv_caches_without_recompiling(backend):
    _caches_compiled_once(backend)


def test_torch_export_of_a_plan_run_and_a_cache_attend_runs():
    """torch.export over a layer holding a plan and a cache: their handle tensors become
    the program's constants, and the program computes the eager layer's bits."""
    plan = qkv.BatchPlan(torch.tensor([0, 1, 3]), torch.tensor([4, 9]), num_heads=2, num_kv_heads=1, head_dim=DIM)
    cache = qkv.KVCache(2, 32, 1, DIM)
    cache.append(torch.randn(2, 1, 3, DIM), torch.randn(2, 1, 3, DIM))

    class Layer(torch.nn.Module):
        def forward(self, q, k, v, dq):
            return plan.run(q, k, v), cache.attend(dq)

    args = (torch.randn(3, 2, DIM), torch.randn(2, 16, 1, DIM), torch.randn(2, 16, 1, DIM),
            torch.randn(2, 2, 1, DIM))
    program = torch.export.export(Layer(), args)
    targets = {str(node.target) for node in program.graph.nodes}
    assert {"qkv.batch_plan_run.default", "qkv.kv_cache_attend.default"} <= targets
    for a, b in zip(program.module()(*args), Layer()(*args)):
        assert torch.equal(a, b)


def test_batch_plan_run_operator_fake_needs_no_plan():
    """The fake implementation takes out's head dim from v_cache: a handle whose plan is
    gone still traces (the real run, which needs the plan, says it is gone)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    handle = qkv.BatchPlan(torch.tensor([0, 1]), torch.tensor([4]), num_heads=2, num_kv_heads=1,
                           head_dim=DIM, v_dim=3)._handle  # the plan is dropped here
    with FakeTensorMode() as mode:
        out, lse = torch.ops.qkv.batch_plan_run(mode.from_tensor(handle), torch.empty(1, 2, DIM),
                                                torch.empty(1, 16, 1, DIM), torch.empty(1, 16, 1, 3), None, None)
    assert out.shape == (1, 2, 3) and lse.shape == (2, 1)
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.qkv.batch_plan_run(handle, torch.zeros(1, 2, DIM), torch.zeros(1, 16, 1, DIM),
                                     torch.zeros(1, 16, 1, 3), None, None)


# -- tiny transformers models ----------------------------------------------------------


def _model(family, dropout):
    # One layer (tracing time grows with the layers), two for gpt-oss: one sliding, one full.
    layers = 2 if family == "gpt_oss" else 1
    common = dict(vocab_size=61, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  max_position_embeddings=64)
    decoder = dict(common, intermediate_size=64, num_key_value_heads=2, attention_dropout=dropout,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        model = transformers.LlamaForCausalLM, transformers.LlamaConfig(**decoder)
    elif family == "bert":
        model = transformers.BertModel, transformers.BertConfig(
            **common, intermediate_size=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=dropout)
    elif family == "gemma2":
        model = transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
            **decoder, head_dim=8, attn_logit_softcapping=2.0, final_logit_softcapping=None,
            query_pre_attn_scalar=8, sliding_window=6)
    else:
        model = transformers.GptOssForCausalLM, transformers.GptOssConfig(
            **dict(decoder, intermediate_size=32), head_dim=8, num_local_experts=2,
            num_experts_per_tok=1, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"])
    model_class, config = model
    torch.manual_seed(0)
    config._attn_implementation = "qkv"
    return model_class(config)


def _output(model, ids):
    out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("family", ["llama", "bert", "gemma2", "gpt_oss"])
def test_tiny_models_compile_fullgraph_to_the_eager_result(family, mode):
    """Llama (GQA), BERT (encoder), Gemma 2 (soft-cap, sliding window) and gpt-oss
    (sinks with their gradient): torch.compile(fullgraph=True) of the whole model, in
    eval and in train mode (attention dropout 0.25, drawn alike), against eager. Traced
    calls get transformers' mask as it is, where eager calls route it to a causal mode
    or key lengths first (qkv.transformers), so the two agree to float32 rounding."""
    torch._dynamo.reset()
    model = _model(family, dropout=0.25)
    model.train(mode == "train")
    ids = torch.randint(3, 61, (2, 12))
    params = [p for p in model.parameters() if p.requires_grad]
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (model, compiled):
        torch.manual_seed(9)
        out = _output(fn, ids)
        results.append((out, torch.autograd.grad(out.pow(2).mean(), params, allow_unused=True)))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for ga, gb in zip(grads_a, grads_b):
        if ga is not None:
            torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-5)
    if mode == "train":  # the dropout acted: another seed gives another output
        torch.manual_seed(10)
        assert not torch.allclose(_output(compiled, ids), b, atol=1e-4)


def test_torch_export_of_a_tiny_model_runs():
    """torch.export.export of a Llama with attn_implementation="qkv": the exported
    program holds qkv's operator and computes the eager model's logits."""
    model = _model("llama", dropout=0.0).eval()
    ids = torch.randint(3, 61, (2, 10))
    with torch.no_grad():
        program = torch.export.export(model, (), {"input_ids": ids, "use_cache": False})
        assert any("qkv.attention_forward" in str(node.target) for node in program.graph.nodes)
        torch.testing.assert_close(program.module()(input_ids=ids, use_cache=False).logits,
                                   model(input_ids=ids, use_cache=False).logits,
                                   rtol=1e-5, atol=1e-5)


@inductor
def test_inductor_reproduces_eager_dropout_sinks_and_a_kv_cache():
    q, k, v = _qkv(2, HEADS, 9, DIM)
    _, sinks = _vectors()
    _assert_same(*_eager_and_compiled(
        lambda: qt.scaled_dot_product_attention(q * 2, k, v, dropout_p=0.3, sinks=sinks,
                                                window=(2, 2)),
        (q, k, v, sinks), backend="inductor"))


@inductor
def test_inductor_runs_many_plans_and_caches_without_recompiling():
    _plans_compiled_once("inductor")
    _caches_compiled_once("inductor")
