// The programmable modifiers (qkv/modifiers.hpp) at the kernels' tile level: one
// indirect call per 64×64 score tile into the user's loop (compiled in the user's
// translation unit, the callable inlined there), and the backward's chain rule through
// score_mod. The kernels call these where they apply the built-in soft-cap and ALiBi.
#if defined(QKV_CPU_MODIFIER_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_MODIFIER_TILES_INL_H_
#undef QKV_CPU_MODIFIER_TILES_INL_H_
#else
#define QKV_CPU_MODIFIER_TILES_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "hwy/highway.h"
#include "core/problem.hpp"
#include "cpu/block_mask.hpp"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The tile st[key][query] (ld floats per key row) of the block's queries: only the
// block's real queries (rows.count of them) are passed, never the padding columns.
inline hooks::ScoreTile ModifierTile(const QueryRows& rows, int64_t first_key, int64_t keys,
                                     float* st, std::size_t ld, float* derivative) {
  return {.scores = st, .derivative = derivative, .ld = ld, .batch = rows.batch,
          .head = rows.head, .first_query = rows.first, .queries = rows.count,
          .first_key = first_key, .keys = keys};
}

// st ← score_mod(st) on one tile; with `derivative` (backward), also d mod / d score there.
inline void ApplyScoreMod(const ScoreModHook& mod, const QueryRows& rows, int64_t first_key,
                          int64_t keys, float* st, std::size_t ld, float* derivative) {
  mod.tile(mod.context, ModifierTile(rows, first_key, keys, st, ld, derivative));
}

// A partial tile's scores become −inf where mask_mod removes the pair.
inline void ApplyMaskMod(const MaskModHook& mod, const QueryRows& rows, int64_t first_key,
                         int64_t keys, float* st, std::size_t ld) {
  mod.apply(mod.context, ModifierTile(rows, first_key, keys, st, ld, nullptr));
}

// dSᵀ ← dSᵀ ⊙ (d mod / d score) over keys × width entries, keeping dS = 0 where it is 0
// (removed keys and padding columns): the derivative there may be anything, even NaN, and
// must not leak through 0·NaN.
HWY_INLINE void ChainScoreMod(float* HWY_RESTRICT dst, const float* HWY_RESTRICT derivative,
                              std::size_t keys, std::size_t width) {
  const hn::ScalableTag<float> d;
  const std::size_t lanes = hn::Lanes(d);
  for (std::size_t e = 0; e < keys * width; e += lanes) {
    const auto ds = hn::LoadU(d, dst + e);
    const auto chained = hn::Mul(ds, hn::LoadU(d, derivative + e));
    hn::StoreU(hn::IfThenZeroElse(hn::Eq(ds, hn::Zero(d)), chained), d, dst + e);
  }
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
