// qkv::index_topk against its fp64 reference (and the formula written out here), on every
// compiled SIMD target, for every thread count and storage type.
//
// Comparison rule: the float32 scores may differ from the exact ones by at most
//   tol = (di + Hi + 8) · 2⁻²⁴ · max_j Σ_h |w_h| · scale · Σ_c |q_hc · k_jc|
// per row (each dot product is di float32 rounding steps, the head sum Hi more). So where
// exact scores differ by more than 2·tol the fast path must order them as the reference
// does; keys whose exact scores lie within 2·tol of each other may come in either order,
// and may trade places across the top-k boundary. Checked as: the same number of −1s; every
// listed key allowed and listed once; listed exact scores non-increasing up to 2·tol; and
// every unlisted allowed key scores at most the last listed one + 2·tol.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <set>
#include <vector>

#include "cpu/dot_products.hpp"
#include "forced_vdpbf16ps.hpp"
#include "simd_targets.hpp"
#include "test_support.hpp"
#include "qkv/index_topk.hpp"

namespace qkv::test {
namespace {

struct Case {
  int64_t batch = 2, q_len = 9, k_len = 300, heads = 5, head_dim = 19, topk = 17;
  Causal causal = Causal::none;
  std::vector<int64_t> key_lengths;
  uint64_t seed = 1;
};

// Seeded normal values rounded once to T (the 16-bit types through float).
template <class T, int R>
Tensor<T, R> random_stored(const std::array<int64_t, R>& shape, uint64_t seed) {
  const Tensor<float, R> wide = random_tensor<float, R>(shape, seed);
  Tensor<T, R> t(shape);
  for (std::size_t x = 0; x < t.size(); ++x) t[x] = static_cast<T>(wide[x]);
  return t;
}

template <class T>
struct Inputs {
  Tensor<T, 4> q;
  Tensor<T, 3> k;
  Tensor<IndexWeightOf<T>, 3> weights;
  explicit Inputs(const Case& c)
      : q(random_stored<T, 4>({c.batch, c.q_len, c.heads, c.head_dim}, c.seed)),
        k(random_stored<T, 3>({c.batch, c.k_len, c.head_dim}, c.seed + 1)),
        weights(random_stored<IndexWeightOf<T>, 3>({c.batch, c.q_len, c.heads}, c.seed + 2)) {}
  IndexTopkArgs<T> args(Tensor<int32_t, 3>& out) const {
    return {q.cview(), k.cview(), weights.cview(), out.view()};
  }
};

AttentionOptions options_of(const Case& c, Backend backend, int threads) {
  AttentionOptions o;
  o.causal = c.causal;
  o.key_lengths = c.key_lengths;
  o.execution.backend = backend;
  o.execution.threads = threads;
  return o;
}

template <class T>
Tensor<int32_t, 3> run(const Case& c, const Inputs<T>& in, Backend backend, int threads) {
  Tensor<int32_t, 3> out({c.batch, c.q_len, c.topk});
  fill(out, int32_t{-7});
  index_topk(in.args(out), options_of(c, backend, threads));
  return out;
}

int64_t allowed_keys(const Case& c, int64_t b, int64_t i) {
  const int64_t valid = c.key_lengths.empty() ? c.k_len : c.key_lengths[b];
  switch (c.causal) {
    case Causal::top_left: return std::min(valid, i + 1);
    case Causal::bottom_right: return std::clamp<int64_t>(i + 1 + valid - c.q_len, 0, valid);
    default: return valid;
  }
}

// The fast result against the exact scores, by the rule above.
template <class T>
void expect_valid_topk(const Case& c, const Inputs<T>& in, const Tensor<int32_t, 3>& got) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t i = 0; i < c.q_len; ++i) {
      const int64_t allowed = allowed_keys(c, b, i);
      std::vector<double> exact(static_cast<std::size_t>(allowed));
      double magnitude = 0.0;
      for (int64_t j = 0; j < allowed; ++j) {
        double score = 0.0, bound = 0.0;
        for (int64_t h = 0; h < c.heads; ++h) {
          double dot = 0.0, abs_dot = 0.0;
          for (int64_t x = 0; x < c.head_dim; ++x) {
            const double product = static_cast<double>(static_cast<float>(in.q(b, i, h, x))) *
                                   static_cast<float>(in.k(b, j, x));
            dot += product;
            abs_dot += std::abs(product);
          }
          const double w = in.weights(b, i, h);
          score += w * std::max(scale * dot, 0.0);
          bound += std::abs(w) * scale * abs_dot;
        }
        exact[static_cast<std::size_t>(j)] = score;
        magnitude = std::max(magnitude, bound);
      }
      const double tol = 2.0 * static_cast<double>(c.head_dim + c.heads + 8) * std::ldexp(1.0, -24) * magnitude;
      const int64_t listed = std::min(allowed, c.topk);
      SCOPED_TRACE(testing::Message() << "row b=" << b << " i=" << i << " allowed=" << allowed);
      std::set<int32_t> seen;
      for (int64_t t = 0; t < c.topk; ++t) {
        const int32_t j = got(b, i, t);
        if (t >= listed) {
          ASSERT_EQ(j, -1) << "position " << t;
          continue;
        }
        ASSERT_GE(j, 0) << "position " << t;
        ASSERT_LT(j, allowed) << "position " << t;
        ASSERT_TRUE(seen.insert(j).second) << "key " << j << " listed twice";
        if (t > 0) {
          EXPECT_LE(exact[j], exact[got(b, i, t - 1)] + tol) << "position " << t;
        }
      }
      if (listed == 0) continue;
      const double last = exact[got(b, i, listed - 1)];
      for (int64_t j = 0; j < allowed; ++j)
        if (!seen.count(static_cast<int32_t>(j))) {
          EXPECT_LE(exact[j], last + tol) << "key " << j << " left out";
        }
    }
}

template <class T>
void expect_matches_reference(const Case& c) {
  const Inputs<T> in(c);
  const Tensor<int32_t, 3> reference = run(c, in, Backend::reference, 1);
  expect_valid_topk(c, in, reference);
  for_each_simd_target([&](int64_t) {
    const Tensor<int32_t, 3> fast = run(c, in, Backend::cpu, 2);
    expect_valid_topk(c, in, fast);
  });
}

TEST(IndexTopk, MatchesReferenceEveryCausalMode) {
  for (Causal causal : {Causal::none, Causal::top_left, Causal::bottom_right}) {
    SCOPED_TRACE(static_cast<int>(causal));
    Case c;
    c.causal = causal;
    expect_matches_reference<float>(c);
  }
}

TEST(IndexTopk, OddShapesAndKeyLengths) {
  Case c{.batch = 3, .q_len = 13, .k_len = 261, .heads = 3, .head_dim = 1, .topk = 40, .causal = Causal::bottom_right,
         .key_lengths = {261, 0, 100}, .seed = 5};
  expect_matches_reference<float>(c);
  c.causal = Causal::top_left;
  c.head_dim = 37;
  c.heads = 17;
  expect_matches_reference<float>(c);
  c.causal = Causal::none;
  c.key_lengths = {5, 261, 130};
  expect_matches_reference<float>(c);
}

TEST(IndexTopk, HalfStorage) {
  Case c{.batch = 1, .q_len = 11, .k_len = 400, .heads = 8, .head_dim = 32, .topk = 64, .causal = Causal::bottom_right};
  expect_matches_reference<bfloat16>(c);
  expect_matches_reference<float16>(c);
}

// bfloat16 q and k with Precision::fast: on vdpbf16ps where the CPU has it (forced on
// here, on every SIMD target: the unit's kernels are the same, the score pass around them
// the target's), and on the float32 FMAs forced off and with Precision::exact. Pairs of
// exact products summed in float32 lanes: the comparison rule above holds as it is (di
// float32 roundings per dot product). Shapes: heads not a multiple of 16 (zero query
// columns past Hi), an odd di (a zero partner pads the last pair), key lengths, every
// causal mode, and a decode row whose keys are split across items.
std::vector<Case> bf16_dot_cases() {
  return {Case{.batch = 1, .q_len = 11, .k_len = 400, .heads = 64, .head_dim = 128, .topk = 64,
               .causal = Causal::bottom_right},
          Case{.batch = 3, .q_len = 13, .k_len = 261, .heads = 17, .head_dim = 37, .topk = 40,
               .causal = Causal::top_left, .key_lengths = {261, 0, 100}, .seed = 5},
          Case{.batch = 2, .q_len = 9, .k_len = 300, .heads = 5, .head_dim = 19, .topk = 17, .seed = 7},
          Case{.batch = 1, .q_len = 1, .k_len = 5000, .heads = 16, .head_dim = 64, .topk = 300,
               .causal = Causal::bottom_right, .seed = 11}};
}

TEST(IndexTopk, Bfloat16OnTheDotUnitAndOff) {
  const auto check_all = [](Precision precision) {
    for (const Case& c : bf16_dot_cases()) {
      SCOPED_TRACE(testing::Message() << "heads " << c.heads << " di " << c.head_dim << " Nq " << c.q_len);
      const Inputs<bfloat16> in(c);
      for_each_simd_target([&](int64_t) {
        Tensor<int32_t, 3> out({c.batch, c.q_len, c.topk});
        AttentionOptions o = options_of(c, Backend::cpu, 2);
        o.precision = precision;
        index_topk(in.args(out), o);
        expect_valid_topk(c, in, out);
      });
    }
  };
  if (cpu::cpu_has_bf16_dot()) {
    const ForcedVdpbf16ps forced;
    check_all(Precision::fast);
  }
  if (cpu::cpu_has_amx_bf16()) {
    const ForcedAmx forced;
    check_all(Precision::fast);
  }
  cpu::set_dot_products_for_test(false);
  check_all(Precision::fast);
  cpu::set_dot_products_for_test(std::nullopt);
  check_all(Precision::exact);
}

// Each unit's bits do not depend on the thread count (the AMX tiles' sums run in another
// order than vdpbf16ps's, so the two units' scores differ in their last bits).
void expect_same_bits_for_any_thread_count() {
  for (int64_t q_len : {1, 40}) {
    Case c{.batch = 2, .q_len = q_len, .k_len = 3000, .heads = 33, .head_dim = 24, .topk = 100,
           .causal = Causal::bottom_right, .seed = 13};
    const Inputs<bfloat16> in(c);
    const Tensor<int32_t, 3> one = run(c, in, Backend::cpu, 1);
    expect_valid_topk(c, in, one);
    for (int threads : {2, 3, 8}) {
      const Tensor<int32_t, 3> many = run(c, in, Backend::cpu, threads);
      for (std::size_t x = 0; x < one.size(); ++x) ASSERT_EQ(one[x], many[x]) << "threads " << threads;
    }
  }
}

TEST(IndexTopk, Bfloat16OnTheDotUnitSameBitsForAnyThreadCount) {
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const ForcedVdpbf16ps forced;
  expect_same_bits_for_any_thread_count();
}

TEST(IndexTopk, Bfloat16OnTheAmxTilesSameBitsForAnyThreadCount) {
  if (!cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 tiles on this CPU";
  const ForcedAmx forced;
  expect_same_bits_for_any_thread_count();
}

TEST(IndexTopk, TopkAtLeastAllowedKeysPadsWithMinusOne) {
  // topk > Nk: every row lists all its allowed keys, then −1 (top_left: row i has i + 1).
  Case c{.batch = 1, .q_len = 6, .k_len = 5, .heads = 2, .head_dim = 8, .topk = 9, .causal = Causal::top_left};
  expect_matches_reference<float>(c);
  const Inputs<float> in(c);
  const Tensor<int32_t, 3> out = run(c, in, Backend::cpu, 2);
  for (int64_t i = 0; i < c.q_len; ++i)
    for (int64_t t = 0; t < c.topk; ++t) EXPECT_EQ(out(0, i, t) == -1, t >= std::min<int64_t>(i + 1, 5));
}

TEST(IndexTopk, DecodeOneQueryManyKeys) {
  // Nq = 1 against 5000 keys: the keys are split across items and merged.
  Case c{.batch = 1, .q_len = 1, .k_len = 5000, .heads = 16, .head_dim = 64, .topk = 300, .causal = Causal::bottom_right};
  expect_matches_reference<float>(c);
  c.batch = 2;
  c.key_lengths = {4000, 4999};
  expect_matches_reference<float>(c);
}

TEST(IndexTopk, SameBitsForAnyThreadCount) {
  for (int64_t q_len : {1, 40}) {
    Case c{.batch = 2, .q_len = q_len, .k_len = 3000, .heads = 9, .head_dim = 24, .topk = 100,
           .causal = Causal::bottom_right, .seed = 9};
    const Inputs<float> in(c);
    const Tensor<int32_t, 3> one = run(c, in, Backend::cpu, 1);
    for (int threads : {2, 3, 8}) {
      const Tensor<int32_t, 3> many = run(c, in, Backend::cpu, threads);
      for (std::size_t x = 0; x < one.size(); ++x) ASSERT_EQ(one[x], many[x]) << "threads " << threads;
    }
  }
}

TEST(IndexTopk, TiesGoToTheLowerIndex) {
  // q = 0: every score is 0, so each row lists its first keys in order.
  Case c{.batch = 1, .q_len = 3, .k_len = 200, .heads = 4, .head_dim = 16, .topk = 10};
  Inputs<float> in(c);
  fill(in.q, 0.0f);
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    const Tensor<int32_t, 3> out = run(c, in, backend, 2);
    for (int64_t i = 0; i < c.q_len; ++i)
      for (int64_t t = 0; t < c.topk; ++t) EXPECT_EQ(out(0, i, t), t);
  }
}

TEST(IndexTopk, NanScoreRanksFirst) {
  Case c{.batch = 1, .q_len = 2, .k_len = 50, .heads = 2, .head_dim = 8, .topk = 5};
  Inputs<float> in(c);
  in.k(0, 31, 3) = std::numeric_limits<float>::quiet_NaN();
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    const Tensor<int32_t, 3> out = run(c, in, backend, 2);
    EXPECT_EQ(out(0, 0, 0), 31);
    EXPECT_EQ(out(0, 1, 0), 31);
  }
}

TEST(IndexTopk, MatchesTheFormulaWrittenOut) {
  // A tiny case by hand: one head, di = 1, weight 1, scale 1: score_j = relu(q·k_j).
  const float q[1] = {1.0f}, k[4] = {-1.0f, 3.0f, 2.0f, 3.0f}, w[1] = {1.0f};
  int32_t out[3] = {9, 9, 9};
  IndexTopkArgs<float> args;
  args.q = View4<const float>(q, {1, 1, 1, 1}, {1, 1, 1, 1});
  args.k = View3<const float>(k, {1, 4, 1}, {4, 1, 1});
  args.weights = View3<const float>(w, {1, 1, 1}, {1, 1, 1});
  args.indices = View3<int32_t>(out, {1, 1, 3}, {3, 3, 1});
  AttentionOptions o;
  o.scale = 1.0;
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    o.execution.backend = backend;
    index_topk(args, o);
    EXPECT_EQ(out[0], 1);  // 3 (the lower of the two 3s)
    EXPECT_EQ(out[1], 3);  // 3
    EXPECT_EQ(out[2], 2);  // 2; key 0 scores relu(−1) = 0
  }
}

TEST(IndexTopk, BadArgumentsThrowNamingThemAndWriteNothing) {
  Case c{.batch = 2, .q_len = 3, .k_len = 20, .heads = 2, .head_dim = 4, .topk = 4};
  const Inputs<float> in(c);
  Tensor<int32_t, 3> out({c.batch, c.q_len, c.topk});
  fill(out, int32_t{-7});
  auto expect_error = [&](IndexTopkArgs<float> args, const AttentionOptions& o, const std::string& words) {
    try {
      index_topk(args, o);
      ADD_FAILURE() << "no error; expected one naming " << words;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("qkv::index_topk: " + words), std::string::npos) << e.what();
    }
    for (std::size_t x = 0; x < out.size(); ++x) ASSERT_EQ(out[x], -7);
  };
  const AttentionOptions plain;
  Tensor<float, 3> short_k({2, 20, 3});
  IndexTopkArgs<float> args = in.args(out);
  args.k = short_k.cview();
  expect_error(args, plain, "k.shape[2] (head_dim)");
  Tensor<float, 3> wrong_weights({2, 3, 3});
  args = in.args(out);
  args.weights = wrong_weights.cview();
  expect_error(args, plain, "weights.shape[2] (heads)");
  Tensor<int32_t, 3> wrong_rows({2, 4, 4});
  args = in.args(out);
  args.indices = wrong_rows.view();
  expect_error(args, plain, "indices.shape[1] (seq)");
  args = in.args(out);
  AttentionOptions o;
  o.key_lengths = std::span<const int64_t>();
  const std::vector<int64_t> lengths{3, 21};
  o.key_lengths = lengths;
  expect_error(args, o, "options.key_lengths[1]");
  o = AttentionOptions{};
  o.scale = -1.0;
  expect_error(args, o, "options.scale");
  o = AttentionOptions{};
  o.window.left = 3;
  expect_error(args, o, "options.window");
  o = AttentionOptions{};
  o.softcap = 5.0f;
  expect_error(args, o, "options.softcap");
  o = AttentionOptions{};
  o.execution.threads = -1;
  expect_error(args, o, "options.execution.threads");
  // indices overlapping q's memory.
  args = in.args(out);
  args.indices = View3<int32_t>(reinterpret_cast<int32_t*>(const_cast<float*>(in.q.data())), {2, 3, 4}, {12, 4, 1});
  expect_error(args, plain, "indices: must not share memory with q");
}

}  // namespace
}  // namespace qkv::test
