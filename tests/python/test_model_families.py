"""Every softmax-attention model family that matters this round, on qkv.transformers
against transformers' own "eager" attention (the pinned transformers, 5.24.0).

Each family is built tiny from its config with random weights (no downloads), its
distinguishing feature switched on: grouped-query attention (every family but the MLA
ones has fewer key/value heads than query heads), a sliding window shorter than the
sequence (Mistral, Gemma 2/3, gpt-oss, DeepSeek-V4), logit soft-capping (Gemma 2),
attention sinks (gpt-oss, DeepSeek-V4), MLA (DeepSeek-V3), DSA with index_topk below the
sequence length (DeepSeek-V3.2, GLM-5), head_dim 16 with K = V and compressed layers
(DeepSeek-V4: one shared key/value head, compressed entries appended with their
0 / -inf block bias), gated attention next to linear-attention layers (Qwen3-Next).

Tolerance. Both runs are float32 on the same weights; they differ only in the order of
attention's sums (a few float32 ulps per attention output), which the tiny models' norms,
MLPs and residuals carry into the logits. 1e-4 of the largest |logit| is 10^3 times
that and 10^3 times smaller than what any semantic slip moves (a dropped sink, window or
cap, an inverted or missing mask entry: O(0.1) relative, issue 40 measured 0.7-1.3).
Padded query positions are not compared: their rows attend to nothing, and what a model
computes there is never read by a real token. Greedy generation with the cache must give
the same tokens.
"""

from __future__ import annotations

import ast
import copy
import pathlib
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qkv.transformers  # noqa: E402  (registers "qkv")

_VOCAB, _SEQ = 97, 12
# A window (and DSA's top-k) shorter than the prompt, so that they cut.
_WINDOW, _TOPK = 5, 4
# Weights drawn 5× wider than transformers' default (0.02), so that attention is not
# nearly uniform and a mask or sink slip moves the logits far beyond the tolerance.
_INIT = 0.1


def _config(name, **overrides):
    settings = dict(vocab_size=_VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=64, initializer_range=_INIT, pad_token_id=0,
                    bos_token_id=1, eos_token_id=2)
    settings.update(overrides)
    return getattr(transformers, name)(**settings)


def _mla(name, **overrides):
    """DeepSeek's multi-head latent attention, two layers (a dense MLP, then 4 experts)."""
    return _config(name, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                   num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                   kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8,
                   v_head_dim=8, **overrides)


def _dsa(name, **overrides):
    """MLA plus DeepSeek Sparse Attention's indexer keeping _TOPK keys per query."""
    return _mla(name, index_topk=_TOPK, index_head_dim=8, index_n_heads=2,
                mlp_layer_types=["dense", "sparse"], layer_types=None, **overrides)


# family → (model class, config factory)
FAMILIES = {
    "llama": ("LlamaForCausalLM", lambda: _config("LlamaConfig")),
    "mistral": ("MistralForCausalLM",
                lambda: _config("MistralConfig", head_dim=8, sliding_window=_WINDOW)),
    "qwen2": ("Qwen2ForCausalLM", lambda: _config("Qwen2Config")),
    "qwen3": ("Qwen3ForCausalLM", lambda: _config("Qwen3Config", head_dim=8)),
    "gemma2": ("Gemma2ForCausalLM", lambda: _config(
        "Gemma2Config", head_dim=8, attn_logit_softcapping=2.0, final_logit_softcapping=None,
        query_pre_attn_scalar=8, sliding_window=_WINDOW)),
    "gemma3": ("Gemma3ForCausalLM", lambda: _config(
        "Gemma3TextConfig", head_dim=8, query_pre_attn_scalar=8, sliding_window=_WINDOW,
        layer_types=["sliding_attention", "full_attention"])),
    "gpt_oss": ("GptOssForCausalLM", lambda: _config(
        "GptOssConfig", head_dim=8, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=_WINDOW,
        layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v3": ("DeepseekV3ForCausalLM", lambda: _mla("DeepseekV3Config")),
    "deepseek_v32": ("DeepseekV32ForCausalLM", lambda: _dsa("DeepseekV32Config")),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM",
                    lambda: _dsa("GlmMoeDsaConfig", indexer_types=None)),
    # One layer of each kind: sliding only, compressed sparse (entries of 2 tokens, with
    # its own indexer) and heavily compressed (entries of 4 tokens).
    "deepseek_v4": ("DeepseekV4ForCausalLM", lambda: _config(
        "DeepseekV4Config", num_hidden_layers=3, num_key_value_heads=1, head_dim=16,
        q_lora_rank=16, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        mlp_layer_types=["moe", "moe", "moe"], sliding_window=_WINDOW, o_groups=2,
        o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=_TOPK,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        qk_rope_head_dim=4)),
    "qwen3_next": ("Qwen3NextForCausalLM", lambda: _config(
        "Qwen3NextConfig", head_dim=8, layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2)),
}

# DeepSeek Sparse Attention hands every backend but eager/sdpa its top-k keys as
# `indices` (index_topk 4 < 12 tokens here, so the selection matters): they go to
# qkv.sparse_attention (qkv.transformers._sparse_indices), the mask folded into the lists.
# (index_topk >= the sequence does not make them None: the indexer then lists every key.)
SPARSE = ("deepseek_v32", "glm_moe_dsa")
MATCHING = tuple(FAMILIES)


def _build(family, seed=0):
    """(eager model, qkv model): the same random weights."""
    class_name, make_config = FAMILIES[family]
    if not hasattr(transformers, class_name):
        pytest.skip(f"{family}: not in transformers {transformers.__version__}")
    torch.manual_seed(seed)
    base = getattr(transformers, class_name)(make_config()).eval()
    with torch.no_grad():  # sinks start at 0 in some families; make them matter
        for name, parameter in base.named_parameters():
            if name.endswith("self_attn.sinks"):
                parameter.normal_(0.0, 1.0)
    models = []
    for impl in ("eager", "qkv"):
        model = copy.deepcopy(base)
        model.set_attn_implementation(impl)
        models.append(model)
    return models


def _batch(padded, seed=1):
    """Two prompts of _SEQ tokens; padded: the second one's first 5 are padding (left, as
    tokenizers pad for generation)."""
    ids = torch.randint(3, _VOCAB, (2, _SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, _SEQ, dtype=torch.long)
    if padded:
        mask[1, :5] = 0
        ids[1, :5] = 0
    return ids, mask


def _assert_close_to_eager(got, want, valid, what):
    scale = want[valid].abs().max().item()
    error = (got[valid] - want[valid]).abs().max().item()
    assert error <= 1e-4 * scale, f"{what}: max |qkv - eager| = {error:.3g}, 1e-4 × {scale:.3g}"


@pytest.mark.parametrize("family", MATCHING)
def test_family_matches_eager(family):
    """Logits of an unpadded and a left-padded batch within 1e-4 of eager's (relative to
    the largest), then 4 greedy tokens with the cache from the padded batch: the same."""
    eager, on_qkv = _build(family)
    for padded in (False, True):
        ids, mask = _batch(padded)
        with torch.no_grad():
            want = eager(input_ids=ids, attention_mask=mask).logits
            got = on_qkv(input_ids=ids, attention_mask=mask).logits
        _assert_close_to_eager(got, want, mask.bool(), f"{family}, padded={padded}")
    tokens = [model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                             do_sample=False, use_cache=True, pad_token_id=0)
              for model in (eager, on_qkv)]
    assert torch.equal(tokens[1], tokens[0]), f"{family}: {tokens[1]} != eager's {tokens[0]}"


@pytest.mark.parametrize("family", SPARSE)
def test_sparse_attention_families_reach_sparse_attention(family, monkeypatch):
    """DeepSeek-V3.2 and GLM-5 call qkv.sparse_attention with their top-k lists (the
    match with eager above is the proof of correctness; this shows the path taken: the
    dense call over every key, which ignoring `indices` did, is never made for them)."""
    import qkv._sparse

    _, on_qkv = _build(family)
    calls = []
    real = qkv._sparse.sparse_attention
    monkeypatch.setattr(qkv._sparse, "sparse_attention", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    ids, mask = _batch(padded=True)
    with torch.no_grad():
        on_qkv(input_ids=ids, attention_mask=mask)
    assert calls, f"{family}: qkv.sparse_attention was not called"
    # Folded lists: the left padding of the second prompt is never listed for it.
    assert all(((lists[1] < 5) & (lists[1] >= 0)).sum() == 0 for lists in calls)


def test_deepseek_v4_masks_are_additive_and_never_left_out(monkeypatch):
    """DeepSeek-V4's compressed layers append a 0 / -inf block bias to the mask, cast to
    the mask's dtype: "qkv"'s masks are floats (a boolean one would read -inf as True),
    and built even where a causal flag would do (None has nothing to append to), so a
    short unpadded prompt's compressed entries are seen as eager sees them."""
    eager, on_qkv = _build("deepseek_v4", seed=2)
    masks = []
    original = qkv.transformers.route_mask

    def spy(mask, batch, q_len, k_len):
        masks.append((k_len, mask))
        return original(mask, batch, q_len, k_len)

    monkeypatch.setattr(qkv.transformers, "route_mask", spy)
    ids = torch.randint(3, _VOCAB, (1, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # 4 tokens: inside the window of 5, two compressed entries
        want = eager(input_ids=ids).logits
        got = on_qkv(input_ids=ids).logits
    _assert_close_to_eager(got, want, torch.ones(1, 4, dtype=torch.bool), "4-token prompt")
    assert all(mask is not None and mask.dtype == torch.float32 for _, mask in masks)
    assert max(keys for keys, _ in masks) > 4  # compressed entries were appended


# Every keyword a transformers model passes to its attention function.

def _balanced(text, open_at):
    """text[open_at:] up to the parenthesis that closes the one at open_at."""
    depth = 0
    for end in range(open_at, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            return text[open_at:end + 1]
    raise ValueError(f"unbalanced parentheses from {text[open_at:open_at + 80]!r}")


def _call_keywords(text, match):
    """The keyword names of the call whose '(' ends `match` (None for **kwargs left out)."""
    call = ast.parse("f" + _balanced(text, match.end() - 1), mode="eval").body
    return [keyword.arg for keyword in call.keywords if keyword.arg is not None]


def _forward_parameters(text, before):
    """The parameter names of the last `def forward(` before offset `before`."""
    start = text.rfind("def forward(", 0, before)
    if start < 0:
        return set()
    signature = _balanced(text, start + len("def forward"))
    arguments = ast.parse(f"def f{signature}: pass").body[0].args
    return {argument.arg for argument in arguments.args + arguments.kwonlyargs}


_INTERFACE_CALL = re.compile(r"\battention_interface\(")
_LAYER_CALL = re.compile(r"\bself\.(?:self_attn|attn|attention|self_attention)\(")


def _attention_keywords():
    """{keyword: [where found]} read from the installed transformers (models/*/modeling_*.py):
    - the keywords of every `attention_interface(...)` call;
    - those of the **kwargs such calls forward: TransformersKwargs and FlashAttentionKwargs,
      and the keywords a file's `self.self_attn(...)`-style calls (decoder layers) give
      that no forward() calling attention_interface in the same file names. (A heuristic:
      a file's other attention modules add names that no model passes on; those are
      then checked as refused, which is what they would be.)
    Calls are found by text and only their source is parsed (parsing the 24 MB of
    modeling files whole takes ~25 s)."""
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    from transformers.utils.generic import TransformersKwargs

    found = {}
    root = pathlib.Path(transformers.__file__).parent / "models"
    for path in sorted(root.glob("*/modeling_*.py")):
        text = path.read_text(encoding="utf-8")
        named = set()
        for match in _INTERFACE_CALL.finditer(text):
            for keyword in _call_keywords(text, match):
                found.setdefault(keyword, []).append(path.parent.name)
            named |= _forward_parameters(text, match.start())
        if named:
            passed = {keyword for match in _LAYER_CALL.finditer(text)
                      for keyword in _call_keywords(text, match)}
            for keyword in passed - named:
                found.setdefault(keyword, []).append(path.parent.name)
    for typed in (TransformersKwargs, FlashAttentionKwargs):
        for name in typed.__annotations__:
            found.setdefault(name, []).append(typed.__name__)
    return found


def _call(**kwargs):
    """attention_forward on a small GQA problem with a causal boolean mask."""
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(2, 4, 5, 8, generator=gen)
    key, value = (torch.randn(2, 2, 5, 8, generator=gen) for _ in range(2))
    mask = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    module = torch.nn.Linear(1, 1).eval()  # any module: its class name is in the message
    return qkv.transformers.attention_forward(module, query, key, value, mask, scaling=0.3,
                                              **kwargs)[0]


def test_every_attention_keyword_is_implemented_or_refused():
    """A keyword the backend drops silently is a wrong answer waiting for a model to pass
    it. Every keyword found in the installed transformers is a named parameter of
    attention_forward, computed (IMPLEMENTED), known to say nothing the mask does not
    (CARRY_NOTHING: ignored, the output unchanged), or refused with NotImplementedError
    naming it and the module's class. A new keyword in a future transformers is refused
    until someone decides which."""
    import inspect

    found = _attention_keywords()
    # The scan must see what is known to be there, or it proves nothing.
    assert {"scaling", "dropout", "sliding_window", "s_aux", "softcap", "indices",
            "position_bias", "position_ids", "use_cache"} <= found.keys()
    named = set(inspect.signature(qkv.transformers.attention_forward).parameters)
    plain = _call()
    refused = []
    for keyword in sorted(found):
        if keyword in named or keyword in qkv.transformers.IMPLEMENTED:
            continue
        if keyword in qkv.transformers.CARRY_NOTHING:
            assert torch.equal(_call(**{keyword: torch.zeros(1)}), plain), keyword
            continue
        with pytest.raises(NotImplementedError, match=rf"Linear.*`{keyword}`"):
            _call(**{keyword: torch.zeros(1)})
        assert torch.equal(_call(**{keyword: None}), plain)  # None says nothing
        refused.append(keyword)
    assert "position_bias" in refused and "block_indices" in refused


def test_implemented_keywords_change_the_result_or_are_refused():
    """The IMPLEMENTED keywords act: soft-cap and sinks move the output; `indices` restricts
    each query to its listed keys within the mask (every query listing key 0 alone
    attends to key 0 alone: its output is key 0's value; listing every key, or keys the
    causal mask removes as well, changes nothing)."""
    plain = _call()
    assert not torch.allclose(_call(softcap=0.5), plain, atol=1e-3)
    assert not torch.allclose(_call(s_aux=torch.ones(4)), plain, atol=1e-3)
    gen = torch.Generator().manual_seed(4)
    torch.randn(2, 4, 5, 8, generator=gen)
    _, value = (torch.randn(2, 2, 5, 8, generator=gen) for _ in range(2))
    first_only = _call(indices=torch.zeros(2, 5, 3, dtype=torch.int32))
    want = value[:, :, 0].repeat_interleave(2, dim=1)[:, None].expand(2, 5, 4, 8)
    assert torch.allclose(first_only, want, atol=1e-6)
    every = torch.arange(5).expand(2, 5, 5)
    assert torch.allclose(_call(indices=every), plain, atol=1e-6)
    assert torch.allclose(_call(indices=torch.cat([every, every], -1)), plain, atol=1e-6)


def test_packed_sequences_without_a_mask_are_refused():
    """flash-attention's cu_seq_lens say nothing only when the mask separates the packed
    sequences; with no mask they would be attended as one."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    module = torch.nn.Linear(1, 1).eval()
    with pytest.raises(NotImplementedError, match="cu_seq_lens_q"):
        qkv.transformers.attention_forward(module, q, k, v, None,
                                           cu_seq_lens_q=torch.tensor([0, 2, 6]))
    qkv.transformers.attention_forward(module, q, k, v, None,  # one sequence: fine
                                       cu_seq_lens_q=torch.tensor([0, 6]))


# Attention forwards that concatenate or pad `attention_mask` before calling attention
# but are checked not to need a mask that "qkv" would leave out: the mask they extend is
# not one the mask builder makes.
_EXTEND_ANOTHER_MASK = {
    "granite_speech5": "pads its 2-D padding mask to whole blocks, then builds a bias",
}
_EXTENDS_MASK = re.compile(
    r"\battention_mask\s*=\s*(?:torch\.cat|F\.pad|(?:torch\.)?nn\.functional\.pad)\(")


def test_models_that_extend_their_masks_always_get_one():
    """A model that appends keys, and their mask entries, to the mask it is given needs a
    mask tensor where "sdpa" would pass None (qkv.transformers._MODELS_THAT_EXTEND_MASKS).
    Every attention forward in the installed transformers that extends `attention_mask`
    before its attention_interface call is on that list (by its directory, which is its
    model_type) or checked by hand above; a new one fails here until someone decides."""
    flagged = set()
    root = pathlib.Path(transformers.__file__).parent / "models"
    for path in sorted(root.glob("*/modeling_*.py")):
        text = path.read_text(encoding="utf-8")
        for match in _INTERFACE_CALL.finditer(text):
            start = text.rfind("def forward(", 0, match.start())
            if start >= 0 and _EXTENDS_MASK.search(text, start, match.start()):
                flagged.add(path.parent.name)
    assert "deepseek_v4" in flagged  # the scan sees the known one
    unchecked = flagged - qkv.transformers._MODELS_THAT_EXTEND_MASKS - set(_EXTEND_ANOTHER_MASK)
    assert not unchecked, f"attention forwards that extend their mask: {sorted(unchecked)}"


# bfloat16: the same families with bf16 weights and activations, against eager in bf16.
# Every backend rounds differently here (bf16 products, P rounded once or not), so there
# is no 1e-4 match to ask for; the contract (docs/numerics.md, issue 40) is qkv's distance
# from eager within 2× sdpa's own distance from eager on the same inputs. The distances are
# maxima over the real (unpadded) positions, relative to the largest |logit|.


def _bf16_distance(got, want, valid):
    got, want = got.float()[valid], want.float()[valid]
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("family", MATCHING)
def test_family_in_bfloat16_is_as_close_to_eager_as_sdpa(family):
    eager, on_qkv = _build(family)
    if not eager._supports_sdpa:  # the rule compares "where sdpa runs"
        pytest.skip(f"{family}: transformers has no sdpa attention for {type(eager).__name__}")
    sdpa = copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    models = [m.to(torch.bfloat16) for m in (eager, sdpa, on_qkv)]
    for padded in (False, True):
        ids, mask = _batch(padded)
        with torch.no_grad():
            want, by_sdpa, by_qkv = (m(input_ids=ids, attention_mask=mask).logits for m in models)
        valid = mask.bool()
        d_sdpa, d_qkv = _bf16_distance(by_sdpa, want, valid), _bf16_distance(by_qkv, want, valid)
        # A floor of one bf16 ulp of the largest logit (2^-8): where sdpa happens to round
        # exactly as eager does, 2× of nothing would ask for bits, not for the contract.
        assert d_qkv <= max(2 * d_sdpa, 2.0 ** -8), (
            f"{family}, padded={padded}: qkv {d_qkv:.3g} vs sdpa {d_sdpa:.3g} from eager (bf16)")
