// The validated, normalized form of one attention call that backends receive.
// Built only by validate.cpp; a backend may assume every invariant written here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "qkv/attention.hpp"
#include "qkv/options.hpp"

namespace qkv::detail {

struct Extents {
  int64_t batch = 0;
  int64_t q_len = 0;     // Nq
  int64_t k_len = 0;     // Nk
  int64_t q_heads = 0;   // Hq ≥ 1
  int64_t kv_heads = 0;  // Hkv ≥ 1, divides Hq
  int64_t head_dim = 0;  // d ≥ 1
  int64_t v_dim = 0;     // dv ≥ 1

  int64_t group() const { return q_heads / kv_heads; }  // query heads per kv head
  int64_t kv_head_of(int64_t q_head) const { return q_head / group(); }
};

// Which keys query (b, h, i) sees and what is added to its logits. Causality and key
// padding cut each row to a prefix [0, key_end); the boolean and additive masks act
// element by element inside that prefix.
struct MaskRule {
  Causal causal = Causal::none;
  int64_t q_len = 0;
  int64_t k_len = 0;
  std::span<const int64_t> key_lengths;
  View4<const std::uint8_t> keep;  // broadcast axes have stride 0 after validation
  View4<const float> bias;

  int64_t valid_keys(int64_t b) const { return key_lengths.empty() ? k_len : key_lengths[b]; }

  // One past the last key that causality and padding leave to query row i.
  int64_t key_end(int64_t b, int64_t i) const {
    const int64_t valid = valid_keys(b);
    switch (causal) {
      case Causal::top_left:
        return std::min(valid, i + 1);
      case Causal::bottom_right:
        return std::clamp<int64_t>(i + 1 + (valid - q_len), 0, valid);
      case Causal::none:
        break;
    }
    return valid;
  }

  bool has_elementwise() const { return !keep.empty() || !bias.empty(); }
  bool keeps(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return keep.empty() || keep(b, h, i, j) != 0;
  }
  float bias_at(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return bias.empty() ? 0.0f : bias(b, h, i, j);
  }
};

template <class T>
struct ForwardProblem {
  Extents extents;
  double scale = 1.0;
  MaskRule mask;
  ForwardArgs<T> args;
  int threads = 1;  // resolved: ≥ 1
};

template <class T>
struct BackwardProblem {
  Extents extents;
  double scale = 1.0;
  MaskRule mask;
  BackwardArgs<T> args;
  int threads = 1;
};

}  // namespace qkv::detail
