"""qkv as a Hugging Face transformers attention implementation (qkv.transformers).

Tiny randomly initialised models built from configs (no downloads): a BERT encoder
(padding masks) and a Llama decoder (causal masks, grouped-query attention, KV-cache
generation), each run with attn_implementation="qkv" and "sdpa" on the same weights.

Tolerances. Both implementations compute attention in float32 and differ only in the
order of their sums, so each attention output differs by a few float32 ulps; the models'
LayerNorm/RMSNorm, MLPs and residuals carry that through. Instead of a hand-picked
tolerance, each model also runs in float64 (PyTorch's attention) as the truth, and qkv's
error against it must be no larger than twice sdpa's (the project's numerics contract,
per output and per parameter gradient), plus a floor of 8 float32 ulps of the largest
value, for entries where both errors are at rounding level. Generated token ids must be
equal.

One exception, on mathematical grounds: the gradient of a key-projection bias is exactly
zero (adding b to every key adds q·b to every logit of a row, which the softmax ignores:
Σ_j ∂L/∂S_ij = 0). Its computed value is pure rounding noise of a sum of terms the size
of the key weight's gradient entries, so "no worse than sdpa" would compare two noises;
its floor is 8 float32 ulps of that weight gradient's largest entry instead.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qkv.transformers  # noqa: E402  (registers "qkv")
from qkv.transformers import route_mask  # noqa: E402

_MAJOR = int(transformers.__version__.split(".")[0])
_EPS32 = torch.finfo(torch.float32).eps


def _build(model_class, config, seed=0):
    """{"sdpa": model, "qkv": model, "truth": the float64 sdpa model}: equal weights.
    (Not eager in float64: its fully masked rows, which left padding makes, give NaN.)"""
    torch.manual_seed(seed)
    base = model_class(config)
    models = {}
    for name, impl in (("sdpa", "sdpa"), ("qkv", "qkv"), ("truth", "sdpa")):
        model = copy.deepcopy(base)
        model.set_attn_implementation(impl)
        if name == "truth":
            model = model.double()
        models[name] = model.eval()
    return models


def _assert_no_worse_than_sdpa(got, sdpa, truth, what):
    """max|got − truth| ≤ 2·max|sdpa − truth| + 8 ulp(max|truth|)."""
    truth = truth.double()
    qkv_error = (got.double() - truth).abs().max().item()
    sdpa_error = (sdpa.double() - truth).abs().max().item()
    floor = 8 * _EPS32 * max(truth.abs().max().item(), 1e-30)
    assert qkv_error <= 2 * sdpa_error + floor, (
        f"{what}: qkv's error {qkv_error:.3g} against float64, sdpa's {sdpa_error:.3g} "
        f"(floor {floor:.3g})")


_KEY_BIASES = ("attention.self.key.bias", "self_attn.k_proj.bias")


def _assert_gradients_no_worse_than_sdpa(grads):
    """Every parameter gradient; key-projection biases (exactly zero: module docstring)
    against the floor set by their weight's gradient."""
    for name in grads["qkv"]:
        if name.endswith(_KEY_BIASES):
            weight = grads["truth"][name[: -len("bias")] + "weight"]
            floor = 8 * _EPS32 * weight.abs().max().item()
            assert grads["truth"][name].abs().max().item() <= floor  # zero up to float64 noise
            for impl in ("qkv", "sdpa"):
                error = (grads[impl][name].double() - grads["truth"][name].double()).abs().max().item()
                assert error <= floor, f"gradient of {name}: {impl}'s {error:.3g} > floor {floor:.3g}"
            continue
        _assert_no_worse_than_sdpa(grads["qkv"][name], grads["sdpa"][name],
                                   grads["truth"][name], f"gradient of {name}")


def _bert_config(**overrides):
    settings = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    settings.update(overrides)
    return transformers.BertConfig(**settings)


def _llama_config(**overrides):
    settings = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    settings.update(overrides)
    return transformers.LlamaConfig(**settings)


def _padding_mask(lengths, seq, left=False):
    positions = torch.arange(seq)
    if left:
        return (positions[None, :] >= seq - torch.tensor(lengths)[:, None]).long()
    return (positions[None, :] < torch.tensor(lengths)[:, None]).long()


class _Calls:
    """Records what qkv.transformers passes to qkv.attention (the routed mask), or to its
    short path for plain calls (no mask, key lengths or window: test_transformers_plain_call.py)."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = qkv.transformers._qkv_attention
        original_plain = qkv.transformers._plain_torch_forward

        def spy(*args, **kwargs):
            self.calls.append({k: kwargs.get(k) for k in ("causal", "mask", "key_lengths", "window")})
            return original(*args, **kwargs)

        def plain_spy(*args, **kwargs):
            out = original_plain(*args, **kwargs)
            if out is not None:  # taken (else the full call follows, and spy records it)
                self.calls.append({"causal": kwargs["causal"], "mask": None, "key_lengths": None, "window": None})
            return out

        monkeypatch.setattr(qkv.transformers, "_qkv_attention", spy)
        monkeypatch.setattr(qkv.transformers, "_plain_torch_forward", plain_spy)


def test_registered_and_chosen_by_from_pretrained(tmp_path, monkeypatch):
    from transformers import AttentionInterface, AttentionMaskInterface

    assert AttentionInterface()["qkv"] is qkv.transformers.attention_forward
    assert "qkv" in AttentionMaskInterface()
    # The README's lines: a saved model loaded with attn_implementation="qkv".
    transformers.LlamaForCausalLM(_llama_config()).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="qkv")
    assert model.config._attn_implementation == "qkv"
    spy = _Calls(monkeypatch)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert len(spy.calls) == 2  # one per layer


@pytest.mark.skipif(_MAJOR < 5, reason="transformers < 5: BERT does not use the attention "
                                       "registry (its classes are fixed per implementation)")
@pytest.mark.parametrize("left", [False, True], ids=["right_padding", "left_padding"])
def test_bert_encoder_outputs_and_gradients(left, monkeypatch):
    models = _build(transformers.BertModel, _bert_config())
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (3, 13))
    mask = _padding_mask([13, 9, 4], 13, left=left)
    weights = torch.randn(3, 13, 64, dtype=torch.float64)  # loss = Σ weights ⊙ hidden
    spy = _Calls(monkeypatch)

    outputs, grads = {}, {}
    for name, model in models.items():
        model.zero_grad()
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (hidden.double() * weights).sum().backward()
        outputs[name] = hidden.detach()
        grads[name] = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                       if p.grad is not None}

    _assert_no_worse_than_sdpa(outputs["qkv"], outputs["sdpa"], outputs["truth"], "hidden states")
    torch.testing.assert_close(outputs["qkv"], outputs["sdpa"], rtol=0, atol=1e-5)
    assert grads["qkv"].keys() == grads["sdpa"].keys() and len(grads["qkv"]) > 20
    _assert_gradients_no_worse_than_sdpa(grads)

    # Right padding is each sequence's first L keys: qkv gets key lengths, not a mask.
    assert spy.calls and all(call["causal"] is None for call in spy.calls)
    if left:
        assert all(call["mask"] is not None and call["key_lengths"] is None
                   for call in spy.calls)
    else:
        assert all(call["mask"] is None and call["key_lengths"].tolist() == [13, 9, 4]
                   for call in spy.calls)


@pytest.mark.skipif(_MAJOR < 5, reason="transformers < 5: BERT does not use the attention "
                                       "registry")
def test_bert_without_padding_passes_no_mask(monkeypatch):
    models = _build(transformers.BertModel, _bert_config())
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(2))
    spy = _Calls(monkeypatch)
    with torch.no_grad():
        got = models["qkv"](input_ids=ids).last_hidden_state
        want = models["sdpa"](input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert spy.calls and all(call == {"causal": None, "mask": None, "key_lengths": None, "window": None}
                             for call in spy.calls)


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_llama_decoder_logits_and_gradients(padding, monkeypatch):
    """Causal self-attention with grouped-query attention (4 query heads, 2 key/value
    heads), trained for one loss: logits and every parameter gradient."""
    models = _build(transformers.LlamaForCausalLM, _llama_config())
    for model in models.values():
        model.train()  # attention dropout is 0: training mode must work
    torch.manual_seed(3)
    ids = torch.randint(3, 101, (3, 17))
    lengths = {"none": [17, 17, 17], "right": [17, 11, 5], "left": [17, 11, 5]}[padding]
    mask = _padding_mask(lengths, 17, left=padding == "left")
    labels = ids.masked_fill(mask == 0, -100)
    spy = _Calls(monkeypatch)

    logits, grads = {}, {}
    for name, model in models.items():
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        logits[name] = out.logits.detach()
        grads[name] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    valid = mask.bool()  # padded query positions are not part of any result
    _assert_no_worse_than_sdpa(logits["qkv"][valid], logits["sdpa"][valid],
                               logits["truth"][valid], "logits")
    torch.testing.assert_close(logits["qkv"][valid], logits["sdpa"][valid], rtol=0, atol=1e-5)
    _assert_gradients_no_worse_than_sdpa(grads)

    call = spy.calls[0]
    if padding == "none":
        assert call == {"causal": "top_left", "mask": None, "key_lengths": None, "window": None}
    elif padding == "right":  # causal + right padding: no mask either
        assert call["causal"] == "top_left" and call["mask"] is None
        assert call["key_lengths"].tolist() == lengths
    else:  # left padding is not a prefix of the keys: the mask itself
        assert call["mask"] is not None and call["key_lengths"] is None


@pytest.mark.parametrize("batch", [1, 3])
def test_llama_generate_with_kv_cache_gives_the_same_tokens(batch, monkeypatch):
    models = _build(transformers.LlamaForCausalLM, _llama_config(), seed=4)
    torch.manual_seed(5)
    ids = torch.randint(3, 101, (batch, 9))
    # Batched generation pads on the left (as tokenizers do for decoders).
    mask = _padding_mask([9, 6, 3][:batch], 9, left=True)
    spy = _Calls(monkeypatch)
    tokens = {}
    for name in ("sdpa", "qkv"):
        tokens[name] = models[name].generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
            use_cache=True, pad_token_id=0)
    assert tokens["qkv"].shape == (batch, 9 + 24)
    assert torch.equal(tokens["qkv"], tokens["sdpa"])
    # Prefill sees all 9 queries; each decode step one query against the cache.
    assert len(spy.calls) >= 2 * 24  # every layer, every step
    if batch == 1:  # no padding: prefill causal, decode with no mask at all
        assert spy.calls[0] == {"causal": "top_left", "mask": None, "key_lengths": None, "window": None}
        assert spy.calls[-1] == {"causal": None, "mask": None, "key_lengths": None, "window": None}


def test_dropout_in_training_is_reproducible_and_drops():
    # BERT fine-tuning in train mode: transformers passes the config's attention dropout.
    config = _bert_config(attention_probs_dropout_prob=0.1)
    model = transformers.BertModel(config)
    model.set_attn_implementation("qkv")
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        plain = model(input_ids=ids).last_hidden_state
    model.train()

    def run(seed):
        torch.manual_seed(seed)
        out = model(input_ids=ids).last_hidden_state
        out.square().sum().backward()
        grad = model.encoder.layer[0].attention.self.query.weight.grad.clone()
        model.zero_grad()
        return out.detach(), grad

    (a, ga), (b, gb), (c, _) = run(5), run(5), run(6)
    assert torch.isfinite(a).all() and torch.isfinite(ga).all()
    assert torch.equal(a, b) and torch.equal(ga, gb)  # torch.manual_seed reproduces a step
    assert not torch.equal(a, c)  # another seed, another mask
    assert not torch.allclose(a, plain, atol=1e-3)  # the dropout did act


def _gemma2_config():
    return transformers.Gemma2Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        attn_logit_softcapping=2.0, final_logit_softcapping=None, query_pre_attn_scalar=16,
        sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gpt_oss_config():
    return transformers.GptOssConfig(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
        bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("family", ["gemma2_softcap", "gpt_oss_sinks"])
def test_softcap_and_sinks_models_match_eager(family):
    """Gemma 2 (logits soft-capped at 2: strongly, so a dropped cap would show) and
    gpt-oss (learned sinks, sliding-window layers) against transformers' own eager
    attention. Gemma 2: float64 eager is the truth, and qkv's logits and every parameter
    gradient must be no worse than twice eager's float32 error plus the floor. gpt-oss's
    expert layers do not run in float64 (grouped matmuls take float32 at most), so there
    both run in float32 and must agree to 1e-5 of the largest value: attention's
    summation order moves each attention output by a few ulps, which the two layers
    carry into the logits; a missing sink or cap moves them by O(0.1)."""
    if family == "gemma2_softcap":
        model_class, config = transformers.Gemma2ForCausalLM, _gemma2_config()
    else:
        model_class, config = transformers.GptOssForCausalLM, _gpt_oss_config()
    torch.manual_seed(4)
    base = model_class(config)
    if family == "gpt_oss_sinks":
        with torch.no_grad():  # sinks start at 0; make them matter
            for layer in base.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    ids = torch.randint(3, 97, (2, 14), generator=torch.Generator().manual_seed(8))
    logits, grads = {}, {}
    runs = [("eager", "eager", torch.float32), ("qkv", "qkv", torch.float32)]
    if family == "gemma2_softcap":
        runs.append(("truth", "eager", torch.float64))
    for name, impl, dtype in runs:
        model = copy.deepcopy(base).to(dtype)
        model.set_attn_implementation(impl)
        model.eval()
        out = model(input_ids=ids).logits
        out.square().mean().backward()
        logits[name] = out.detach()
        grads[name] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["qkv"].keys() == grads["eager"].keys()
    if family == "gpt_oss_sinks":
        assert any(n.endswith("self_attn.sinks") for n in grads["qkv"])
        scale = logits["eager"].abs().max()
        torch.testing.assert_close(logits["qkv"], logits["eager"], rtol=0, atol=1e-5 * scale)
        for n in grads["qkv"]:
            bound = 1e-5 * max(grads["eager"][n].abs().max().item(), 1e-30)
            torch.testing.assert_close(grads["qkv"][n], grads["eager"][n], rtol=0, atol=bound,
                                       msg=f"gradient of {n}")
        return
    _assert_no_worse_than_sdpa(logits["qkv"], logits["eager"], logits["truth"], "logits")
    for n in grads["qkv"]:
        if n.endswith(_KEY_BIASES):
            continue  # exactly zero (module docstring); covered by the BERT and Llama tests
        _assert_no_worse_than_sdpa(grads["qkv"][n], grads["eager"][n], grads["truth"][n],
                                   f"gradient of {n}")


def test_half_precision_models_sum_in_float32_and_round_once():
    models = _build(transformers.LlamaForCausalLM, _llama_config(), seed=6)
    ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        reference = models["qkv"](input_ids=ids).logits
        for dtype in (torch.bfloat16, torch.float16):
            got = copy.deepcopy(models["qkv"]).to(dtype)(input_ids=ids).logits
            want = copy.deepcopy(models["sdpa"]).to(dtype)(input_ids=ids).logits
            assert got.dtype == dtype
            # Both run the whole model in `dtype`; only attention differs (qkv takes the
            # half tensors natively, sums in float32 and rounds its output once). Each is
            # within the dtype's rounding of the float32 model.
            bound = 16 * torch.finfo(dtype).eps * reference.abs().max()
            assert (got.float() - reference).abs().max() <= bound
            assert (want.float() - reference).abs().max() <= bound


# route_mask: each kind of mask transformers builds, and what qkv is asked to do with it.

def _sdpa_and_qkv(mask, batch=3, q_len=6, k_len=6, heads=2):
    """(qkv's output, sdpa's) on random inputs for `mask` through attention_forward."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(batch, heads, q_len, 16, generator=gen)
    k, v = (torch.randn(batch, heads, k_len, 16, generator=gen) for _ in range(2))
    module = torch.nn.Module().eval()
    module.is_causal = False
    got, _ = qkv.transformers.attention_forward(module, q, k, v, mask)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return got, want.transpose(1, 2)


def test_route_mask_finds_key_lengths_and_causality():
    keys, rows = torch.arange(6), torch.arange(6)[:, None]
    lengths = torch.tensor([6, 4, 1])
    padding = (keys < lengths[:, None, None, None]).expand(3, 1, 6, 6)
    causal = (keys <= rows) & (keys < lengths[:, None, None, None])
    cases = {
        "all kept": (torch.ones(3, 1, 6, 6, dtype=torch.bool), (None, None, False)),
        "padding [B,1,N,N]": (padding, (None, [6, 4, 1], False)),
        "padding [B,1,1,N]": (padding[:, :, :1], (None, [6, 4, 1], False)),
        "padding float": (torch.zeros(3, 1, 1, 6).masked_fill(~padding[:, :, :1],
                                                              torch.finfo(torch.float32).min),
                          (None, [6, 4, 1], False)),
        "causal": ((keys <= rows).expand(3, 1, 6, 6), ("top_left", None, False)),
        "causal + padding": (causal, ("top_left", [6, 4, 1], False)),
        "left padding": (padding.flip(-1), (None, None, True)),
        "per-head": (padding.expand(3, 2, 6, 6), (None, None, True)),
        "float bias": (torch.randn(3, 1, 6, 6), (None, None, True)),
        "float, a row fully removed": (
            torch.zeros(3, 1, 6, 6).masked_fill(~(keys < torch.tensor([6, 4, 0])[:, None, None,
                                                                                None]), -1e38),
            (None, None, True)),
    }
    for name, (mask, (want_causal, want_lengths, want_mask)) in cases.items():
        got_causal, got_lengths, got_mask, got_window = route_mask(mask, 3, 6, 6)
        assert got_causal == want_causal, name
        assert (None if got_lengths is None else got_lengths.tolist()) == want_lengths, name
        assert (got_mask is not None) == want_mask, name
        assert got_window is None, name
        got, want = _sdpa_and_qkv(mask)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6, msg=name)

    # Decoding over a KV cache: 2 new queries at positions 4 and 5 of 6 keys.
    cache = (keys <= torch.arange(2)[:, None] + 4).expand(3, 1, 2, 6)
    assert route_mask(cache, 3, 2, 6) == ("bottom_right", None, None, None)
    got, want = _sdpa_and_qkv(cache, q_len=2)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    # A static cache's mask is wider than the keys: sliced first, as for sdpa.
    wide = torch.cat([padding, torch.zeros(3, 1, 6, 4, dtype=torch.bool)], dim=-1)
    assert route_mask(wide, 3, 6, 6)[1].tolist() == [6, 4, 1]


def test_additive_masks_route_as_their_boolean_and_empty_rows_give_what_they_mean():
    """"qkv"'s masks are floats (0 / -inf) that route as the boolean they were built from:
    causal + right padding is still causal + key lengths, no mask read per element. A
    row that keeps no key (left padding under causality) gives 0 where its entries are
    -inf (the boolean's meaning) and the values' average where they are the dtype's
    finite minimum (eager-style masks, as sdpa computes them)."""
    from transformers.masking_utils import causal_mask_function

    def build(padding):
        return qkv.transformers.additive_mask(
            batch_size=3, q_length=6, kv_length=6, mask_function=causal_mask_function,
            attention_mask=padding.bool(), allow_is_causal_skip=True)

    right = build(_padding_mask([6, 4, 1], 6))
    assert right.dtype == torch.float32 and set(right.unique().tolist()) == {0.0, float("-inf")}
    got_causal, got_lengths, got_mask, _ = route_mask(right, 3, 6, 6)
    assert (got_causal, got_lengths.tolist(), got_mask) == ("top_left", [6, 4, 1], None)
    assert route_mask(right.clone(), 3, 6, 6)[1].tolist() == [6, 4, 1]  # read in full: same

    left = build(_padding_mask([6, 4, 1], 6, left=True))
    empty = ~(left == 0).any(-1, keepdim=True)  # [3, 1, 6, 1]: rows that keep no key
    assert empty.any()
    for mask in (left, left.clone()):  # as built, and as a model's copy of it
        routed = route_mask(mask, 3, 6, 6).mask
        assert routed is not None and routed.dtype == torch.bool
        got, want = _sdpa_and_qkv(mask)
        assert torch.all(got.transpose(1, 2)[empty.expand(3, 2, 6, 1).squeeze(-1)] == 0)
    finite = left.masked_fill(left == float("-inf"), torch.finfo(torch.float32).min)
    assert route_mask(finite, 3, 6, 6).mask is finite  # passed as it is
    got, want = _sdpa_and_qkv(finite)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)  # the average, as sdpa


def test_route_mask_finds_sliding_windows():
    """Causal sliding windows (Mistral's, Gemma 2's and gpt-oss's sliding layers) become
    qkv's window=(left, -1), bottom-right aligned: prefill, chunked prefill and one decode
    step (a suffix of the keys); with padding, or not a band, the mask stays."""
    def band(q_len, k_len, left, batch=3):
        position = torch.arange(q_len)[:, None] + (k_len - q_len)
        keys = torch.arange(k_len)
        return ((keys <= position) & (keys >= position - left)).expand(batch, 1, q_len, k_len)

    for q_len, k_len, left in [(6, 6, 2), (3, 10, 4), (1, 20, 7), (1, 9, 0)]:
        mask = band(q_len, k_len, left)
        assert route_mask(mask, 3, q_len, k_len) == ("bottom_right", None, None, (left, -1)), (q_len, k_len)
        got, want = _sdpa_and_qkv(mask, q_len=q_len, k_len=k_len)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6, msg=f"{q_len}x{k_len}")
    # A window wider than every row's history is plain causality.
    assert route_mask(band(6, 6, 5), 3, 6, 6).window is None
    padded = band(6, 6, 2).clone()
    padded[1, :, :, :1] = False
    assert route_mask(padded, 3, 6, 6).mask is not None
    ragged = band(1, 20, 7).clone()
    ragged[0, 0, 0, 15] = False  # a hole in the band
    assert route_mask(ragged, 3, 1, 20).mask is not None


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_sliding_window_models_generate_the_same_tokens(family, monkeypatch):
    """Gemma 2 (soft-cap, every other layer a sliding window of 8) and gpt-oss (sinks, a
    sliding and a full layer) prefill 14 tokens and generate 20 greedily with a KV cache:
    the same tokens as eager. The sliding layers' prefill reaches qkv as window=(7, -1)
    (tiles outside it skipped), not as a mask; their decode steps need neither
    (transformers keeps only the window's keys in those layers' caches)."""
    if family == "gemma2":
        model_class, config = transformers.Gemma2ForCausalLM, _gemma2_config()
    else:
        model_class, config = transformers.GptOssForCausalLM, _gpt_oss_config()
    torch.manual_seed(6)
    base = model_class(config).eval()
    ids = torch.randint(3, 97, (1, 14), generator=torch.Generator().manual_seed(9))
    tokens = {}
    spy = None
    for impl in ("eager", "qkv"):
        model = copy.deepcopy(base)
        model.set_attn_implementation(impl)
        if impl == "qkv":
            spy = _Calls(monkeypatch)
        tokens[impl] = model.generate(input_ids=ids, max_new_tokens=20, do_sample=False, use_cache=True,
                                      pad_token_id=0)
    assert tokens["qkv"].shape == (1, 34)
    assert torch.equal(tokens["qkv"], tokens["eager"])
    windows = [call["window"] for call in spy.calls if call["window"] is not None]
    assert windows and all(window == (7, -1) for window in windows)
    assert all(call["mask"] is None for call in spy.calls)


def test_route_mask_is_computed_once_per_mask():
    mask = (torch.arange(6) < torch.tensor([5, 3])[:, None, None, None]).expand(2, 1, 6, 6)
    first = route_mask(mask, 2, 6, 6)
    assert route_mask(mask, 2, 6, 6) is first  # every layer reuses the first routing
    mask = mask.clone()
    mask[1, 0, :, 4] = True  # now not a prefix: a new tensor, routed again
    assert route_mask(mask, 2, 6, 6)[2] is not None


def test_alternating_and_static_cache_masks_are_routed_once_each(monkeypatch):
    """Models that alternate a full and a sliding mask layer by layer (Gemma, gpt-oss),
    and static caches (masks wider than the keys, sliced per call), route each mask once
    per forward, not once per layer."""
    routed = []
    original = qkv.transformers._route

    def count(mask, *args):
        routed.append(mask.shape)
        return original(mask, *args)

    monkeypatch.setattr(qkv.transformers, "_route", count)
    keys, rows = torch.arange(8), torch.arange(8)[:, None]
    full = (keys <= rows).expand(2, 1, 8, 8).clone()
    sliding = full & (keys > rows - 3)
    wide = torch.cat([full, torch.zeros(2, 1, 8, 4, dtype=torch.bool)], dim=-1)
    for _ in range(6):  # six "layers"
        assert route_mask(full, 2, 8, 8).causal == "top_left"
        assert route_mask(sliding, 2, 8, 8).window == (2, -1)
        assert route_mask(wide, 2, 8, 8).causal == "top_left"
    assert len(routed) == 3


def test_collect_stats_logs_every_layer(monkeypatch):
    """Under qkv.torch.collect_stats() each layer's attention records its softmax
    statistics, labelled with the layer; the logits do not change."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config()).eval()
    model.set_attn_implementation("qkv")
    # 20 tokens: more than the 16 queries the decode kernel (which keeps no statistics)
    # would take, so logging changes no bit.
    ids = torch.arange(40).view(2, 20) + 3
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with qkv.torch.collect_stats(row_stats=True) as stats:
            logged = model(input_ids=ids).logits
    assert torch.equal(plain, logged)
    assert [r["label"] for r in stats] == ["layer 0", "layer 1"]
    for record in stats:
        assert record["shape"] == (2, 4, 20, 20)
        assert record["rows"].eq(20).all()  # causal: every row sees a key
        assert record["row_entropy"].shape == (2, 4, 20)
        # Row 0 of a causal call sees one key: weight 1, entropy 0.
        assert torch.all(record["row_max_weight"][:, :, 0] == 1)
    with qkv.torch.stats_label("custom"), qkv.torch.collect_stats() as labelled:
        with torch.no_grad():
            model(input_ids=ids)
    assert [r["label"] for r in labelled] == ["custom", "custom"]
