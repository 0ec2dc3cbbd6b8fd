// A catalogue of small attention problems covering every option, with the storage for
// their inputs, used by the forward and backward tests of every backend.
#pragma once

#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace qkv::test {

struct CaseSpec {
  std::string name;
  int64_t batch = 1, q_len = 3, k_len = 3, q_heads = 1, kv_heads = 1, head_dim = 4, v_dim = 4;
  Causal causal = Causal::none;
  bool keep_mask = false;       // random boolean mask, broadcast over heads
  bool bias_mask = false;       // random additive mask with some -inf, broadcast over batch
  bool key_padding = false;     // key_lengths = Nk, Nk-1, …
  std::optional<double> scale;  // unset: 1/√d
};

inline std::ostream& operator<<(std::ostream& out, const CaseSpec& spec) {
  return out << spec.name;
}

// Inputs of one case in T, plus the options that point into its mask storage.
template <class T>
struct Case {
  CaseSpec spec;
  Tensor<T, 4> q, k, v;
  Tensor<std::uint8_t, 4> keep;
  Tensor<float, 4> bias;
  std::vector<int64_t> key_lengths;
  AttentionOptions options;

  explicit Case(const CaseSpec& s, std::uint64_t seed = 42)
      : spec(s),
        q(random_tensor<T, 4>({s.batch, s.q_len, s.q_heads, s.head_dim}, seed)),
        k(random_tensor<T, 4>({s.batch, s.k_len, s.kv_heads, s.head_dim}, seed + 1)),
        v(random_tensor<T, 4>({s.batch, s.k_len, s.kv_heads, s.v_dim}, seed + 2)) {
    std::mt19937_64 rng(seed + 3);
    options.causal = s.causal;
    options.scale = s.scale;
    if (s.keep_mask) {
      keep = Tensor<std::uint8_t, 4>({s.batch, 1, s.q_len, s.k_len});
      std::bernoulli_distribution coin(0.7);
      for (std::size_t i = 0; i < keep.size(); ++i) keep[i] = coin(rng) ? 1 : 0;
      options.mask.keep = keep.cview();
    }
    if (s.bias_mask) {
      bias = Tensor<float, 4>({1, s.q_heads, s.q_len, s.k_len});
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::bernoulli_distribution removed(0.2);
      for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = removed(rng) ? -INFINITY : normal(rng);
      options.mask.bias = bias.cview();
    }
    if (s.key_padding) {
      for (int64_t b = 0; b < s.batch; ++b) key_lengths.push_back(std::max<int64_t>(0, s.k_len - b));
      options.key_lengths = key_lengths;
    }
  }
};

// Small shapes for exhaustive checks (finite differences run 2 forwards per element).
inline std::vector<CaseSpec> small_cases() {
  std::vector<CaseSpec> cases;
  auto add = [&](CaseSpec spec) { cases.push_back(std::move(spec)); };
  add({.name = "plain"});
  add({.name = "single_token", .q_len = 1, .k_len = 1});
  add({.name = "more_keys_than_queries", .q_len = 2, .k_len = 5});
  add({.name = "more_queries_than_keys", .q_len = 5, .k_len = 2});
  add({.name = "causal_top_left", .q_len = 4, .k_len = 4, .causal = Causal::top_left});
  add({.name = "causal_top_left_nq_lt_nk", .q_len = 2, .k_len = 5, .causal = Causal::top_left});
  add({.name = "causal_bottom_right", .q_len = 2, .k_len = 5, .causal = Causal::bottom_right});
  add({.name = "causal_bottom_right_nq_gt_nk", .q_len = 5, .k_len = 3,
       .causal = Causal::bottom_right});
  add({.name = "boolean_mask", .batch = 2, .q_len = 3, .k_len = 4, .q_heads = 2, .kv_heads = 2,
       .keep_mask = true});
  add({.name = "additive_mask", .batch = 2, .q_len = 3, .k_len = 4, .q_heads = 2, .kv_heads = 2,
       .bias_mask = true});
  add({.name = "key_padding", .batch = 3, .q_len = 3, .k_len = 3, .key_padding = true});
  add({.name = "padding_bottom_right", .batch = 3, .q_len = 2, .k_len = 3,
       .causal = Causal::bottom_right, .key_padding = true});
  add({.name = "gqa", .batch = 2, .q_len = 3, .k_len = 4, .q_heads = 4, .kv_heads = 2});
  add({.name = "mqa", .q_len = 3, .k_len = 3, .q_heads = 3, .kv_heads = 1});
  add({.name = "v_dim_differs", .q_len = 3, .k_len = 4, .head_dim = 3, .v_dim = 5});
  add({.name = "head_dim_one", .head_dim = 1, .v_dim = 1});
  add({.name = "custom_scale", .scale = 0.3});
  add({.name = "everything", .batch = 2, .q_len = 3, .k_len = 4, .q_heads = 4, .kv_heads = 2,
       .head_dim = 3, .v_dim = 2, .causal = Causal::bottom_right, .keep_mask = true,
       .bias_mask = true, .key_padding = true, .scale = 0.7});
  return cases;
}

}  // namespace qkv::test
