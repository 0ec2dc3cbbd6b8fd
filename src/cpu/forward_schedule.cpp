// The choice between the forward's two schedules, made here and nowhere else:
//   tiled    (forward.cpp)  — 64×64 score tiles, the tile plan's empty/full/partial classes,
//                             every mask, modifier and statistic;
//   split-K  (decode.cpp)   — few queries against many keys: each K/V head read once for the
//                             query heads of its GQA group, the keys split in fixed chunks
//                             merged by LSE; any key/value source (paged, int8, 16-bit).
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

}  // namespace qkv::cpu
