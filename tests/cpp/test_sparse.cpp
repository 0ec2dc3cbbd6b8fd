// Sparse attention over listed keys (qkv/sparse.hpp): the fp64 reference against dense
// attention with the scattered boolean mask (the definition), the cpu backend against the
// reference on every compiled SIMD target, thread-count and list-order invariance, empty
// rows, 16-bit storage.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "cpu/dot_products.hpp"
#include "forced_vdpbf16ps.hpp"
#include "simd_targets.hpp"
#include "sparse_case.hpp"

namespace qkv::test {
namespace {

constexpr double kEps32 = std::numeric_limits<float>::epsilon();

const SparseSpec kCases[] = {
    {.name = "mqa_shared", .batch = 2, .q_len = 7, .k_len = 13, .q_heads = 4, .kv_heads = 1, .head_dim = 16,
     .v_dim = 16, .topk = 9},
    {.name = "gqa_shared_top_left", .batch = 2, .q_len = 6, .k_len = 11, .q_heads = 4, .kv_heads = 2,
     .head_dim = 8, .v_dim = 12, .topk = 5, .causal = Causal::top_left},
    {.name = "gqa_per_head_bottom_right", .batch = 1, .q_len = 9, .k_len = 14, .q_heads = 6, .kv_heads = 3,
     .head_dim = 24, .v_dim = 8, .topk = 7, .shared = false, .causal = Causal::bottom_right},
    {.name = "topk_over_keys_odd_dims", .batch = 1, .q_len = 4, .k_len = 5, .q_heads = 2, .kv_heads = 2,
     .head_dim = 3, .v_dim = 5, .topk = 12, .shared = false, .causal = Causal::top_left},
    {.name = "sinks_softcap", .batch = 1, .q_len = 6, .k_len = 20, .q_heads = 4, .kv_heads = 2, .head_dim = 32,
     .v_dim = 32, .topk = 10, .causal = Causal::bottom_right, .sinks = true, .softcap = 5.0f},
    {.name = "two_blocks_d59", .batch = 1, .q_len = 5, .k_len = 90, .q_heads = 3, .kv_heads = 1, .head_dim = 59,
     .v_dim = 17, .topk = 80},
    {.name = "mla_like_16_heads", .batch = 1, .q_len = 3, .k_len = 300, .q_heads = 16, .kv_heads = 1,
     .head_dim = 64, .v_dim = 32, .topk = 200, .causal = Causal::bottom_right},
    // Nk > 256·topk: the attended set is sorted, not marked in a bit set (KeySelection).
    {.name = "few_keys_long_sequence", .batch = 1, .q_len = 4, .k_len = 600, .q_heads = 2, .kv_heads = 1,
     .head_dim = 8, .v_dim = 8, .topk = 2, .causal = Causal::bottom_right},
    // Many rows listing keys of each 64-key block of the backward's per-block pass.
    {.name = "many_rows_three_key_blocks", .batch = 1, .q_len = 70, .k_len = 150, .q_heads = 8, .kv_heads = 2,
     .head_dim = 32, .v_dim = 16, .topk = 40, .causal = Causal::bottom_right},
    // Rows in two tiles of the forward's sweep (32 rows: topk ≥ k_len / 2, SweepTileRows),
    // lists over two of its key ranges (512 keys: ForwardRangeKeys), several blocks of one
    // row inside a range.
    {.name = "tiles_and_ranges", .batch = 2, .q_len = 37, .k_len = 700, .q_heads = 4, .kv_heads = 2,
     .head_dim = 16, .v_dim = 8, .topk = 350, .shared = false, .causal = Causal::bottom_right},
    // Short lists over many keys: tiles of 256 rows (SweepTileRows: 2 heads of 16 floats a
    // row), two of them, over three key ranges of 512.
    {.name = "large_tiles_short_lists", .batch = 1, .q_len = 300, .k_len = 1200, .q_heads = 4, .kv_heads = 2,
     .head_dim = 16, .v_dim = 16, .topk = 40, .causal = Causal::bottom_right},
    // Rows too wide for ranges of 512 (ForwardRangeKeys: 2.5 KiB a key): three of 256.
    {.name = "wide_rows_ranges_of_256", .batch = 1, .q_len = 40, .k_len = 600, .q_heads = 2, .kv_heads = 1,
     .head_dim = 320, .v_dim = 320, .topk = 300, .causal = Causal::bottom_right},
    // One list per query for two kv heads over 38 tiles of 32 rows: the forward's sets
    // computed once per wave of 16+ tiles (SharedSets), a wave across the batch entries,
    // a last tile of 24 rows.
    {.name = "waves_of_shared_sets", .batch = 2, .q_len = 600, .k_len = 700, .q_heads = 4, .kv_heads = 2,
     .head_dim = 16, .v_dim = 8, .topk = 350, .causal = Causal::bottom_right},
    {.name = "per_head_sinks_top_left", .batch = 2, .q_len = 8, .k_len = 8, .q_heads = 4, .kv_heads = 4,
     .head_dim = 16, .v_dim = 8, .topk = 4, .shared = false, .causal = Causal::top_left, .sinks = true},
};

class SparseCases : public ::testing::TestWithParam<SparseSpec> {};
INSTANTIATE_TEST_SUITE_P(Shapes, SparseCases, ::testing::ValuesIn(kCases),
                         [](const auto& param_info) { return param_info.param.name; });

// Tolerance of an fp32 result against fp64: a few roundings of values of size `scale`.
double fp32_tolerance(double scale) { return 64.0 * kEps32 * std::max(1.0, scale); }

template <class T, int R>
double max_abs(const Tensor<T, R>& t) {
  double m = 0.0;
  for (std::size_t i = 0; i < t.size(); ++i)
    if (std::isfinite(as_double(t[i]))) m = std::max(m, std::abs(as_double(t[i])));
  return m;
}

// The reference's sparse path is the definition: dense attention whose boolean mask is
// scattered from the lists, intersected with causality. Forward and backward agree to
// fp64 rounding.
TEST_P(SparseCases, ReferenceIsDenseAttentionWithScatteredMask) {
  const SparseSpec& s = GetParam();
  const auto in = sparse_inputs<double>(s, 11);
  const auto sparse = run_sparse(s, in, Backend::reference, 1, /*with_backward=*/true);
  const auto dense = run_dense_masked(s, in);
  EXPECT_LE(max_error(sparse.out, dense.out), 1e-12);
  EXPECT_LE(max_error(sparse.lse, dense.lse), 1e-12);
  EXPECT_LE(max_error(sparse.dq, dense.dq), 1e-12);
  EXPECT_LE(max_error(sparse.dk, dense.dk), 1e-12);
  EXPECT_LE(max_error(sparse.dv, dense.dv), 1e-12);
  for (std::size_t h = 0; h < sparse.dsinks.size(); ++h) EXPECT_NEAR(sparse.dsinks[h], dense.dsinks[h], 1e-6);
}

TEST_P(SparseCases, CpuForwardMatchesReferenceOnEverySimdTarget) {
  const SparseSpec& s = GetParam();
  const auto in = sparse_inputs<float>(s, 21);
  const auto ref = run_sparse(s, convert<double>(in), Backend::reference, 1, false);
  for_each_simd_target([&](int64_t) {
    const auto cpu = run_sparse(s, in, Backend::cpu, 2, false);
    EXPECT_LE(max_error(cpu.out, ref.out), fp32_tolerance(max_abs(ref.out)));
    EXPECT_LE(max_error(cpu.lse, ref.lse), fp32_tolerance(max_abs(ref.lse)));
  });
}

TEST_P(SparseCases, CpuForwardIsBitwiseTheSameForAnyThreadCount) {
  const SparseSpec& s = GetParam();
  const auto in = sparse_inputs<float>(s, 31);
  const auto one = run_sparse(s, in, Backend::cpu, 1, false);
  for (int threads : {2, 3, 7}) {
    const auto many = run_sparse(s, in, Backend::cpu, threads, false);
    EXPECT_EQ(0, std::memcmp(one.out.data(), many.out.data(), one.out.size() * sizeof(float))) << threads;
    EXPECT_EQ(0, std::memcmp(one.lse.data(), many.lse.data(), one.lse.size() * sizeof(float))) << threads;
  }
}

// Gradients: dK and dV sum over every query that lists the key (up to Nq·G terms), dQ
// over the row's attended keys; the bound scales with the largest gradient.
TEST_P(SparseCases, CpuBackwardMatchesReferenceOnEverySimdTarget) {
  const SparseSpec& s = GetParam();
  const auto in = sparse_inputs<float>(s, 23);
  const auto ref = run_sparse(s, convert<double>(in), Backend::reference, 1, true);
  for_each_simd_target([&](int64_t) {
    const auto cpu = run_sparse(s, in, Backend::cpu, 2, true);
    EXPECT_LE(max_error(cpu.dq, ref.dq), fp32_tolerance(max_abs(ref.dq)));
    EXPECT_LE(max_error(cpu.dk, ref.dk), fp32_tolerance(max_abs(ref.dk)));
    EXPECT_LE(max_error(cpu.dv, ref.dv), fp32_tolerance(max_abs(ref.dv)));
    for (std::size_t h = 0; h < cpu.dsinks.size(); ++h)
      EXPECT_NEAR(cpu.dsinks[h], ref.dsinks[h], fp32_tolerance(std::abs(ref.dsinks[h])));
  });
}

// One thread takes the fused schedule (every head's dK and dV summed while its dQ tiles
// pass); 7 threads the two passes (dQ tiles, then key blocks) on every case, since no case
// has 14 (batch, kv head) pairs; 2 and 3 threads either, by the case's pairs. The two
// schedules must give the same bits: a key's sums gain the same terms in the same order.
template <class T>
void expect_same_bits_for_any_thread_count(const SparseSpec& s) {
  const auto in = sparse_inputs<T>(s, 33);
  const auto one = run_sparse(s, in, Backend::cpu, 1, true);
  for (int threads : {2, 3, 7}) {
    const auto many = run_sparse(s, in, Backend::cpu, threads, true);
    EXPECT_EQ(0, std::memcmp(one.dq.data(), many.dq.data(), one.dq.size() * sizeof(T))) << threads;
    EXPECT_EQ(0, std::memcmp(one.dk.data(), many.dk.data(), one.dk.size() * sizeof(T))) << threads;
    EXPECT_EQ(0, std::memcmp(one.dv.data(), many.dv.data(), one.dv.size() * sizeof(T))) << threads;
    EXPECT_EQ(one.dsinks, many.dsinks) << threads;
  }
}

TEST_P(SparseCases, CpuBackwardIsBitwiseTheSameForAnyThreadCount) {
  ASSERT_LT(GetParam().batch * GetParam().kv_heads, 14) << "7 threads must take the two passes";
  expect_same_bits_for_any_thread_count<float>(GetParam());
  expect_same_bits_for_any_thread_count<bfloat16>(GetParam());
  expect_same_bits_for_any_thread_count<float16>(GetParam());
}

// 16-bit storage with Precision::exact: widened exactly, fp32 arithmetic, rounded once on
// store; against the reference on the same (16-bit) inputs, the bound is the output's own
// rounding (2^-9 relative for bfloat16, 2^-12 for float16) plus the fp32 error. With
// Precision::fast a bfloat16 call may take a bf16 unit (on AVX512-BF16, the pair step for
// these small groups), whose P rounded to bfloat16 once moves out by up to u·max|v|: out
// is held to that bound (Bfloat16SmallGroupsOnVdpbf16psWithinTheBf16Contract explains it).
template <class T>
void expect_half_close(const SparseSpec& s, double rounding) {
  const auto in = sparse_inputs<T>(s, 41);
  const auto exact_in = convert<double>(in);
  const auto ref = run_sparse(s, exact_in, Backend::reference, 1, false);
  const auto cpu = run_sparse(s, in, Backend::cpu, 2, false, Precision::exact);
  const double scale = std::max(1.0, max_abs(ref.out));
  EXPECT_LE(max_error(cpu.out, ref.out), 2.0 * rounding * scale + fp32_tolerance(scale));
  EXPECT_LE(max_error(cpu.lse, ref.lse), fp32_tolerance(max_abs(ref.lse)));
  const auto on_unit = run_sparse(s, in, Backend::cpu, 2, false);
  EXPECT_LE(max_error(on_unit.out, ref.out), rounding * (max_abs(exact_in.v) + scale) + fp32_tolerance(scale));
  EXPECT_LE(max_error(on_unit.lse, ref.lse), fp32_tolerance(max_abs(ref.lse)));
  const auto cpu_grad = run_sparse(s, in, Backend::cpu, 2, true, Precision::exact);
  const auto ref_grad = run_sparse(s, convert<double>(in), Backend::reference, 1, true);
  // The backward's D = ⟨dO, O⟩ reads the stored O, rounded to T (as any 16-bit backward
  // does): that rounding enters every dS of the row a second time, hence 4 roundings.
  for (const auto& [fast, exact] : {std::pair{&cpu_grad.dq, &ref_grad.dq}, std::pair{&cpu_grad.dk, &ref_grad.dk},
                                    std::pair{&cpu_grad.dv, &ref_grad.dv}}) {
    const double grad_scale = std::max(1.0, max_abs(*exact));
    EXPECT_LE(max_error(*fast, *exact), 4.0 * rounding * grad_scale + fp32_tolerance(grad_scale));
  }
}

TEST_P(SparseCases, HalfStorageWithinItsRounding) {
  expect_half_close<bfloat16>(GetParam(), std::ldexp(1.0, -9));
  expect_half_close<float16>(GetParam(), std::ldexp(1.0, -12));
}

// bfloat16 with Precision::fast on a bf16 unit (vdpbf16ps, or the AMX tiles), forced on,
// groups of 16 heads (DeepSeek's MQA/MLA mode; two kv heads here): both passes take the
// unit (sparse_dot_unit). The forward's logits are the float step's but for the order of
// float32 sums, so lse is held to the fp32 bound; each weight P is rounded to bfloat16 once
// for P·V (|ΔP| ≤ u·P, u = 2^-9), which moves out by at most u·Σ_j P_j·|v_j| ≤ u·max|v|,
// and the stored out rounds once more (u·|out|). The backward's S and dP are the same
// exact products summed in float32, and dQ = dS·K rounds each dS to bfloat16 once:
// dq's bound adds u·scale·max_i Σ_j |dS_ij|·|k_j| (DqWeightRounding); dk and dv take
// the float P and dS, so they keep the 16-bit bound of expect_half_close. The dot
// products did run (fast differs from exact, forward and gradients), and the bits do not
// depend on the thread count. Returns the forward's lse of the native target.
const SparseSpec kGroupsOf16{.name = "mqa_groups_of_16", .batch = 2, .q_len = 19, .k_len = 420, .q_heads = 32,
                             .kv_heads = 2, .head_dim = 64, .v_dim = 32, .topk = 200, .causal = Causal::bottom_right,
                             .sinks = true};

// max over (b, i, h, c) of scale·Σ_j |dS_ij|·|k_jc| over row i's attended keys (listed and
// causally visible), in fp64 from the reference's lse and out: what rounding every dS to
// bfloat16 can move dq by, in units of u.
double dq_weight_rounding(const SparseSpec& s, const SparseInputs<double>& in, const SparseResults<double>& ref) {
  const Tensor<std::uint8_t, 4> keep = scattered_mask(s, in.lists);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  const int64_t group = s.q_heads / s.kv_heads;
  double worst = 0.0;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t i = 0; i < s.q_len; ++i) {
        const int64_t limit = s.causal == Causal::bottom_right ? i + s.k_len - s.q_len
                              : s.causal == Causal::top_left   ? i
                                                               : s.k_len - 1;
        double delta = 0.0;
        for (int64_t x = 0; x < s.v_dim; ++x) delta += in.dout(b, i, h, x) * ref.out(b, i, h, x);
        std::vector<double> sum(static_cast<std::size_t>(s.head_dim), 0.0);
        for (int64_t j = 0; j <= std::min(limit, s.k_len - 1); ++j) {
          if (keep(b, h, i, j) == 0) continue;
          double logit = 0.0, dp = 0.0;
          for (int64_t c = 0; c < s.head_dim; ++c) logit += in.q(b, i, h, c) * in.k(b, j, h / group, c);
          for (int64_t x = 0; x < s.v_dim; ++x) dp += in.dout(b, i, h, x) * in.v(b, j, h / group, x);
          const double ds = std::abs(std::exp(scale * logit - ref.lse(b, h, i)) * (dp - delta));
          for (int64_t c = 0; c < s.head_dim; ++c) sum[static_cast<std::size_t>(c)] += ds * std::abs(in.k(b, j, h / group, c));
        }
        for (const double x : sum) worst = std::max(worst, scale * x);
      }
  return worst;
}

template <class T, int R>
bool same_bits(const Tensor<T, R>& a, const Tensor<T, R>& b) {
  return std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

std::vector<float> expect_groups_of_16_within_the_bf16_contract() {
  const double u = std::ldexp(1.0, -9);
  const SparseSpec& s = kGroupsOf16;
  const auto in = sparse_inputs<bfloat16>(s, 77);
  const auto exact_in = convert<double>(in);
  const auto ref = run_sparse(s, exact_in, Backend::reference, 1, true);
  const double dq_rounding = u * dq_weight_rounding(s, exact_in, ref);
  test::for_each_simd_target([&](int64_t) {
    const auto fast = run_sparse(s, in, Backend::cpu, 2, true);
    const double scale = std::max(1.0, max_abs(ref.out));
    EXPECT_LE(max_error(fast.out, ref.out), u * (max_abs(exact_in.v) + scale) + fp32_tolerance(scale));
    EXPECT_LE(max_error(fast.lse, ref.lse), fp32_tolerance(max_abs(ref.lse)));
    for (const auto& [got, want, extra] : {std::tuple{&fast.dq, &ref.dq, dq_rounding}, std::tuple{&fast.dk, &ref.dk, 0.0},
                                           std::tuple{&fast.dv, &ref.dv, 0.0}}) {
      const double grad_scale = std::max(1.0, max_abs(*want));
      EXPECT_LE(max_error(*got, *want), 4.0 * u * grad_scale + extra + fp32_tolerance(grad_scale));
    }
    const auto exact = run_sparse(s, in, Backend::cpu, 2, true, Precision::exact);
    EXPECT_FALSE(same_bits(fast.out, exact.out));
    EXPECT_FALSE(same_bits(fast.dq, exact.dq));
    EXPECT_FALSE(same_bits(fast.dk, exact.dk));
    const auto one = run_sparse(s, in, Backend::cpu, 1, true);
    const auto three = run_sparse(s, in, Backend::cpu, 3, true);
    EXPECT_TRUE(same_bits(one.out, three.out));
    EXPECT_TRUE(same_bits(one.lse, three.lse));
    for (const auto& [a, b] : {std::pair{&one.dq, &three.dq}, std::pair{&one.dk, &three.dk},
                               std::pair{&one.dv, &three.dv}})
      EXPECT_TRUE(same_bits(*a, *b));
    EXPECT_EQ(one.dsinks, three.dsinks);
  });
  const auto native = run_sparse(s, in, Backend::cpu, 2, false);
  return {native.lse.data(), native.lse.data() + native.lse.size()};
}

TEST(Sparse, Bfloat16GroupsOf16OnTheDotUnitWithinTheBf16Contract) {
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const test::ForcedVdpbf16ps forced;
  expect_groups_of_16_within_the_bf16_contract();
}

// The same on the AMX tiles (Xeons), whose float32 sums of the logits run in another
// order than vdpbf16ps's: the lse bits differ from that unit's (the tiles did run; out,
// rounded to bfloat16, hides that difference).
TEST(Sparse, Bfloat16GroupsOf16OnTheAmxTilesWithinTheBf16Contract) {
  if (!cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 tiles on this CPU";
  std::vector<float> on_vdpbf16ps;
  {
    const test::ForcedVdpbf16ps forced;
    const auto native = run_sparse(kGroupsOf16, sparse_inputs<bfloat16>(kGroupsOf16, 77), Backend::cpu, 2, false);
    on_vdpbf16ps.assign(native.lse.data(), native.lse.data() + native.lse.size());
  }
  const test::ForcedAmx forced;
  const std::vector<float> on_tiles = expect_groups_of_16_within_the_bf16_contract();
  EXPECT_NE(0, std::memcmp(on_tiles.data(), on_vdpbf16ps.data(), on_tiles.size() * sizeof(float)));
}

// bfloat16 groups of fewer than 16 heads on vdpbf16ps (forced; sparse_pair_step): both
// passes take the pair step (bf16_group_block.hpp), as groups of 16 do there. The logits
// are exact products summed in float32, so lse keeps the fp32 bound; each P is rounded to
// bfloat16 once for P·V, which moves out by at most u·Σ_j P_j·|v_j| ≤ u·max|v|, and the
// stored out rounds once more (u·|out|); dQ = dS·K rounds each dS to bfloat16 once
// (dq_weight_rounding), dK and dV take the float P and dS — the bounds of the groups of 16
// above. Shapes: GQA 32/8's groups of 4 at d 128 with dv 96 (a 64-column panel and a
// 32-column one), groups of 3 (a partial row tile) with sinks and a soft-cap, groups of
// 2 per kv head; blocks of every length (topk 150: 64 + 64 + 22 keys, odd and even). The
// step did run (fast differs from exact), on every SIMD target of the float code around
// it (the softmax, the dK/dV sums), and its bits do not depend on the thread count (1
// thread takes the fused schedule, 3 the two passes). PyTorch's 2× rule:
// tests/python/test_sparse.py.
TEST(Sparse, Bfloat16SmallGroupsOnVdpbf16psWithinTheBf16Contract) {
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const test::ForcedVdpbf16ps forced;
  const double u = std::ldexp(1.0, -9);
  const SparseSpec specs[] = {
      {.name = "groups_of_4", .batch = 2, .q_len = 37, .k_len = 300, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
       .v_dim = 96, .topk = 150, .causal = Causal::bottom_right},
      {.name = "groups_of_3_sinks_softcap", .batch = 1, .q_len = 29, .k_len = 200, .q_heads = 6, .kv_heads = 2,
       .head_dim = 64, .v_dim = 64, .topk = 90, .causal = Causal::top_left, .sinks = true, .softcap = 5.0f},
      {.name = "groups_of_2_per_kv_head", .batch = 1, .q_len = 21, .k_len = 130, .q_heads = 4, .kv_heads = 2,
       .head_dim = 32, .v_dim = 32, .topk = 70, .shared = false, .causal = Causal::bottom_right},
      // a tile of 4 rows, then 3 (the kernels' remainder rows after a full tile)
      {.name = "groups_of_7", .batch = 1, .q_len = 23, .k_len = 170, .q_heads = 7, .kv_heads = 1, .head_dim = 96,
       .v_dim = 64, .topk = 80, .causal = Causal::bottom_right}};
  for (const SparseSpec& s : specs) {
    SCOPED_TRACE(s.name);
    const auto in = sparse_inputs<bfloat16>(s, 91);
    const auto exact_in = convert<double>(in);
    const auto ref = run_sparse(s, exact_in, Backend::reference, 1, true);
    const double scale = std::max(1.0, max_abs(ref.out)), dq_rounding = u * dq_weight_rounding(s, exact_in, ref);
    test::for_each_simd_target([&](int64_t) {
      const auto fast = run_sparse(s, in, Backend::cpu, 2, true);
      EXPECT_LE(max_error(fast.out, ref.out), u * (max_abs(exact_in.v) + scale) + fp32_tolerance(scale));
      EXPECT_LE(max_error(fast.lse, ref.lse), fp32_tolerance(max_abs(ref.lse)));
      for (const auto& [got, want, extra] : {std::tuple{&fast.dq, &ref.dq, dq_rounding},
                                             std::tuple{&fast.dk, &ref.dk, 0.0}, std::tuple{&fast.dv, &ref.dv, 0.0}}) {
        const double grad_scale = std::max(1.0, max_abs(*want));
        EXPECT_LE(max_error(*got, *want), 4.0 * u * grad_scale + extra + fp32_tolerance(grad_scale));
      }
      const auto exact = run_sparse(s, in, Backend::cpu, 2, true, Precision::exact);
      EXPECT_FALSE(same_bits(fast.out, exact.out));
      EXPECT_FALSE(same_bits(fast.dq, exact.dq));
      const auto one = run_sparse(s, in, Backend::cpu, 1, true), three = run_sparse(s, in, Backend::cpu, 3, true);
      EXPECT_TRUE(same_bits(one.out, three.out) && same_bits(one.lse, three.lse));
      EXPECT_TRUE(same_bits(one.dq, three.dq) && same_bits(one.dk, three.dk) && same_bits(one.dv, three.dv));
      EXPECT_EQ(one.dsinks, three.dsinks);
    });
  }
}

// A row that lists nothing, or whose listed keys causality removes: out 0, lse −inf,
// on both backends, never NaN.
TEST(Sparse, EmptyAndFullyMaskedRowsGiveZeroAndMinusInf) {
  SparseSpec s{.name = "empty", .batch = 1, .q_len = 3, .k_len = 6, .q_heads = 2, .kv_heads = 1, .head_dim = 8,
               .v_dim = 4, .topk = 3, .causal = Causal::top_left};
  auto in = sparse_inputs<float>(s, 51);
  for (int64_t t = 0; t < s.topk; ++t) {
    in.lists(0, 0, 0, t) = -1;  // row 0: nothing listed
    in.lists(0, 0, 1, t) = 5;   // row 1: only key 5, past its causal limit (key ≤ 1)
    in.lists(0, 0, 2, t) = t;   // row 2: keys 0..2, all visible
  }
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    const auto r = run_sparse(s, in, backend, 2, /*with_backward=*/true);
    for (int64_t i : {0, 1})
      for (int64_t h = 0; h < s.q_heads; ++h) {
        EXPECT_EQ(r.lse(0, h, i), -std::numeric_limits<float>::infinity());
        for (int64_t c = 0; c < s.v_dim; ++c) EXPECT_EQ(r.out(0, i, h, c), 0.0f);
        for (int64_t c = 0; c < s.head_dim; ++c) EXPECT_EQ(r.dq(0, i, h, c), 0.0f);
      }
    for (int64_t j = 3; j < s.k_len; ++j)
      for (int64_t c = 0; c < s.head_dim; ++c) EXPECT_EQ(r.dk(0, j, 0, c), 0.0f);
    EXPECT_TRUE(std::isfinite(r.lse(0, 0, 2)));
  }
}

// A list is a set: shuffled, with repeats and −1 in other places, the same bits.
TEST(Sparse, ListOrderAndRepeatsDoNotChangeTheBits) {
  SparseSpec s{.name = "order", .batch = 2, .q_len = 5, .k_len = 40, .q_heads = 4, .kv_heads = 2,
               .head_dim = 16, .v_dim = 16, .topk = 24, .shared = false, .causal = Causal::bottom_right};
  const auto in = sparse_inputs<float>(s, 61);
  auto shuffled = in;
  std::mt19937_64 rng(5);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t l = 0; l < s.kv_heads; ++l)
      for (int64_t i = 0; i < s.q_len; ++i) {
        std::vector<int64_t> row;
        for (int64_t t = 0; t < s.topk; ++t) row.push_back(in.lists(b, l, i, t));
        std::shuffle(row.begin(), row.end(), rng);
        // a repeat of the row's first listed key in place of a −1, if it has one
        const auto listed = std::find_if(row.begin(), row.end(), [](int64_t j) { return j >= 0; });
        const auto none = std::find(row.begin(), row.end(), int64_t{-1});
        if (listed != row.end() && none != row.end()) *none = *listed;
        for (int64_t t = 0; t < s.topk; ++t) shuffled.lists(b, l, i, t) = row[static_cast<std::size_t>(t)];
      }
  const auto a = run_sparse(s, in, Backend::cpu, 2, true);
  const auto b = run_sparse(s, shuffled, Backend::cpu, 2, true);
  EXPECT_EQ(0, std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.dq.data(), b.dq.data(), a.dq.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.dk.data(), b.dk.data(), a.dk.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.dv.data(), b.dv.data(), a.dv.size() * sizeof(float)));
}

// int32 lists (transformers' type) read like int64 ones, in PyTorch's bhsd layout too.
TEST(Sparse, Int32ListsAndBhsdViewsGiveTheSameBits) {
  SparseSpec s{.name = "int32", .batch = 2, .q_len = 6, .k_len = 30, .q_heads = 4, .kv_heads = 1,
               .head_dim = 16, .v_dim = 8, .topk = 12, .causal = Causal::top_left};
  const auto in = sparse_inputs<float>(s, 71);
  const auto expected = run_sparse(s, in, Backend::cpu, 2, false);
  Tensor<int32_t, 3> lists32({s.batch, s.q_len, s.topk});
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.q_len; ++i)
      for (int64_t t = 0; t < s.topk; ++t) lists32(b, i, t) = static_cast<int32_t>(in.lists(b, 0, i, t));
  auto q = to_bhsd(in.q), k = to_bhsd(in.k), v = to_bhsd(in.v);
  Tensor<float, 4> out({s.batch, s.q_heads, s.q_len, s.v_dim});
  Tensor<float, 3> lse({s.batch, s.q_heads, s.q_len});
  AttentionOptions options = sparse_options(s, {}, Backend::cpu);
  sparse_attention_forward(SparseForwardArgs<float>{.q = bhsd_view(q), .k = bhsd_view(k), .v = bhsd_view(v),
                                                    .indices = TensorView<const int32_t, 3>(lists32.view()),
                                                    .out = bhsd_view(out), .lse = lse.view()},
                           options);
  EXPECT_EQ(0, std::memcmp(to_bhsd(expected.out).data(), out.data(), out.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(expected.lse.data(), lse.data(), lse.size() * sizeof(float)));
}

// Lists read through any strides: entries 3 apart inside a wider buffer (whose other
// entries hold out-of-range values that must never be read) and a [B, topk, Nq] buffer
// seen as [B, Nq, topk], in int32 and int64, give the bits of contiguous lists.
TEST(Sparse, StridedListsGiveTheBitsOfContiguousOnes) {
  SparseSpec s{.name = "strided", .batch = 2, .q_len = 40, .k_len = 300, .q_heads = 4, .kv_heads = 2,
               .head_dim = 16, .v_dim = 8, .topk = 70, .causal = Causal::bottom_right};
  const auto in = sparse_inputs<float>(s, 83);
  const auto expected = run_sparse(s, in, Backend::cpu, 2, false);
  const auto run_with = [&](auto view) {
    Tensor<float, 4> out({s.batch, s.q_len, s.q_heads, s.v_dim});
    Tensor<float, 3> lse({s.batch, s.q_heads, s.q_len});
    sparse_attention_forward(SparseForwardArgs<float>{.q = in.q.view(), .k = in.k.view(), .v = in.v.view(),
                                                      .indices = view, .out = out.view(), .lse = lse.view()},
                             sparse_options(s, {}, Backend::cpu));
    EXPECT_EQ(0, std::memcmp(expected.out.data(), out.data(), out.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(expected.lse.data(), lse.data(), lse.size() * sizeof(float)));
  };
  const auto check = [&](auto type_tag) {
    using I = decltype(type_tag);
    const int64_t B = s.batch, N = s.q_len, K = s.topk;
    std::vector<I> wide(static_cast<std::size_t>(B * N * K * 3), static_cast<I>(s.k_len + 1000));
    std::vector<I> swapped(static_cast<std::size_t>(B * K * N));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < N; ++i)
        for (int64_t t = 0; t < K; ++t) {
          const auto j = static_cast<I>(in.lists(b, 0, i, t));
          wide[static_cast<std::size_t>(((b * N + i) * K + t) * 3)] = j;
          swapped[static_cast<std::size_t>((b * K + t) * N + i)] = j;
        }
    run_with(TensorView<const I, 3>(wide.data(), {B, N, K}, {N * K * 3, K * 3, 3}));
    run_with(TensorView<const I, 3>(swapped.data(), {B, N, K}, {K * N, 1, N}));
  };
  check(int32_t{});
  check(int64_t{});
}

// A list shared by every kv head ([B, Nq, topk]: the forward computes each row's set once
// for all kv heads, SharedSets) gives the bits of the same list given to each kv head
// ([B, Hkv, Nq, topk]: each kv head's unit computes it), at any thread count.
TEST(Sparse, SharedListsGiveTheBitsOfTheListPerKvHead) {
  SparseSpec shared{.name = "shared", .batch = 3, .q_len = 300, .k_len = 520, .q_heads = 6, .kv_heads = 3,
                    .head_dim = 16, .v_dim = 16, .topk = 270, .causal = Causal::bottom_right};
  const auto in = sparse_inputs<float>(shared, 29);
  SparseSpec per_head = shared;
  per_head.shared = false;
  auto copied = in;
  copied.lists = Tensor<int64_t, 4>({shared.batch, shared.kv_heads, shared.q_len, shared.topk});
  for (int64_t b = 0; b < shared.batch; ++b)
    for (int64_t g = 0; g < shared.kv_heads; ++g)
      for (int64_t i = 0; i < shared.q_len; ++i)
        for (int64_t t = 0; t < shared.topk; ++t) copied.lists(b, g, i, t) = in.lists(b, 0, i, t);
  const auto expected = run_sparse(per_head, copied, Backend::cpu, 1, false);
  for (int threads : {1, 2, 5}) {
    const auto got = run_sparse(shared, in, Backend::cpu, threads, false);
    EXPECT_EQ(0, std::memcmp(expected.out.data(), got.out.data(), got.out.size() * sizeof(float))) << threads;
    EXPECT_EQ(0, std::memcmp(expected.lse.data(), got.lse.data(), got.lse.size() * sizeof(float))) << threads;
  }
}

// The sparse call, forward then backward, with v given as a view of k's first dv
// channels (as DeepSeek's MLA cache is read), expected to give the bits of the same values
// copied into their own tensor.
template <class T>
void ExpectValuesInKeysGiveTheBitsOfACopy(const SparseSpec& s, std::uint64_t seed) {
  const auto in = sparse_inputs<T>(s, seed);
  auto copied = in;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t j = 0; j < s.k_len; ++j)
      for (int64_t x = 0; x < s.v_dim; ++x) copied.v(b, j, 0, x) = in.k(b, j, 0, x);
  const auto expected = run_sparse(s, copied, Backend::cpu, 2, true);
  SparseResults<T> got = sparse_results<T>(s);
  const auto k = in.k.cview();
  const View4<const T> v(k.data, {s.batch, s.k_len, s.kv_heads, s.v_dim}, k.strides);
  const AttentionOptions options = sparse_options(s, {}, Backend::cpu);
  const KeyIndices indices = indices_of(s, in.lists);
  sparse_attention_forward(SparseForwardArgs<T>{.q = in.q.cview(), .k = k, .v = v, .indices = indices,
                                                .out = got.out.view(), .lse = got.lse.view()},
                           options);
  sparse_attention_backward(SparseBackwardArgs<T>{.q = in.q.cview(), .k = k, .v = v, .indices = indices,
                                                  .out = got.out.cview(), .lse = got.lse.cview(),
                                                  .dout = in.dout.cview(), .dq = got.dq.view(), .dk = got.dk.view(),
                                                  .dv = got.dv.view(), .dsinks = got.dsinks},
                            options);
  EXPECT_EQ(0, std::memcmp(expected.out.data(), got.out.data(), got.out.size() * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(expected.lse.data(), got.lse.data(), got.lse.size() * sizeof(float)));
  for (const auto& [a, b] :
       {std::pair{&expected.dq, &got.dq}, std::pair{&expected.dk, &got.dk}, std::pair{&expected.dv, &got.dv}})
    EXPECT_EQ(0, std::memcmp(a->data(), b->data(), a->size() * sizeof(T)));
}

// Latent attention's values are its keys' first dv channels: given as a view of k they
// take the backward's shortcut of gathering the rows once (sparse_backward.cpp's
// BlockOnDots); the same values in their own tensor do not. Both give the same bits,
// forward and backward, on each bf16 unit and on the float step.
TEST(Sparse, ValuesAsAViewOfTheKeysGiveTheSameBits) {
  const SparseSpec s{.name = "latent", .batch = 2, .q_len = 7, .k_len = 90, .q_heads = 16, .kv_heads = 1,
                     .head_dim = 48, .v_dim = 32, .topk = 40, .causal = Causal::bottom_right};
  auto expect_same = [&](const char* unit) {
    SCOPED_TRACE(unit);
    ExpectValuesInKeysGiveTheBitsOfACopy<bfloat16>(s, 83);
  };
  cpu::set_dot_products_for_test(false);
  expect_same("float step");
  cpu::set_dot_products_for_test(std::nullopt);
  if (cpu::cpu_has_bf16_dot()) {
    const test::ForcedVdpbf16ps forced;
    expect_same("vdpbf16ps");
  }
  if (cpu::cpu_has_amx_bf16()) {
    const test::ForcedAmx forced;
    expect_same("AMX tiles");
  }
}

// The same in float32 (the float step's range copy, WidenedRange, then copies the keys
// alone and reads the values from them), over tiles of 32 rows and two key ranges.
TEST(Sparse, FloatValuesAsAViewOfTheKeysGiveTheSameBits) {
  ExpectValuesInKeysGiveTheBitsOfACopy<float>(
      {.name = "latent_fp32", .batch = 1, .q_len = 40, .k_len = 700, .q_heads = 16, .kv_heads = 1, .head_dim = 48,
       .v_dim = 32, .topk = 350, .causal = Causal::bottom_right},
      61);
}

}  // namespace
}  // namespace qkv::test
