// Attention health with the variants (window, ALiBi, soft-cap, sinks, dropout), decode
// shapes, 16-bit storage and varlen: the statistics are those of the P each call computes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "stats_check.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;
using namespace test::stats;

// ---- variants ----------------------------------------------------------------------

// Every variant changes P, and the statistics are those of the P the call computes.
// Tolerance: the plain-float yardstick (stats_check.hpp) does not model the variants,
// so a fixed one: on these shapes (O(1) logits, ≤ 200 keys) the cpu rows are within
// 2e-6 of the reference without variants (measured); 2e-5 leaves 10× room and still
// fails any wrong term, which moves a row's values by far more.
TEST(AttentionStats, VariantsMatchTheReference) {
  const CaseSpec spec{.name = "variants", .batch = 2, .q_len = 150, .k_len = 170, .q_heads = 4,
                      .kv_heads = 2, .head_dim = 32, .v_dim = 16, .causal = Causal::bottom_right,
                      .key_padding = true};
  const std::vector<float> slopes{0.5f, 0.25f, 0.125f, 0.0625f}, sinks{0.5f, -1.0f, 2.0f, 0.0f};
  for (int variant = 0; variant < 5; ++variant) {
    Case<float> c(spec, 50 + variant);
    const char* names[] = {"window", "alibi", "softcap", "sinks", "all"};
    SCOPED_TRACE(names[variant]);
    if (variant == 0 || variant == 4) c.options.window = {.left = 40, .right = 0};
    if (variant == 1 || variant == 4) c.options.alibi_slopes = slopes;
    if (variant == 2 || variant == 4) c.options.softcap = 2.0f;
    if (variant == 3 || variant == 4) c.options.sinks = sinks;
    const CpuRun cpu = run_cpu(c, 2);
    const ReferenceRun ref = run_reference(c);
    EXPECT_LE(test::error(cpu.stats.row_max_weight, ref.stats.row_max_weight), 2e-5);
    EXPECT_LE(test::error(cpu.stats.row_entropy, ref.stats.row_entropy), 2e-5);
    EXPECT_LE(nan_aware_error(cpu.stats.max_weight_mean, ref.stats.max_weight_mean), 2e-5);
    EXPECT_LE(nan_aware_error(cpu.stats.entropy_mean, ref.stats.entropy_mean), 2e-5);
    EXPECT_LE(nan_aware_error(cpu.stats.rows, ref.stats.rows), 0.0);
  }
}

// A sink is an entry of the softmax without a value: it is part of the distribution the
// statistics describe (weight 1 − Σ_j P_ij), and a row whose keys are all masked but
// that has a sink is counted (all its weight on the sink: 1 and 0).
TEST(AttentionStats, SinksJoinTheDistribution) {
  Case<float> c({.name = "sinks", .batch = 2, .q_len = 20, .k_len = 30, .q_heads = 2,
                 .kv_heads = 1, .head_dim = 8, .v_dim = 8, .key_padding = true},
                60);
  const std::vector<float> sinks{1.5f, -0.5f};
  const std::vector<int64_t> lengths{30, 0};
  c.options.sinks = sinks;
  c.options.key_lengths = lengths;
  const ReferenceRun ref = run_reference(c);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 2; ++h) {
      EXPECT_EQ(ref.stats.rows(b, h), 20);
      for (int64_t i = 0; i < 20; ++i) {
        double keys = 0.0, largest = 0.0, entropy = 0.0;
        for (int64_t j = 0; j < 30; ++j) {
          const double p = ref.weights(b, h, i, j);
          keys += p;
          largest = std::max(largest, p);
          if (p > 0) entropy -= p * std::log(p);
        }
        const double sink = 1.0 - keys;
        largest = std::max(largest, sink);
        if (sink > 0) entropy -= sink * std::log(sink);
        EXPECT_NEAR(ref.stats.row_max_weight(b, h, i), largest, 1e-12);
        EXPECT_NEAR(ref.stats.row_entropy(b, h, i), entropy, 1e-12);
      }
    }
  const CpuRun cpu = run_cpu(c, 2);
  EXPECT_LE(test::error(cpu.stats.row_entropy, ref.stats.row_entropy), 2e-5);
  EXPECT_EQ(cpu.stats.rows(1, 0), 20);
  EXPECT_EQ(cpu.stats.max_weight_mean(1, 0), 1.0f);
  EXPECT_EQ(cpu.stats.entropy_mean(1, 0), 0.0f);
}

// Dropout acts after the softmax: the statistics are those of P itself, the same bits as
// without dropout.
TEST(AttentionStats, DropoutLeavesTheStatisticsOfP) {
  Case<float> c({.name = "dropout", .batch = 2, .q_len = 100, .k_len = 100, .q_heads = 2,
                 .kv_heads = 2, .head_dim = 16, .v_dim = 16, .causal = Causal::top_left},
                61);
  const CpuRun plain = run_cpu(c, 2);
  c.options.dropout = {.p = 0.3f, .seed = 7};
  const CpuRun dropped = run_cpu(c, 2);
  const auto same = [](const auto& a, const auto& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  EXPECT_FALSE(same(plain.out, dropped.out));
  EXPECT_TRUE(same(plain.stats.row_entropy, dropped.stats.row_entropy));
  EXPECT_TRUE(same(plain.stats.entropy_mean, dropped.stats.entropy_mean));
  EXPECT_TRUE(same(plain.stats.max_weight_max, dropped.stats.max_weight_max));
}

// Decode shapes (≤ 16 queries) with statistics run the tiled forward: same statistics as
// the reference, and out as the decode kernel would give it within the usual rounding.
TEST(AttentionStats, DecodeShapesGetStatistics) {
  const Case<float> c({.name = "decode", .batch = 3, .q_len = 4, .k_len = 500, .q_heads = 8,
                       .kv_heads = 2, .head_dim = 64, .v_dim = 64, .causal = Causal::bottom_right,
                       .key_padding = true},
                      62);
  const CpuRun with = run_cpu(c, 2);
  const CpuRun without = run_cpu(c, 2, kThreshold, /*with_stats=*/false);
  expect_cpu_matches_reference(c, with, run_reference(c), kThreshold);
  EXPECT_LE(test::max_abs_diff(with.out, without.out), 1e-5);
}

// 16-bit storage: the kernel widens q, k, v exactly to float, so the statistics (float,
// like lse) are the bits of a float call on the widened values.
TEST(AttentionStats, HalfStorageGivesTheFloatStatisticsOfTheWidenedInputs) {
  const CaseSpec spec{.name = "half", .batch = 2, .q_len = 70, .k_len = 90, .q_heads = 4,
                      .kv_heads = 2, .head_dim = 32, .v_dim = 16, .causal = Causal::bottom_right,
                      .key_padding = true};
  Case<float> c(spec, 63);
  Tensor<bfloat16, 4> q(c.q.shape()), k(c.k.shape()), v(c.v.shape());
  for (auto [half, full] : {std::pair{&q, &c.q}, std::pair{&k, &c.k}, std::pair{&v, &c.v}})
    for (std::size_t i = 0; i < half->size(); ++i) {
      (*half)[i] = bfloat16((*full)[i]);
      (*full)[i] = static_cast<float>((*half)[i]);  // the float call sees the same values
    }
  const CpuRun widened = run_cpu(c, 2);
  StatsOut<float> stats(spec.batch, spec.q_heads, spec.q_len);
  const AttentionStats<float> views = stats.views();
  Tensor<bfloat16, 4> out({spec.batch, spec.q_len, spec.q_heads, spec.v_dim});
  AttentionOptions options = c.options;
  options.execution.backend = Backend::cpu;
  options.execution.threads = 2;
  options.precision = Precision::exact;  // the float32 arithmetic's claim (bf16 dots differ in the logits)
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                     .stats = &views},
                    options);
  const auto same = [](const auto& a, const auto& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  EXPECT_TRUE(same(stats.row_entropy, widened.stats.row_entropy));
  EXPECT_TRUE(same(stats.row_max_weight, widened.stats.row_max_weight));
  EXPECT_TRUE(same(stats.entropy_mean, widened.stats.entropy_mean));
  EXPECT_TRUE(same(stats.rows, widened.stats.rows));
}

// ---- varlen ------------------------------------------------------------------------

// Each sequence of a packed call gets the statistics of a dense call on it alone.
TEST(AttentionStats, VarlenEqualsDenseCallsPerSequence) {
  const std::vector<int64_t> q_lens{5, 0, 70, 3, 2}, k_lens{7, 3, 90, 0, 2};
  const int64_t q_heads = 4, kv_heads = 2, d = 24, dv = 16;
  std::vector<int64_t> cu_q{0}, cu_k{0};
  for (std::size_t s = 0; s < q_lens.size(); ++s) {
    cu_q.push_back(cu_q.back() + q_lens[s]);
    cu_k.push_back(cu_k.back() + k_lens[s]);
  }
  const int64_t seqs = static_cast<int64_t>(q_lens.size()), total_q = cu_q.back();
  const auto q = test::random_tensor<float, 3>({total_q, q_heads, d}, 31);
  const auto k = test::random_tensor<float, 3>({cu_k.back(), kv_heads, d}, 32);
  const auto v = test::random_tensor<float, 3>({cu_k.back(), kv_heads, dv}, 33);
  for (const Causal causal : {Causal::none, Causal::bottom_right}) {
    for (const Backend backend : {Backend::cpu, Backend::reference}) {
      SCOPED_TRACE(backend == Backend::cpu ? "cpu" : "reference");
      AttentionOptions options;
      options.causal = causal;
      options.execution.backend = backend;
      Tensor<float, 3> out({total_q, q_heads, dv});
      Tensor<float, 2> mean_weight({seqs, q_heads}), max_weight({seqs, q_heads}),
          mean_entropy({seqs, q_heads}), share({seqs, q_heads});
      Tensor<int64_t, 2> rows({seqs, q_heads});
      Tensor<float, 2> row_weight({q_heads, total_q}), row_entropy({q_heads, total_q});
      const VarlenAttentionStats<float> views{
          .max_weight_mean = mean_weight.view(), .max_weight_max = max_weight.view(),
          .entropy_mean = mean_entropy.view(), .saturated_share = share.view(),
          .rows = rows.view(), .row_max_weight = row_weight.view(),
          .row_entropy = row_entropy.view(), .saturation_threshold = kThreshold};
      varlen_attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                                .cu_seqlens_q = std::span<const int64_t>(cu_q),
                                .cu_seqlens_k = std::span<const int64_t>(cu_k), .stats = &views},
                               options);
      for (int64_t s = 0; s < seqs; ++s) {
        // The sequence alone, as a dense [1, n, h, d] call (views into the packed arrays).
        const int64_t nq = q_lens[s], nk = k_lens[s];
        const View4<const float> sq(q.data() + cu_q[s] * q_heads * d, {1, nq, q_heads, d},
                                    {0, q_heads * d, d, 1});
        const View4<const float> sk(k.data() + cu_k[s] * kv_heads * d, {1, nk, kv_heads, d},
                                    {0, kv_heads * d, d, 1});
        const View4<const float> sv(v.data() + cu_k[s] * kv_heads * dv, {1, nk, kv_heads, dv},
                                    {0, kv_heads * dv, dv, 1});
        Tensor<float, 4> dense_out({1, nq, q_heads, dv});
        StatsOut<float> dense(1, q_heads, nq);
        const AttentionStats<float> dense_views = dense.views();
        attention_forward({.q = sq, .k = sk, .v = sv, .out = dense_out.view(), .stats = &dense_views},
                          options);
        for (int64_t h = 0; h < q_heads; ++h) {
          EXPECT_EQ(rows(s, h), dense.rows(0, h)) << "sequence " << s;
          const auto same = [](float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; };
          EXPECT_TRUE(same(mean_weight(s, h), dense.max_weight_mean(0, h))) << "sequence " << s;
          EXPECT_TRUE(same(max_weight(s, h), dense.max_weight_max(0, h))) << "sequence " << s;
          EXPECT_TRUE(same(mean_entropy(s, h), dense.entropy_mean(0, h))) << "sequence " << s;
          EXPECT_TRUE(same(share(s, h), dense.saturated_share(0, h))) << "sequence " << s;
          for (int64_t i = 0; i < nq; ++i) {
            EXPECT_EQ(row_weight(h, cu_q[s] + i), dense.row_max_weight(0, h, i));
            EXPECT_EQ(row_entropy(h, cu_q[s] + i), dense.row_entropy(0, h, i));
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace qkv
