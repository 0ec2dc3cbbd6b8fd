// The adapter from a validated attention_forward call to the decode kernel: the same
// tensors, read in place, described as a contiguous key/value source.
#include "cpu/decode_dispatch.hpp"

#include "cpu/decode.hpp"
#include "cpu/decode_plan.hpp"

namespace qkv::cpu {

bool forward_by_decode(const detail::ForwardProblem<float>& p) {
  const detail::Extents& e = p.extents;
  // Only dense batches whose rows see a range of keys (causality, key_lengths, a sliding
  // window), with the inference variants (soft-cap, ALiBi, sinks): the decode kernel has
  // no elementwise masking, no varlen offsets and no dropout (a training feature).
  const detail::ScoreModifiers& mods = p.modifiers;
  if (p.mask.has_elementwise() || p.mask.sequences.varlen() || mods.has_dropout()) return false;
  if (e.q_len < 1 || e.q_len > kDecodeQueries) return false;
  if (!p.args.weights.empty()) return false;
  const auto& a = p.args;
  DecodeProblem d;
  d.batch = e.batch;
  d.q_len = e.q_len;
  d.q_heads = e.q_heads;
  d.kv_heads = e.kv_heads;
  d.head_dim = e.head_dim;
  d.v_dim = e.v_dim;
  d.q = a.q.data;
  d.q_batch = a.q.strides[0];
  d.q_row = a.q.strides[1];
  d.q_head = a.q.strides[2];
  d.kv.type = StorageType::float32;
  d.kv.k = a.k.data;
  d.kv.v = a.v.data;
  d.kv.k_strides = RowStrides::of(a.k);
  d.kv.v_strides = RowStrides::of(a.v);
  d.lengths = p.mask.key_lengths.empty() ? nullptr : p.mask.key_lengths.data();
  d.key_len = e.k_len;
  d.causal = p.mask.causal;
  d.window = p.mask.window;
  d.softcap = mods.softcap;
  d.alibi_slopes = mods.has_alibi() ? mods.alibi_slopes.data() : nullptr;
  d.sinks = mods.has_sinks() ? mods.sinks.data() : nullptr;
  d.out = a.out.data;
  d.out_batch = a.out.strides[0];
  d.out_row = a.out.strides[1];
  d.out_head = a.out.strides[2];
  if (!a.lse.empty()) {
    d.lse = a.lse.data;
    d.lse_batch = a.lse.strides[0];
    d.lse_head = a.lse.strides[1];
    d.lse_row = a.lse.strides[2];
  }
  d.scale = p.scale;
  d.threads = p.threads;
  decode(d);
  return true;
}

}  // namespace qkv::cpu
