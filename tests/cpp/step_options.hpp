// What the BatchPlan step tests (test_tree_mask.cpp, test_shared_prefix.cpp) share: the
// sink logits they use, the options of a serving step, and bitwise comparison of results.
#pragma once

#include <qkv/options.hpp>
#include <qkv/tensor.hpp>

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace qkv::test {

// Per-head sink logits: −1, −0.5, 0, … (some below, some above the typical logit).
inline std::vector<float> sink_logits(int64_t heads) {
  std::vector<float> sinks(static_cast<std::size_t>(heads));
  for (int64_t h = 0; h < heads; ++h) sinks[h] = 0.5f * static_cast<float>(h) - 1.0f;
  return sinks;
}

// A serving step's options: causal bottom-right, `threads`, the soft-cap, and (sinks)
// the first q_heads of sink_logits(8).
inline AttentionOptions step_options(float softcap, bool sinks, int64_t q_heads, int threads) {
  static const std::vector<float> logits = sink_logits(8);
  AttentionOptions o;
  o.causal = Causal::bottom_right;
  o.execution.threads = threads;
  o.softcap = softcap;
  if (sinks) o.sinks = std::span<const float>(logits.data(), static_cast<std::size_t>(q_heads));
  return o;
}

template <int R>
bool same_bits(const Tensor<float, R>& a, const Tensor<float, R>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace qkv::test
