"""Absorbed multi-head latent attention over a latent cache, on a tiny DeepSeek-V3.

Builds a small DeepseekV3ForCausalLM from its transformers config (random weights, nothing
downloaded) and generates greedily twice:
  - transformers' eager model (it expands the latent cache into per-head keys and values);
  - the same weights with every attention layer replaced by the absorbed form engines run:
    one latent row c_kv and one rotary key k_pe per token in a cache of our own (paged if
    asked), the key up-projection W_UK folded into the query, qkv.mla_decode attending all
    heads against the one latent head, the value up-projection W_UV applied to its output.
The prompt goes through the same call as the decode steps (Nq = prompt length,
bottom-right causal). Prints both token lists and whether they are the same.

With --fused, each layer's step is one qkv.BatchPlan call that also writes the new tokens'
rows, as a serving engine runs it: the unrotated c_kv and k_pe go in with the rotary
tables, qkv rotates k_pe and q_pe (DeepSeek's pairs: the tables' angles repeated pairwise),
writes both pools and attends (FlashInfer's append_paged_mla_kv_cache and MLA run in one).

    python3 examples/mla_absorbed.py [--tokens 8] [--paged] [--cache-dtype bfloat16] [--fused]
"""

from __future__ import annotations

import argparse
import sys

import torch
import transformers

import qkv


def tiny_deepseek(seed: int):
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=128, initializer_range=0.1, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    return transformers.DeepseekV3ForCausalLM(config).eval()


class LatentCache:
    """Per layer: c_kv [B, capacity, kv_lora_rank] and k_pe [B, capacity, rope] — or, paged,
    pools [blocks, block_size, ·] and a block table handing out blocks in a shuffled order."""

    def __init__(self, batch, capacity, rank, rope, dtype, block_size=0):
        self.block_size, self.length = block_size, 0
        if block_size:
            per_seq = -(-capacity // block_size)
            order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(0))
            self.table = order.view(batch, per_seq).to(torch.int32)
            self.ckv = torch.zeros(batch * per_seq, block_size, rank, dtype=dtype)
            self.kpe = torch.zeros(batch * per_seq, block_size, rope, dtype=dtype)
        else:
            self.table = None
            self.ckv = torch.zeros(batch, capacity, rank, dtype=dtype)
            self.kpe = torch.zeros(batch, capacity, rope, dtype=dtype)

    def append(self, ckv, kpe):
        """ckv [B, T, rank], kpe [B, T, rope]: the new tokens' rows."""
        for t in range(ckv.shape[1]):
            j = self.length + t
            if self.block_size:
                rows = self.table[:, j // self.block_size].long()
                self.ckv[rows, j % self.block_size] = ckv[:, t].to(self.ckv.dtype)
                self.kpe[rows, j % self.block_size] = kpe[:, t].to(self.kpe.dtype)
            else:
                self.ckv[:, j] = ckv[:, t].to(self.ckv.dtype)
                self.kpe[:, j] = kpe[:, t].to(self.kpe.dtype)
        self.length += ckv.shape[1]


def rotary_tables(cos, sin, interleave):
    """transformers' cos/sin [B, T, rope] (cat(freqs, freqs)) as qkv's per-token tables
    [B·T, rope]: DeepSeek's interleave rotates pairs (2i, 2i+1) by angle i, qkv's pairs
    read repeat_interleave(freqs, 2); otherwise NeoX order, the tables as they are."""
    if interleave:
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
    return cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])


def absorbed_forward(attn, cache: LatentCache, fused: bool = False):
    """A forward for DeepseekV3Attention `attn` over `cache` (the model's own cache unused)."""
    heads, nope, rope, v_dim, rank = (attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim,
                                      attn.v_head_dim, attn.kv_lora_rank)
    w_kv = attn.kv_b_proj.weight.detach().view(heads, nope + v_dim, rank)
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [H, nope, rank], [H, v, rank]

    def forward(hidden_states, position_embeddings, attention_mask=None, **kwargs):
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

        batch, seq = hidden_states.shape[:2]
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states))).view(batch, seq, heads, nope + rope)
        q_pass, q_rot = q[..., :nope], q[..., nope:]
        compressed = attn.kv_a_proj_with_mqa(hidden_states)
        ckv, k_rot = compressed[..., :rank], compressed[..., rank:]
        ckv = attn.kv_a_layernorm(ckv)
        cos, sin = position_embeddings
        if fused:  # one call: rotate, write both pools, attend
            q_latent = torch.einsum("bthn,hnr->bthr", q_pass, w_uk)
            lengths = [cache.length + seq] * batch
            plan = qkv.BatchPlan([seq * b for b in range(batch + 1)], lengths, num_heads=heads, num_kv_heads=1,
                                 head_dim=rank + rope, v_dim=rank, block_table=cache.table,
                                 block_size=cache.block_size or None, scale=attn.scaling)
            table_cos, table_sin = rotary_tables(cos, sin, attn.config.rope_interleave)
            out = plan.run(torch.cat([q_latent, q_rot], -1).reshape(batch * seq, heads, rank + rope), cache.ckv, None,
                           k_rope_cache=cache.kpe, k_new=ckv.reshape(batch * seq, rank),
                           k_rope_new=k_rot.reshape(batch * seq, rope), rotary_cos=table_cos, rotary_sin=table_sin,
                           rotary_interleaved=bool(attn.config.rope_interleave))
            cache.length += seq
            out = torch.einsum("bthr,hvr->bthv", out.view(batch, seq, heads, rank), w_uv)
            return attn.o_proj(out.reshape(batch, seq, heads * v_dim)), None
        rotate = m.apply_rotary_pos_emb_interleave if attn.config.rope_interleave else m.apply_rotary_pos_emb
        # [B, H, T, rope] and [B, 1, T, rope], as transformers rotates them.
        q_rot, k_rot = rotate(q_rot.transpose(1, 2), k_rot.view(batch, 1, seq, rope), cos, sin)
        cache.append(ckv, k_rot[:, 0])
        q_latent = torch.einsum("bthn,hnr->bthr", q_pass, w_uk)  # W_UK folded into the query
        lengths = torch.full((batch,), cache.length, dtype=torch.int64)
        out = qkv.mla_decode(q_latent, q_rot.transpose(1, 2), cache.ckv, cache.kpe, lengths,
                             block_table=cache.table, scale=attn.scaling)  # [B, T, H, rank]
        out = torch.einsum("bthr,hvr->bthv", out, w_uv)  # W_UV applied to the output
        return attn.o_proj(out.reshape(batch, seq, heads * v_dim)), None

    return forward


@torch.no_grad()
def generate_absorbed(model, prompt, tokens, cache_dtype, block_size, fused=False):
    config = model.config
    caches = []
    for layer in model.model.layers:
        cache = LatentCache(prompt.shape[0], prompt.shape[1] + tokens, config.kv_lora_rank, config.qk_rope_head_dim,
                            cache_dtype, block_size)
        layer.self_attn.forward = absorbed_forward(layer.self_attn, cache, fused)
        caches.append(cache)
    ids, new = prompt, prompt
    for _ in range(tokens):
        start = caches[0].length
        positions = torch.arange(start, start + new.shape[1]).expand(new.shape[0], -1)
        logits = model(input_ids=new, position_ids=positions, use_cache=False).logits
        new = logits[:, -1:].argmax(-1)
        ids = torch.cat([ids, new], dim=1)
    return ids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--paged", action="store_true", help="paged latent pools (block size 4, shuffled blocks)")
    parser.add_argument("--cache-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fused", action="store_true",
                        help="one qkv.BatchPlan call a layer that rotates, writes the pools and attends")
    args = parser.parse_args(argv)
    model = tiny_deepseek(args.seed)
    prompt = torch.randint(3, model.config.vocab_size, (args.batch, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model.generate(prompt, max_new_tokens=args.tokens, do_sample=False, min_new_tokens=args.tokens)
    absorbed = generate_absorbed(model, prompt, args.tokens, getattr(torch, args.cache_dtype),
                                 4 if args.paged else 0, args.fused)
    print("eager:   ", eager[:, prompt.shape[1]:].tolist())
    print("absorbed:", absorbed[:, prompt.shape[1]:].tolist())
    same = torch.equal(eager, absorbed)
    print(f"same tokens as transformers' eager DeepSeek-V3: {'yes' if same else 'no'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
