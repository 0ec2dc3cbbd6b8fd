// Sparse attention test cases: random inputs and random key lists with every kind of
// entry the contract names (−1 padding, repeats, keys beyond the causal limit, rows that
// list nothing, rows whose listed keys are all masked), and runners for the sparse call
// and its oracle-of-the-oracle: dense attention with the boolean mask scattered from the lists.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "test_support.hpp"

namespace qkv::test {

struct SparseSpec {
  std::string name;
  int64_t batch = 1, q_len = 5, k_len = 9, q_heads = 2, kv_heads = 1, head_dim = 8, v_dim = 8, topk = 6;
  bool shared = true;  // [B, Nq, topk]; else [B, Hkv, Nq, topk]
  Causal causal = Causal::none;
  bool sinks = false;
  float softcap = 0.0f;
};

inline std::ostream& operator<<(std::ostream& out, const SparseSpec& s) { return out << s.name; }

// Lists: each entry −1 with probability 1/5, else a uniform key (so repeats and keys past
// the causal limit occur); row 1 of every list lists nothing (all −1), and the last row
// of list 0 names only key Nk − 1, repeated topk times: under top_left causality with
// Nq < Nk that key lies past the row's limit (a row whose listed keys are all masked).
inline Tensor<int64_t, 4> random_lists(const SparseSpec& s, std::uint64_t seed) {
  const int64_t lists = s.shared ? 1 : s.kv_heads;
  Tensor<int64_t, 4> lists_tensor({s.batch, lists, s.q_len, s.topk});
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> key(0, s.k_len - 1);
  std::uniform_int_distribution<int> coin(0, 4);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t l = 0; l < lists; ++l)
      for (int64_t i = 0; i < s.q_len; ++i)
        for (int64_t t = 0; t < s.topk; ++t) {
          int64_t j = coin(rng) == 0 || s.k_len == 0 ? -1 : key(rng);
          if (i == 1) j = -1;
          if (l == 0 && i == s.q_len - 1 && i > 1 && s.k_len > 0) j = s.k_len - 1;
          lists_tensor(b, l, i, t) = j;
        }
  return lists_tensor;
}

template <class T>
struct SparseInputs {
  Tensor<T, 4> q, k, v, dout;
  Tensor<int64_t, 4> lists;
  std::vector<float> sinks;
};

// The same inputs in another storage type (exact for float → double).
template <class To, class From>
SparseInputs<To> convert(const SparseInputs<From>& in) {
  auto cast = [](const Tensor<From, 4>& t) {
    Tensor<To, 4> out(t.shape());
    for (std::size_t i = 0; i < t.size(); ++i) out[i] = static_cast<To>(static_cast<float>(t[i]));
    return out;
  };
  return {cast(in.q), cast(in.k), cast(in.v), cast(in.dout), in.lists, in.sinks};
}

template <class T>
SparseInputs<T> sparse_inputs(const SparseSpec& s, std::uint64_t seed) {
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
    return convert<T>(sparse_inputs<float>(s, seed));  // 16-bit: the float inputs rounded
  } else {
    SparseInputs<T> in{random_tensor<T, 4>({s.batch, s.q_len, s.q_heads, s.head_dim}, seed),
                       random_tensor<T, 4>({s.batch, s.k_len, s.kv_heads, s.head_dim}, seed + 1),
                       random_tensor<T, 4>({s.batch, s.k_len, s.kv_heads, s.v_dim}, seed + 2),
                       random_tensor<T, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}, seed + 3),
                       random_lists(s, seed + 4), {}};
    if (s.sinks)
      for (int64_t h = 0; h < s.q_heads; ++h) in.sinks.push_back(0.5f * static_cast<float>(h) - 0.3f);
    return in;
  }
}

inline KeyIndices indices_of(const SparseSpec& s, const Tensor<int64_t, 4>& lists) {
  if (!s.shared) return TensorView<const int64_t, 4>(lists.view());
  const auto v = lists.view();
  return TensorView<const int64_t, 3>(v.data, {v.shape[0], v.shape[2], v.shape[3]},
                                      {v.strides[0], v.strides[2], v.strides[3]});
}

inline AttentionOptions sparse_options(const SparseSpec& s, const std::vector<float>& sinks, Backend backend,
                                       int threads = 2, Precision precision = Precision::fast) {
  AttentionOptions options;
  options.precision = precision;
  options.causal = s.causal;
  options.softcap = s.softcap;
  options.sinks = sinks;
  options.execution.backend = backend;
  options.execution.threads = threads;
  return options;
}

template <class T>
struct SparseResults {
  Tensor<T, 4> out, dq, dk, dv;
  Tensor<LseOf<T>, 3> lse;
  std::vector<float> dsinks;
};

template <class T>
SparseResults<T> sparse_results(const SparseSpec& s) {
  return {Tensor<T, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}),
          Tensor<T, 4>({s.batch, s.q_len, s.q_heads, s.head_dim}),
          Tensor<T, 4>({s.batch, s.k_len, s.kv_heads, s.head_dim}),
          Tensor<T, 4>({s.batch, s.k_len, s.kv_heads, s.v_dim}),
          Tensor<LseOf<T>, 3>({s.batch, s.q_heads, s.q_len}),
          std::vector<float>(s.sinks ? static_cast<std::size_t>(s.q_heads) : 0, 0.0f)};
}

// Forward, then (with_backward) the backward with dout, through sparse attention.
template <class T>
SparseResults<T> run_sparse(const SparseSpec& s, const SparseInputs<T>& in, Backend backend, int threads,
                            bool with_backward, Precision precision = Precision::fast) {
  SparseResults<T> r = sparse_results<T>(s);
  const AttentionOptions options = sparse_options(s, in.sinks, backend, threads, precision);
  const KeyIndices indices = indices_of(s, in.lists);
  sparse_attention_forward(SparseForwardArgs<T>{.q = in.q.cview(), .k = in.k.cview(), .v = in.v.cview(),
                                                .indices = indices, .out = r.out.view(), .lse = r.lse.view()},
                           options);
  if (with_backward) {
    sparse_attention_backward(
        SparseBackwardArgs<T>{.q = in.q.cview(), .k = in.k.cview(), .v = in.v.cview(), .indices = indices,
                              .out = r.out.cview(), .lse = r.lse.cview(), .dout = in.dout.cview(),
                              .dq = r.dq.view(), .dk = r.dk.view(), .dv = r.dv.view(), .dsinks = r.dsinks},
        options);
  }
  return r;
}

// The boolean mask [B, Hq, Nq, Nk] that the lists mean (causality left to the options).
inline Tensor<std::uint8_t, 4> scattered_mask(const SparseSpec& s, const Tensor<int64_t, 4>& lists) {
  Tensor<std::uint8_t, 4> keep({s.batch, s.q_heads, s.q_len, s.k_len});
  const int64_t group = s.q_heads / s.kv_heads;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t i = 0; i < s.q_len; ++i)
        for (int64_t t = 0; t < s.topk; ++t) {
          const int64_t j = lists(b, s.shared ? 0 : h / group, i, t);
          if (j >= 0) keep(b, h, i, j) = 1;
        }
  return keep;
}

// The same call as dense attention (reference backend, double) with the scattered mask.
inline SparseResults<double> run_dense_masked(const SparseSpec& s, const SparseInputs<double>& in) {
  SparseResults<double> r = sparse_results<double>(s);
  const Tensor<std::uint8_t, 4> keep = scattered_mask(s, in.lists);
  AttentionOptions options = sparse_options(s, in.sinks, Backend::reference);
  options.mask.keep = keep.cview();
  attention_forward(ForwardArgs<double>{.q = in.q.cview(), .k = in.k.cview(), .v = in.v.cview(),
                                        .out = r.out.view(), .lse = r.lse.view()},
                    options);
  attention_backward(BackwardArgs<double>{.q = in.q.cview(), .k = in.k.cview(), .v = in.v.cview(),
                                          .out = r.out.cview(), .lse = r.lse.cview(), .dout = in.dout.cview(),
                                          .dq = r.dq.view(), .dk = r.dk.view(), .dv = r.dv.view(),
                                          .dsinks = r.dsinks},
                     options);
  return r;
}

template <class T>
double as_double(T x) {
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else {
    return static_cast<double>(static_cast<float>(x));
  }
}

// max |a − b| over two tensors that may differ in type; equal infinities (lse −inf of an
// empty row) count as 0, any NaN as +inf.
template <class A, class B, int R>
double max_error(const Tensor<A, R>& a, const Tensor<B, R>& b) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = as_double(a[i]), y = as_double(b[i]);
    if (std::isnan(x) || std::isnan(y)) return INFINITY;
    if (x == y) continue;
    worst = std::max(worst, std::abs(x - y));
  }
  return worst;
}

}  // namespace qkv::test
