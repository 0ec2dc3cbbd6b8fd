// Varlen (packed) attention: every sequence of a packed batch against a dense call on
// that sequence alone (reference, fp64), forward and backward, on both backends; the
// reference's varlen backward against finite differences; determinism; every error path.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "finite_difference.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

struct VarlenSpec {
  std::string name;
  std::vector<int64_t> q_lens, k_lens;
  int64_t q_heads = 2, kv_heads = 1, head_dim = 24, v_dim = 16;
  Causal causal = Causal::none;
  bool variants = false;  // window, ALiBi, soft-cap and sinks on top
};

// The variants' per-head arrays for 4 query heads (static: options point at them).
const std::vector<float> kSlopes{0.5f, 0.25f, 0.125f, 0.0625f}, kSinks{0.1f, -0.4f, 0.9f, 0.0f};

void add_variants(const VarlenSpec& spec, AttentionOptions& options) {
  if (!spec.variants) return;
  options.window = {20, 5};
  options.alibi_slopes = kSlopes;
  options.sinks = kSinks;
  options.softcap = 2.0f;
}

std::ostream& operator<<(std::ostream& out, const VarlenSpec& s) { return out << s.name; }

std::vector<int64_t> prefix_sums(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (int64_t n : lengths) cu.push_back(cu.back() + n);
  return cu;
}

// Packed inputs and outputs of one varlen call in T.
template <class T>
struct Packed {
  VarlenSpec spec;
  std::vector<int64_t> cu_q, cu_k;
  Tensor<T, 3> q, k, v, out, dout, dq, dk, dv;
  Tensor<T, 2> lse;

  Packed(const VarlenSpec& s, std::uint64_t seed)
      : spec(s), cu_q(prefix_sums(s.q_lens)), cu_k(prefix_sums(s.k_lens)),
        q(test::random_tensor<T, 3>({cu_q.back(), s.q_heads, s.head_dim}, seed)),
        k(test::random_tensor<T, 3>({cu_k.back(), s.kv_heads, s.head_dim}, seed + 1)),
        v(test::random_tensor<T, 3>({cu_k.back(), s.kv_heads, s.v_dim}, seed + 2)),
        out({cu_q.back(), s.q_heads, s.v_dim}),
        dout(test::random_tensor<T, 3>({cu_q.back(), s.q_heads, s.v_dim}, seed + 3)),
        dq(q.shape()), dk(k.shape()), dv(v.shape()), lse({s.q_heads, cu_q.back()}) {}

  VarlenForwardArgs<T> forward_args() {
    return {.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(), .lse = lse.view(),
            .cu_seqlens_q = std::span<const int64_t>(cu_q),
            .cu_seqlens_k = std::span<const int64_t>(cu_k)};
  }
  VarlenBackwardArgs<T> backward_args() {
    return {.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.cview(), .lse = lse.cview(),
            .dout = dout.cview(), .dq = dq.view(), .dk = dk.view(), .dv = dv.view(),
            .cu_seqlens_q = std::span<const int64_t>(cu_q),
            .cu_seqlens_k = std::span<const int64_t>(cu_k)};
  }
  void run(Backend backend, int threads = 2) {
    AttentionOptions options;
    options.causal = spec.causal;
    options.execution.backend = backend;
    options.execution.threads = threads;
    add_variants(spec, options);
    varlen_attention_forward(forward_args(), options);
    varlen_attention_backward(backward_args(), options);
  }
};

// Rows [begin, begin + n) of a packed [total, H, D] tensor as a dense [1, n, H, D] view.
template <class T>
View4<T> sequence_view(Tensor<T, 3>& t, int64_t begin, int64_t n) {
  const auto& s = t.shape();
  return View4<T>(t.data() + begin * s[1] * s[2], {1, n, s[1], s[2]},
                  {n * s[1] * s[2], s[1] * s[2], s[2], 1});
}

// Each sequence as its own dense fp64 reference call; the packed results must match.
void expect_matches_dense_per_sequence(const VarlenSpec& spec, Backend backend, double tolerance) {
  Packed<float> packed(spec, 21);
  packed.run(backend);
  Packed<double> wide(spec, 21);  // same seeds: the same values, exactly widened
  for (std::size_t i = 0; i < packed.q.size(); ++i) wide.q[i] = packed.q[i];
  for (std::size_t i = 0; i < packed.k.size(); ++i) wide.k[i] = packed.k[i];
  for (std::size_t i = 0; i < packed.v.size(); ++i) wide.v[i] = packed.v[i];
  for (std::size_t i = 0; i < packed.dout.size(); ++i) wide.dout[i] = packed.dout[i];
  AttentionOptions options = test::reference_options();
  options.causal = spec.causal;
  add_variants(spec, options);
  for (std::size_t s = 0; s + 1 < packed.cu_q.size(); ++s) {
    const int64_t q0 = packed.cu_q[s], nq = packed.cu_q[s + 1] - q0;
    const int64_t k0 = packed.cu_k[s], nk = packed.cu_k[s + 1] - k0;
    Tensor<double, 3> lse({1, spec.q_heads, nq});
    attention_forward({.q = sequence_view(wide.q, q0, nq), .k = sequence_view(wide.k, k0, nk),
                       .v = sequence_view(wide.v, k0, nk), .out = sequence_view(wide.out, q0, nq),
                       .lse = lse.view()},
                      options);
    attention_backward({.q = sequence_view(wide.q, q0, nq), .k = sequence_view(wide.k, k0, nk),
                        .v = sequence_view(wide.v, k0, nk), .out = sequence_view(wide.out, q0, nq),
                        .lse = lse.cview(), .dout = sequence_view(wide.dout, q0, nq),
                        .dq = sequence_view(wide.dq, q0, nq), .dk = sequence_view(wide.dk, k0, nk),
                        .dv = sequence_view(wide.dv, k0, nk)},
                       options);
    for (int64_t h = 0; h < spec.q_heads; ++h)
      for (int64_t i = 0; i < nq; ++i) {
        const double expected = lse(0, h, i), got = packed.lse(h, q0 + i);
        if (std::isinf(expected)) EXPECT_EQ(got, expected) << "sequence " << s;
        else EXPECT_NEAR(got, expected, tolerance) << "lse, sequence " << s << " row " << i;
      }
  }
  EXPECT_LE(test::max_abs_diff(packed.out, wide.out), tolerance);
  EXPECT_LE(test::max_abs_diff(packed.dq, wide.dq), tolerance);
  EXPECT_LE(test::max_abs_diff(packed.dk, wide.dk), tolerance);
  EXPECT_LE(test::max_abs_diff(packed.dv, wide.dv), tolerance);
}

std::vector<VarlenSpec> varlen_specs() {
  return {
      {"edges", {0, 1, 63, 64, 65, 130}, {0, 1, 63, 64, 65, 130}},
      {"causal_top_left", {5, 64, 65, 1, 0}, {70, 64, 65, 3, 2}, 4, 2, 32, 32, Causal::top_left},
      {"causal_bottom_right", {1, 65, 20, 7}, {64, 130, 20, 0}, 4, 4, 16, 24, Causal::bottom_right},
      {"gqa_8_to_1", {33, 100}, {47, 190}, 8, 1, 64, 64},
      {"odd_dims_queries_only", {0, 0, 9}, {0, 5, 9}, 3, 1, 59, 13},
      {"window_alibi_softcap_sinks", {1, 65, 40, 0}, {64, 130, 40, 3}, 4, 2, 16, 16,
       Causal::bottom_right, true},
  };
}

class Varlen : public ::testing::TestWithParam<VarlenSpec> {};

// fp32 cpu results against the fp64 dense reference: O(1) values summed over ≤ 190 keys
// in fp32 with blockwise sums: a few ε₃₂·√N, far below 2e-5; a wrong row or sequence
// boundary is O(1) off.
TEST_P(Varlen, CpuMatchesDenseReferencePerSequence) {
  expect_matches_dense_per_sequence(GetParam(), Backend::cpu, 2e-5);
}

// The reference's varlen path sums in fp64 like the dense one; only the final rounding
// to float differs (≤ ε₃₂ relative).
TEST_P(Varlen, ReferenceMatchesDenseReferencePerSequence) {
  expect_matches_dense_per_sequence(GetParam(), Backend::reference, 2e-6);
}

TEST_P(Varlen, BitwiseIdenticalForAnyThreadCount) {
  Packed<float> first(GetParam(), 5);
  first.run(Backend::cpu, 1);
  for (int threads : {2, 3, 8}) {
    Packed<float> again(GetParam(), 5);
    again.run(Backend::cpu, threads);
    auto same = [](const auto& a, const auto& b) {
      return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    };
    EXPECT_TRUE(same(first.out, again.out) && same(first.lse, again.lse) && same(first.dq, again.dq) &&
                same(first.dk, again.dk) && same(first.dv, again.dv))
        << threads << " threads";
  }
}

INSTANTIATE_TEST_SUITE_P(Specs, Varlen, ::testing::ValuesIn(varlen_specs()),
                         [](const auto& param_info) { return param_info.param.name; });

// The varlen backward of the reference against central finite differences of its own
// forward in fp64: L = Σ out ⊙ dout, dL/dx ≈ (L(x + h) − L(x − h)) / 2h.
TEST(VarlenGradients, ReferenceBackwardMatchesFiniteDifferences) {
  const VarlenSpec spec{"fd", {3, 0, 4}, {2, 1, 5}, 2, 1, 3, 2, Causal::bottom_right};
  Packed<double> p(spec, 31);
  AttentionOptions options = test::reference_options();
  options.causal = spec.causal;
  varlen_attention_forward(p.forward_args(), options);
  varlen_attention_backward(p.backward_args(), options);
  auto loss = [&]() {
    Packed<double> probe = p;
    varlen_attention_forward(probe.forward_args(), options);
    double sum = 0.0;
    for (std::size_t i = 0; i < probe.out.size(); ++i) sum += probe.out[i] * p.dout[i];
    return sum;
  };
  test::expect_gradient_matches(p.q, p.dq, 1e-6, 1e-7, loss, "dq");
  test::expect_gradient_matches(p.k, p.dk, 1e-6, 1e-7, loss, "dk");
  test::expect_gradient_matches(p.v, p.dv, 1e-6, 1e-7, loss, "dv");
}

// ---- errors: named, and nothing written -------------------------------------------

void expect_error(const std::function<void(Packed<float>&)>& spoil, const std::string& message) {
  Packed<float> p({"err", {3, 4}, {5, 2}}, 1);
  spoil(p);
  test::fill(p.out, 7.0f);
  try {
    varlen_attention_forward(p.forward_args());
    ADD_FAILURE() << "no error; expected one mentioning " << message;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
  for (std::size_t i = 0; i < p.out.size(); ++i) ASSERT_EQ(p.out[i], 7.0f) << "out was written";
}

TEST(VarlenErrors, CuSeqlensAreChecked) {
  expect_error([](Packed<float>& p) { p.cu_q[0] = 1; }, "cu_seqlens_q[0]: expected 0");
  expect_error([](Packed<float>& p) { p.cu_q[1] = 8; }, "cu_seqlens_q[1]: expected <= 7");
  expect_error([](Packed<float>& p) { p.cu_k = {0, 6, 5, 7}; }, "cu_seqlens_k[2]: expected >= cu_seqlens_k[1] = 6");
  expect_error([](Packed<float>& p) { p.cu_k = {0, 7}; }, "cu_seqlens_k: expected 3 entries");
  expect_error([](Packed<float>& p) { p.cu_q.back() = 6; }, "cu_seqlens_q[2]: expected 7");
  expect_error([](Packed<float>& p) { p.cu_q.clear(); }, "cu_seqlens_q: expected the prefix sums");
}

TEST(VarlenErrors, OptionsAndShapesAreChecked) {
  Packed<float> p({"err", {3, 4}, {5, 2}}, 1);
  Tensor<std::uint8_t, 4> keep({1, 1, 1, 7});
  AttentionOptions masked;
  masked.mask.keep = keep.cview();
  EXPECT_THROW(varlen_attention_forward(p.forward_args(), masked), Error);
  const std::vector<int64_t> lengths{1, 1};
  AttentionOptions padded;
  padded.key_lengths = lengths;
  EXPECT_THROW(varlen_attention_forward(p.forward_args(), padded), Error);
  auto args = p.forward_args();
  args.max_seqlen_q = 3;  // the longest query sequence has 4
  try {
    varlen_attention_forward(args);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_seqlen_q"), std::string::npos) << e.what();
  }
  Tensor<float, 2> bad_lse({7, 2});  // [total, H] instead of [H, total]
  args = p.forward_args();
  args.lse = bad_lse.view();
  EXPECT_THROW(varlen_attention_forward(args), Error);
  Tensor<float, 3> wrong_v({6, 1, 16});  // one row short of k's 7
  args = p.forward_args();
  args.v = wrong_v.cview();
  EXPECT_THROW(varlen_attention_forward(args), Error);
}

TEST(VarlenErrors, Int32OffsetsWorkLikeInt64) {
  Packed<float> a({"i32", {3, 4}, {5, 2}}, 1), b({"i32", {3, 4}, {5, 2}}, 1);
  varlen_attention_forward(a.forward_args());
  const std::vector<int32_t> cu_q{0, 3, 7}, cu_k{0, 5, 7};
  auto args = b.forward_args();
  args.cu_seqlens_q = std::span<const int32_t>(cu_q);
  args.cu_seqlens_k = std::span<const int32_t>(cu_k);
  varlen_attention_forward(args);
  EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace qkv
