// The bfloat16 forward's row kernel on the AMX tiles (cpu/amx_rows.hpp, forward_rows-inl.h):
// amx::AttendSpan called directly against a float64 oracle of the same step, and whole
// calls that take it (the task count proves they did) against the fp64 reference under
// the Precision::fast contract (half_check.hpp) and against the exact path for the
// variants it takes (windows, sinks). Calls it does not take (score modifiers, elementwise
// masks) and tasks it hands back (a non-finite value behind a partial tile's mask) go to
// the block kernel, which the same checks then cover. Skipped where the CPU has no AMX.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "cpu/amx_rows.hpp"
#include "cpu/bf16_dot.hpp"
#include "cpu/dot_products.hpp"
#include "half_check.hpp"
#include "simd_targets.hpp"

namespace qkv {
namespace {

#define QKV_REQUIRE_AMX() \
  if (!cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 tiles on this CPU (or the OS does not grant them)"

using test::CaseSpec;
namespace amx = cpu::amx;
namespace bf16dot = cpu::bf16dot;
using RowForward = test::ForcedSwitch<cpu::set_amx_row_forward_for_test>;

double round_bf16(double x) { return static_cast<double>(static_cast<float>(bfloat16(static_cast<float>(x)))); }

// One span against float64: rows with their own key ranges (empty, partial, whole), a
// running state from an earlier span (m, l, acc) that the step must rescale, masked keys
// whose scores are far below the maximum (their weights underflow to exactly 0), and every
// row count and span length class (partial row and key tiles). Bounds: every exponential's
// argument carries float32 roundings (scale·s and the maxima: 2⁻²²·(|m| + |m'| + max|logit|)
// relative, "argument" below); l sums P in float32 (≤ keys·2⁻²³·l relative, with the
// exponential's ~1 ulp); acc takes bf16(P) (nearest even: ≤ 2⁻⁹·P) and float32 sums over the
// tiles' order: ≤ (2⁻⁹ + keys·2⁻²³)·Σ_j P_j·|v_j| + the earlier acc's rescale, 2⁻²²·|acc·alpha|.
TEST(AmxRows, SpanStepAgainstFloat64) {
  QKV_REQUIRE_AMX();
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t d_values[] = {1, 33, 64, 128};
  const std::size_t row_counts[] = {1, 16, 17, 40, 64};
  const std::size_t key_counts[] = {1, 31, 64, 100, 512};
  for (const std::size_t d : d_values)
    for (const std::size_t count : row_counts)
      for (const std::size_t keys : key_counts) {
        SCOPED_TRACE(testing::Message() << "d " << d << ", rows " << count << ", keys " << keys);
        const std::size_t dv = d == 1 ? 3 : d + 8, blocks = (keys + 63) / 64;
        std::vector<bfloat16> q(count * d), k(keys * d), v(keys * dv);
        for (auto& x : q) x = bfloat16(normal(gen));
        for (auto& x : k) x = bfloat16(normal(gen));
        for (auto& x : v) x = bfloat16(normal(gen));
        std::vector<std::uint16_t> q_rows(amx::kMaxQueries * amx::query_ld(d));
        amx::PackQueryRows(q.data(), static_cast<std::int64_t>(d), count, d, q_rows.data());
        std::vector<std::uint32_t> k_blocks(blocks * amx::key_block_words(d));
        for (std::size_t b = 0; b < blocks; ++b)
          amx::PackKeyPairs(k.data() + b * 64 * d, static_cast<std::int64_t>(d),
                            std::min<std::size_t>(64, keys - b * 64), d, k_blocks.data() + b * amx::key_block_words(d));
        const std::size_t v_ld = bf16dot::pair_ld(dv), pair_rows = (keys + 31) / 32 * 16;
        std::vector<std::uint32_t> v_pairs(pair_rows * v_ld, 0u);
        bf16dot::PackRowPairs(v.data(), static_cast<std::int64_t>(dv), keys, dv, v_pairs.data(), v_ld);
        std::vector<std::int32_t> lo(count), hi(count);
        std::vector<float> m(count), l(count), alpha(count);
        const std::size_t acc_ld = (dv + 15) / 16 * 16;
        std::vector<float> acc((count + 15) / 16 * 16 * acc_ld, 0.0f);
        std::uniform_int_distribution<int> pick(0, static_cast<int>(keys));
        for (std::size_t i = 0; i < count; ++i) {
          const int a = pick(gen), b = pick(gen);
          lo[i] = std::min(a, b), hi[i] = i % 5 == 0 ? static_cast<int>(keys) : std::max(a, b);
          if (i % 7 == 3) lo[i] = hi[i];  // no key in this span
          // Half the rows come with an earlier span's state; some of them with a maximum so
          // large that every weight here underflows to 0.
          const bool earlier = i % 2 == 1;
          m[i] = earlier ? (i % 4 == 1 ? 0.5f : 300.0f) : -std::numeric_limits<float>::infinity();
          l[i] = earlier ? 2.0f : 0.0f;
          for (std::size_t c = 0; c < dv; ++c) acc[i * acc_ld + c] = earlier ? normal(gen) : 0.0f;
        }
        const float scale = 1.0f / std::sqrt(static_cast<float>(d));
        const std::vector<float> m0 = m, l0 = l, acc0 = acc;
        std::vector<float> s(amx::kMaxQueries * (amx::kSpanKeys + 16));
        std::vector<std::uint16_t> p(amx::kMaxQueries * amx::kSpanKeys);
        const amx::Span span{.q = q_rows.data(), .count = count, .d = d, .k_blocks = k_blocks.data(), .keys = keys,
                             .v_pairs = v_pairs.data(), .v_ld = v_ld, .dv = dv, .lo = lo.data(), .hi = hi.data(),
                             .scale = scale};
        amx::AttendSpan(span, {s.data(), amx::kSpanKeys + 16, p.data(), amx::kSpanKeys},
                        {m.data(), l.data(), alpha.data(), acc.data(), acc_ld});
        for (std::size_t i = 0; i < count; ++i) {
          std::vector<double> logit;
          double row_max = -std::numeric_limits<double>::infinity();
          for (std::size_t j = static_cast<std::size_t>(lo[i]); j < static_cast<std::size_t>(hi[i]); ++j) {
            double dot = 0.0;
            for (std::size_t c = 0; c < d; ++c) dot += double{float(q[i * d + c])} * double{float(k[j * d + c])};
            logit.push_back(double{scale} * dot);
            row_max = std::max(row_max, logit.back());
          }
          const double m_new = std::max(double{m0[i]}, row_max);
          if (m_new == -std::numeric_limits<double>::infinity()) {
            EXPECT_EQ(m[i], -std::numeric_limits<float>::infinity()) << "row " << i;
            EXPECT_EQ(l[i], 0.0f) << "row " << i;
            EXPECT_EQ(alpha[i], 1.0f) << "row " << i;
            continue;
          }
          ASSERT_NEAR(m[i], m_new, 1e-6 * std::max(1.0, std::abs(m_new))) << "row " << i;
          // The exponentials' arguments carry float32 roundings of the scaled scores and of
          // the maxima: relative ≤ 2⁻²²·(|m| + |m'| + max|logit|) in every weight and in alpha.
          double max_logit = 0.0;
          for (const double x : logit) max_logit = std::max(max_logit, std::abs(x));
          const double m_old = std::isfinite(m0[i]) ? std::abs(double{m0[i]}) : 0.0;
          const double argument = 0x1p-22 * (m_old + std::abs(m_new) + max_logit);
          const double a = std::exp(double{m0[i]} - m_new);
          EXPECT_NEAR(alpha[i], a, (2e-7 + argument) * a + 1e-30) << "row " << i;
          double sum = 0.0;
          std::vector<double> weighted(dv, 0.0), magnitude(dv, 0.0);
          for (std::size_t t = 0; t < logit.size(); ++t) {
            const double w = std::exp(logit[t] - m_new);
            sum += w;
            const std::size_t j = static_cast<std::size_t>(lo[i]) + t;
            for (std::size_t c = 0; c < dv; ++c) {
              const double value = double{float(v[j * dv + c])};
              weighted[c] += round_bf16(w) * value;
              magnitude[c] += w * std::abs(value);
            }
          }
          const double l_ref = double{l0[i]} * a + sum;
          EXPECT_NEAR(l[i], l_ref, (2.0 * static_cast<double>(keys) * 0x1p-23 + 1e-6 + argument) * l_ref + 1e-37)
              << "row " << i;
          for (std::size_t c = 0; c < dv; ++c) {
            const double earlier = double{acc0[i * acc_ld + c]} * a;
            const double ref = earlier + weighted[c];
            const double bound = (0x1p-9 + static_cast<double>(keys) * 0x1p-23 + argument) * magnitude[c] +
                                 (0x1p-22 + argument) * std::abs(earlier) + 1e-30;
            ASSERT_NEAR(acc[i * acc_ld + c], ref, bound) << "row " << i << ", column " << c;
          }
          for (std::size_t c = dv; c < acc_ld; ++c) EXPECT_EQ(acc[i * acc_ld + c], acc0[i * acc_ld + c]);
        }
      }
}

// Whole calls on the row kernel, each shape class it takes: odd and large head dims, dv ≠ d,
// GQA, causal both ways, key lengths, spans of 8 key blocks and a partial last block,
// a group of 8 heads over one kv head; forward and backward within the fast contract.
TEST(AmxRows, CallsWithinTheFastContract) {
  QKV_REQUIRE_AMX();
  const test::ForcedBf16Unit tiles(cpu::Bf16Unit::amx);
  const RowForward rows(true);
  const CaseSpec cases[] = {
      {.name = "d1", .q_len = 65, .k_len = 65, .head_dim = 1, .v_dim = 1},
      {.name = "d33_gqa_bottom_right_padding", .batch = 2, .q_len = 70, .k_len = 600, .q_heads = 4, .kv_heads = 2,
       .head_dim = 33, .v_dim = 17, .causal = Causal::bottom_right, .key_padding = true},
      {.name = "d128_causal_1100", .q_len = 130, .k_len = 1100, .head_dim = 128, .v_dim = 128,
       .causal = Causal::top_left},
      {.name = "d256_dv64_gqa8", .q_len = 40, .k_len = 300, .q_heads = 8, .kv_heads = 1, .head_dim = 256,
       .v_dim = 64, .causal = Causal::bottom_right},
      {.name = "d96_dv128_scale", .q_len = 200, .k_len = 513, .head_dim = 96, .v_dim = 128, .scale = 0.3},
  };
  for (const CaseSpec& spec : cases) {
    SCOPED_TRACE(spec.name);
    const std::size_t before = cpu::amx_row_tasks();
    test::check_half_case<bfloat16>(spec, 2, false, 99, Precision::fast);
    EXPECT_GT(cpu::amx_row_tasks(), before) << "the call did not take the row kernel";
  }
}

// Windows and sinks (with GQA, causal and key lengths) on the row kernel against the exact
// path on the same inputs: both round out to bfloat16 once (≤ u·|out| each) and the fast
// path rounds each weight (≤ u·P_ij, a row's weights summing to ≤ 1):
// |out_fast − out_exact| ≤ u·max|v| + 2u·max|out| + 1e-5; the logits differ only by float32
// sums of exact products, so lse within 1e-5.
TEST(AmxRows, WindowsAndSinksAgainstTheExactPath) {
  QKV_REQUIRE_AMX();
  const test::ForcedBf16Unit tiles(cpu::Bf16Unit::amx);
  const RowForward rows(true);
  const CaseSpec spec{.name = "variants", .batch = 2, .q_len = 150, .k_len = 700, .q_heads = 4, .kv_heads = 2,
                      .head_dim = 64, .v_dim = 40, .causal = Causal::bottom_right, .key_padding = true};
  Tensor<float, 4> dout;
  const test::Case<float> c = test::half_case<bfloat16>(spec, 17, dout);
  double max_v = 0.0;
  for (std::size_t i = 0; i < c.v.size(); ++i) max_v = std::max(max_v, std::abs(double{c.v[i]}));
  const std::vector<float> sinks = {-0.3f, 0.2f, 1.5f, 4.0f};
  const double u = test::unit_roundoff<bfloat16>();
  struct Variant {
    const char* name;
    Window window;
    bool sinks;
  };
  for (const Variant& variant : {Variant{"window", {100, 30}, false}, Variant{"sinks", {}, true},
                                 Variant{"window_and_sinks", {300, 0}, true}}) {
    SCOPED_TRACE(variant.name);
    test::Case<float> with = c;
    with.options.window = variant.window;
    if (variant.sinks) with.options.sinks = sinks;
    const test::Results exact = test::run_cpu_half<bfloat16>(with, nullptr, 2, false, Precision::exact);
    const std::size_t before = cpu::amx_row_tasks();
    const test::Results fast = test::run_cpu_half<bfloat16>(with, nullptr, 2, false, Precision::fast);
    EXPECT_GT(cpu::amx_row_tasks(), before) << "the call did not take the row kernel";
    double max_out = 0.0, worst = 0.0, worst_lse = 0.0;
    for (std::size_t i = 0; i < exact.out.size(); ++i) {
      max_out = std::max(max_out, std::abs(double{exact.out[i]}));
      worst = std::max(worst, std::abs(double{fast.out[i]} - double{exact.out[i]}));
    }
    for (std::size_t i = 0; i < exact.lse.size(); ++i)  // −inf rows alike
      if (exact.lse[i] != fast.lse[i]) worst_lse = std::max(worst_lse, std::abs(double{fast.lse[i]} - double{exact.lse[i]}));
    EXPECT_LE(worst, u * max_v + 2.0 * u * max_out + 1e-5 * std::max(1.0, max_out));
    EXPECT_LE(worst_lse, 1e-5);
  }
}

// A NaN in V behind the causal mask of a partial tile: the row kernel's tiles would turn
// 0·NaN into NaN, so those tasks go to the block kernel, which skips the zero weights. The
// rows that cannot see the key stay finite and equal the exact path's within the contract;
// the other tasks still take the row kernel.
TEST(AmxRows, NonFiniteValueBehindTheMaskTakesTheBlockKernel) {
  QKV_REQUIRE_AMX();
  const test::ForcedBf16Unit tiles(cpu::Bf16Unit::amx);
  const RowForward rows(true);
  const CaseSpec spec{.name = "nan_behind_mask", .q_len = 256, .k_len = 256, .q_heads = 2, .kv_heads = 1,
                      .head_dim = 64, .v_dim = 64, .causal = Causal::top_left};
  Tensor<float, 4> dout;
  test::Case<float> c = test::half_case<bfloat16>(spec, 23, dout);
  constexpr int64_t kBadKey = 150;  // in key block 2, the diagonal tile of query block 2
  for (int64_t x = 0; x < spec.v_dim; ++x) c.v(0, kBadKey, 0, x) = std::numeric_limits<float>::quiet_NaN();
  const std::size_t before = cpu::amx_row_tasks();
  const test::Results fast = test::run_cpu_half<bfloat16>(c, nullptr, 2, false, Precision::fast);
  const std::size_t taken = cpu::amx_row_tasks() - before;
  EXPECT_GT(taken, 0u);
  EXPECT_LT(taken, 8u) << "every task took the row kernel, NaN behind the mask included";
  const test::Results exact = test::run_cpu_half<bfloat16>(c, nullptr, 2, false, Precision::exact);
  const double u = test::unit_roundoff<bfloat16>();
  double max_v = 0.0, max_out = 0.0;  // the finite ones (the bound of the test above)
  for (std::size_t i = 0; i < c.v.size(); ++i)
    if (std::isfinite(c.v[i])) max_v = std::max(max_v, std::abs(double{c.v[i]}));
  for (std::size_t i = 0; i < exact.out.size(); ++i)
    if (std::isfinite(exact.out[i])) max_out = std::max(max_out, std::abs(double{exact.out[i]}));
  const double bound = u * max_v + 2.0 * u * max_out + 1e-5 * std::max(1.0, max_out);
  for (int64_t h = 0; h < spec.q_heads; ++h)
    for (int64_t i = 0; i < spec.q_len; ++i)
      for (int64_t x = 0; x < spec.v_dim; ++x) {
        const float f = fast.out(0, i, h, x), e = exact.out(0, i, h, x);
        if (i < kBadKey) {
          ASSERT_TRUE(std::isfinite(f)) << "query " << i << " cannot see the NaN key";
          EXPECT_NEAR(f, e, bound) << "query " << i;
        } else {
          EXPECT_TRUE(std::isnan(f)) << "query " << i << " sees the NaN key";
        }
      }
}

// Varlen: each packed sequence's tasks are the very computation of a dense call on that
// sequence alone (same spans, same packing, same tiles), so the bits are equal.
TEST(AmxRows, VarlenEqualsEachSequenceAlone) {
  QKV_REQUIRE_AMX();
  const test::ForcedBf16Unit tiles(cpu::Bf16Unit::amx);
  const RowForward rows(true);
  const std::vector<int64_t> q_lens{70, 200, 129}, k_lens{70, 700, 300};
  constexpr int64_t kQHeads = 4, kKvHeads = 2, kDim = 64;
  std::vector<int64_t> cu_q{0}, cu_k{0};
  for (std::size_t i = 0; i < q_lens.size(); ++i) cu_q.push_back(cu_q.back() + q_lens[i]), cu_k.push_back(cu_k.back() + k_lens[i]);
  const auto q = test::narrow<bfloat16>(test::random_tensor<float, 3>({cu_q.back(), kQHeads, kDim}, 1));
  const auto k = test::narrow<bfloat16>(test::random_tensor<float, 3>({cu_k.back(), kKvHeads, kDim}, 2));
  const auto v = test::narrow<bfloat16>(test::random_tensor<float, 3>({cu_k.back(), kKvHeads, kDim}, 3));
  Tensor<bfloat16, 3> out({cu_q.back(), kQHeads, kDim});
  Tensor<float, 2> lse({kQHeads, cu_q.back()});
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  options.execution.backend = Backend::cpu;
  options.precision = Precision::fast;
  const std::size_t before = cpu::amx_row_tasks();
  varlen_attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(), .lse = lse.view(),
                            .cu_seqlens_q = std::span<const int64_t>(cu_q),
                            .cu_seqlens_k = std::span<const int64_t>(cu_k)},
                           options);
  EXPECT_GT(cpu::amx_row_tasks(), before) << "the call did not take the row kernel";
  auto rows_of = [](const auto& t, int64_t begin, int64_t n) {
    const auto& shape = t.shape();
    using E = std::remove_cvref_t<decltype(*t.data())>;
    return View4<const E>(t.data() + begin * shape[1] * shape[2], {1, n, shape[1], shape[2]},
                          {n * shape[1] * shape[2], shape[1] * shape[2], shape[2], 1});
  };
  for (std::size_t s = 0; s < q_lens.size(); ++s) {
    SCOPED_TRACE(testing::Message() << "sequence " << s);
    Tensor<bfloat16, 4> alone({1, q_lens[s], kQHeads, kDim});
    Tensor<float, 3> alone_lse({1, kQHeads, q_lens[s]});
    attention_forward(ForwardArgs<bfloat16>{rows_of(q, cu_q[s], q_lens[s]), rows_of(k, cu_k[s], k_lens[s]),
                                            rows_of(v, cu_k[s], k_lens[s]), alone.view(), alone_lse.view()},
                      options);
    EXPECT_EQ(std::memcmp(alone.data(), out.data() + cu_q[s] * kQHeads * kDim, alone.size() * sizeof(bfloat16)), 0);
    for (int64_t h = 0; h < kQHeads; ++h)
      for (int64_t i = 0; i < q_lens[s]; ++i) ASSERT_EQ(alone_lse(0, h, i), lse(h, cu_q[s] + i)) << h << ", " << i;
  }
}

// The kernel is AVX-512 and AMX code of its own: every compiled Highway target around it
// (which packs nothing it reads) takes it, with the same contract.
TEST(AmxRows, EverySimdTargetTakesIt) {
  QKV_REQUIRE_AMX();
  const test::ForcedBf16Unit tiles(cpu::Bf16Unit::amx);
  const RowForward rows(true);
  test::for_each_simd_target([](int64_t) {
    const std::size_t before = cpu::amx_row_tasks();
    test::check_half_case<bfloat16>({.name = "targets", .q_len = 100, .k_len = 200, .q_heads = 2, .kv_heads = 1,
                                     .head_dim = 40, .v_dim = 24, .causal = Causal::bottom_right},
                                    2, false, 5, Precision::fast);
    EXPECT_GT(cpu::amx_row_tasks(), before) << "the call did not take the row kernel";
  });
}

// The switch: off keeps every call on the block kernel.
TEST(AmxRows, SwitchedOffTakesTheBlockKernel) {
  QKV_REQUIRE_AMX();
  const test::ForcedBf16Unit tiles(cpu::Bf16Unit::amx);
  const RowForward rows(false);
  const CaseSpec spec{.name = "off", .q_len = 200, .k_len = 200, .head_dim = 64, .v_dim = 64};
  Tensor<float, 4> dout;
  const test::Case<float> c = test::half_case<bfloat16>(spec, 3, dout);
  const std::size_t before = cpu::amx_row_tasks();
  test::run_cpu_half<bfloat16>(c, nullptr, 2, false, Precision::fast);
  EXPECT_EQ(cpu::amx_row_tasks(), before);
}

}  // namespace
}  // namespace qkv
