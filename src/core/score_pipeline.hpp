// The score pipeline: what happens to a logit s = scale·q·k before the softmax, in the one
// order every backend and schedule applies (the reference per fp64 element, the tiled
// forward and backward per transposed score tile, the split-K schedule per row of keys):
//
//   soft-cap    s ← c·tanh(s/c)                         (Gemma 2)
//   ALiBi       s ← s − slope_h·|i + offset − j|        (offset: ScoreModifiers::alibi_offset)
//   score_mod   s ← score_mod(s, b, h, i, j)            (qkv/modifiers.hpp)
//   mask        s ← s + bias_ij, or −inf where the key does not take part (key ranges,
//               boolean mask, mask_mod: MaskRule)
//
// and in the backward the chain rule back through the same stages in reverse order.
// The built-ins are stages exactly like a user's score_mod: a backend says how it applies
// each stage to its unit of work (a `Stages` object with softcap(c), alibi(), score_mod(hook)
// and mask()); this file alone says which stages run and in which order. A new built-in
// (a per-head temperature, say) is one more `if` here and one more member in each Stages.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "core/problem.hpp"

namespace qkv::detail {

template <class Stages>
void apply_score_pipeline(const ScoreModifiers& mods, Stages&& stages) {
  if (mods.softcap > 0.0f) stages.softcap(mods.softcap);
  if (mods.has_alibi()) stages.alibi();
  if (mods.has_score_mod()) stages.score_mod(mods.score_mod);
  stages.mask();
}

// dS → d(scale·q·k), reversing apply_score_pipeline: the mask's derivative is 1 on the keys
// that take part and dS is already 0 on the others; ALiBi's derivative is 1 (the stage may
// collect its slope's gradient from dS here); then score_mod's, then the soft-cap's.
template <class Stages>
void chain_score_pipeline(const ScoreModifiers& mods, Stages&& stages) {
  if (mods.has_alibi()) stages.alibi();
  if (mods.has_score_mod()) stages.score_mod(mods.score_mod);
  if (mods.softcap > 0.0f) stages.softcap(mods.softcap);
}

// The stages' definitions: one logit of element (b, h, i, j) in double, keeping
// d logit / d(scale·q·k) in `slope` (1 on entry) — the reference's stages, which the
// cpu schedules' tile and row stages (cpu/score_pipeline-inl.h) must agree with.
struct ElementStages {
  const MaskRule& rule;
  const ScoreModifiers& mods;
  int64_t b, h, i, j;
  double& logit;
  double& slope;

  void softcap(float cap) {
    const double c = cap;
    const double t = std::tanh(logit / c);
    logit = c * t;
    slope = 1.0 - t * t;
  }
  void alibi() {
    const int64_t aligned = i + ScoreModifiers::alibi_offset(rule, b);
    logit -= static_cast<double>(mods.alibi_slopes[h]) * static_cast<double>(std::abs(aligned - j));
  }
  void score_mod(const ScoreModHook& mod) {  // in double when the user's callable allows it
    if (mod.derivative != nullptr) slope *= mod.derivative(mod.context, logit, b, h, i, j);
    logit = mod.value(mod.context, logit, b, h, i, j);
  }
  // Keys that do not take part never get here (score_row skips them); mask_mod removes
  // keys through MaskRule::takes_part.
  void mask() { logit += static_cast<double>(rule.bias_at(b, h, i, j)); }
};

}  // namespace qkv::detail
