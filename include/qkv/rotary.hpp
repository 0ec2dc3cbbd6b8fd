// qkv::Rotary — rotary position embedding (RoPE) as a stage of a serving step: the new
// tokens' queries and keys rotated on their way in, the keys then written into the cache
// (qkv::BatchPlan::run_appending, KVCache::append with a Rotary), as FlashAttention's
// flash_attn_with_kvcache does on GPUs.
//
// The tables are the ones transformers' rotary embeddings return, one row per position
// and rotary_dim wide (float32; callers with bf16/fp16 tables widen them: exact):
//   NeoX order (interleaved = false, Llama/Qwen/Mistral/GPT-NeoX): cos = cat(cos θ, cos θ)
//     over θ_0 .. θ_{r/2−1}; element i < r/2 pairs with i + r/2:
//       out[i]       = x[i]       · cos[i]       − x[i + r/2] · sin[i]
//       out[i + r/2] = x[i + r/2] · cos[i + r/2] + x[i]       · sin[i + r/2]
//     which is transformers' `x * cos + rotate_half(x) * sin` (apply_rotary_pos_emb).
//   interleaved (GPT-J, Cohere): cos = repeat_interleave(cos θ, 2); element 2i pairs
//     with 2i + 1: out[2i] = x[2i] · cos[2i] − x[2i+1] · sin[2i], out[2i+1] =
//     x[2i+1] · cos[2i+1] + x[2i] · sin[2i+1].
//   Partial rotary (Phi, GPT-NeoX, StableLM): rotary_dim < head_dim rotates the first
//   rotary_dim channels of each head; the rest pass through unchanged.
// Each element is rounded as PyTorch rounds `x * cos + rotate_half(x) * sin` in float32:
// each product once, then the sum once (no fused multiply-add), so a float32 rotation
// gives transformers' float32 bits exactly.
//
// Which row of the tables rotates new token r (r counts the new tokens in the order the
// call packs them: BatchPlan's total_q rows, KVCache::append's (sequence, token)):
//   positions empty:  row r — cos and sin are per new token, [new tokens, rotary_dim]
//                     (transformers' `rotary_emb(x, position_ids)` output, flattened);
//   positions given:  row positions[r] (int32 or int64, one per new token) of tables
//                     [max_position, rotary_dim] (a model's cached cos/sin tables).
//
// Errors (qkv::Error naming the argument; nothing is written): cos without sin or the
// other way round, shapes that differ, a last axis that is not contiguous, rotary_dim
// (cos.shape[1], or rotary_dim when set, which must then equal it) odd, 0 or larger than
// head_dim, a row count that is not the new tokens' (cos.shape[0], or positions.size()),
// a position outside [0, cos.shape[0]).
#pragma once

#include <cstdint>

#include "qkv/attention.hpp"  // SeqOffsets
#include "qkv/tensor.hpp"

namespace qkv {

struct Rotary {
  TensorView<const float, 2> cos, sin;  // [new tokens | max_position, rotary_dim]
  SeqOffsets positions;                 // optional: the table row of each new token
  int64_t rotary_dim = 0;               // 0: cos.shape[1]
  bool interleaved = false;             // pairs (2i, 2i+1) instead of (i, i + r/2)

  bool empty() const { return cos.empty() && sin.empty(); }
};

// out [n, H, d] = x [n, H, d] rotated, row r of x by table row r (or positions[r]): the
// rotation the appending runs apply to queries and keys, for callers that want it on its
// own (a reference, or queries kept elsewhere). out may be x itself (in place) but must
// not otherwise overlap it. Throws qkv::Error as above, writing nothing.
void apply_rotary(View3<const float> x, View3<float> out, const Rotary& rotary);

}  // namespace qkv
