// The choice between the forward's two schedules, made here and nowhere else:
//   tiled    (forward.cpp)  — 64×64 score tiles, the tile plan's empty/full/partial classes,
//                             every mask, modifier and statistic;
//   split-K  (decode.cpp)   — few queries against many keys: each K/V head read once for the
//                             query heads of its GQA group, the keys split in fixed chunks
//                             merged by LSE; any key/value source (paged, int8, 16-bit).
// bfloat16 / float16 calls of that shape with Precision::fast take the split-K schedule too
// (its float queries and output around it); Precision::exact keeps the tiled one, bit for
// bit as before.
#include <algorithm>
#include <cstddef>
#include <vector>

#include "cpu/cpu_backend.hpp"
#include "cpu/decode.hpp"
#include "cpu/decode_plan.hpp"

namespace qkv::cpu {

bool split_k_eligible(const detail::MaskRule& mask, const detail::ScoreModifiers& mods) {
  // Rows that each see a range of keys (causality, key_lengths, a sliding window), with
  // the inference variants (soft-cap, ALiBi, sinks): the split-K schedule has no
  // elementwise mask, no dropout (a training feature), and runs the programmable
  // modifiers only per row (slower than the tiled schedule's per tile).
  return !mask.has_elementwise() && !mask.has_mask_mod() && !mods.has_dropout() && !mods.has_score_mod();
}

bool split_k_logits_for(const detail::MaskRule& mask, int64_t batch_entry) {
  return mask.q_len(batch_entry) <= kDecodeQueries;
}

bool split_k_shape(const detail::Extents& e, const detail::MaskRule& mask, const detail::ScoreModifiers& mods) {
  return split_k_eligible(mask, mods) && !mask.sequences.varlen() && e.q_len >= 1 && e.q_len <= kDecodeQueries;
}

bool runs_split_k(const detail::ForwardProblem<float>& p) {
  // A cache only the key/value source describes: the tiled schedule cannot read it.
  if (!p.kv_in_args()) return true;
  // The split-K schedule keeps no softmax statistics and no weights.
  if (p.collect_stats || !p.args.weights.empty()) return false;
  return split_k_shape(p.extents, p.mask, p.modifiers);
}

template <class T>
bool runs_split_k(const detail::ForwardProblem<T>& p) {
  return p.precision == Precision::fast && p.kv_in_args() && !p.collect_stats && p.args.weights.empty() &&
         split_k_shape(p.extents, p.mask, p.modifiers);
}
template bool runs_split_k(const detail::ForwardProblem<bfloat16>&);
template bool runs_split_k(const detail::ForwardProblem<float16>&);

template <class T>
void split_k_half(const detail::ForwardProblem<T>& p) {
  // A decode-shaped 16-bit call (transformers' decode step of a bf16 model: one query
  // against the cache) on the tiled schedule packed K and V into bf16 pairs and ran
  // vector-wide tiles for a handful of rows: ~3× the split-K schedule's time here, which
  // reads each stored row once, in place. The queries are few: widened into float (exact),
  // the output computed in float and rounded to T once, as the tiled schedule rounds it.
  const detail::Extents& e = p.extents;
  const auto d = static_cast<std::size_t>(e.head_dim), dv = static_cast<std::size_t>(e.v_dim);
  const auto rows = static_cast<std::size_t>(e.batch * e.q_len * e.q_heads);
  std::vector<float> q(rows * d), out(rows * dv);
  // q and out are contiguous [B, Nq, Hq, d | dv]: row r of them is (b, i, h) in that order.
  float* q_row = q.data();
  for (int64_t b = 0; b < e.batch; ++b)
    for (int64_t i = 0; i < e.q_len; ++i)
      for (int64_t h = 0; h < e.q_heads; ++h, q_row += d) {
        const T* from = &p.args.q(b, i, h, 0);
        std::transform(from, from + d, q_row, [](T x) { return static_cast<float>(x); });
      }
  detail::ForwardProblem<float> f;
  f.extents = e;
  f.scale = p.scale;
  f.mask = p.mask;
  f.modifiers = p.modifiers;
  f.threads = p.threads;
  f.fixed_key_split = p.fixed_key_split;
  f.precision = p.precision;
  f.args.q = View4<const float>::contiguous(q.data(), {e.batch, e.q_len, e.q_heads, e.head_dim});
  f.args.out = View4<float>::contiguous(out.data(), {e.batch, e.q_len, e.q_heads, e.v_dim});
  f.args.lse = p.args.lse;  // float for the 16-bit types: written in place
  f.kv = detail::KvSource::of_views(storage_type_of<T>, p.args.k, p.args.v);
  decode(f);
  const float* out_row = out.data();
  for (int64_t b = 0; b < e.batch; ++b)
    for (int64_t i = 0; i < e.q_len; ++i)
      for (int64_t h = 0; h < e.q_heads; ++h, out_row += dv)
        std::transform(out_row, out_row + dv, &p.args.out(b, i, h, 0), [](float x) { return T(x); });
}
template void split_k_half(const detail::ForwardProblem<bfloat16>&);
template void split_k_half(const detail::ForwardProblem<float16>&);

}  // namespace qkv::cpu
