// qkv::mla_decode (absorbed latent attention over c_kv / k_pe caches) against an fp64
// oracle written here from the formula — S = scale·(q_nope·c_kv + q_pe·k_pe), out =
// softmax(S)·c_kv over the keys each query sees (bottom-right causal among the Nq new
// tokens, cut to the cache length, and with indices the listed ones, −1 and repeats
// dropped) — over the stored (rounded) cache values. Every storage (float32, bfloat16,
// float16), contiguous and paged with shuffled blocks, Nq 1..4, cache lengths 0..N,
// head sizes read in place and widened, every compiled SIMD target, the reference
// backend, 1/2/3 threads bitwise equal; bad calls are a qkv::Error naming the argument,
// with nothing written.
//
// Tolerance, as test_decode.cpp's: max |got − ref64| ≤ 2·max |plain32 − ref64| + floor,
// plain32 the same formula as an unfused float32 loop, floor = 8·ε₃₂·max(1, max |ref64|):
// float32 arithmetic (every storage with Precision::exact; float32 and float16 caches
// always). A bfloat16 cache with Precision::fast on a CPU with vdpbf16ps takes the dot
// products (cpu/decode_latent-inl.h): q rounded to bfloat16 once and P once, the bf16
// contract: checked against the oracle of the rounded queries, plus what P rounded once
// can add to each element.
#include <gtest/gtest.h>

#include <qkv/error.hpp>
#include <qkv/decode.hpp>
#include <qkv/float8.hpp>
#include <qkv/mla.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cpu/dot_products.hpp"
#include "forced_vdpbf16ps.hpp"
#include "mla_case.hpp"
#include "simd_targets.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

using test::Case;
using test::Shape;
using test::every_shape;
using test::expect_matches;
using test::expect_refused;
using test::random_tensor;
using test::shapes;
using test::step_options;

// A bfloat16 cache with Precision::fast on a bf16 unit, forced on: the latent block step
// for tiles of whole vectors of rows (16 heads × Nq 1, 2, 4; a partly visible block
// falls back to the float step within the same rows; 32 heads × 4 and 128 heads × 1 for
// tiles of more than 64 rows, the latter with blocks of 96 keys), within the bound
// expect_matches states — and not the float32 path's bits (the dot products did run).
void expect_latent_step_within_the_bf16_contract() {
  struct Rows {
    int64_t heads, q_len;
  };
  test::for_each_simd_target([&](int64_t) {
    std::uint64_t seed = 41;
    for (const Rows r : {Rows{16, 1}, Rows{16, 2}, Rows{16, 4}, Rows{32, 4}, Rows{128, 1}})
      for (int64_t block : {0, 16}) {
        const int64_t q_len = r.q_len;
        const Shape s{2, q_len, r.heads, 64, 16, {77, 300}, 304, block};
        const std::string what = std::to_string(r.heads) + " heads, Nq " + std::to_string(q_len) +
                                 (block > 0 ? " paged" : " contiguous");
        for (int64_t lists : {0, 40}) {
          const Case<bfloat16> c(s, seed++, lists);
          expect_matches(c, Backend::automatic, what + (lists > 0 ? " indices" : ""), Precision::fast);
          Tensor<float, 4> fast({s.batch, s.q_len, s.heads, s.dc}), exact({s.batch, s.q_len, s.heads, s.dc});
          Tensor<float, 3> lse({s.batch, s.heads, s.q_len});
          mla_decode(c.args(fast, lse), step_options(0.3, 2, Backend::automatic, Precision::fast));
          mla_decode(c.args(exact, lse), step_options(0.3, 2, Backend::automatic, Precision::exact));
          EXPECT_NE(0, std::memcmp(fast.data(), exact.data(), fast.size() * sizeof(float))) << what;
        }
      }
  });
}

TEST(MlaDecode, Bfloat16OnTheDotUnitWithinTheBf16Contract) {
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const test::ForcedVdpbf16ps forced;
  expect_latent_step_within_the_bf16_contract();
}

// The same block step with its two products on the AMX tiles (P·V added onto the rows'
// accumulators in the tiles); tiles of 128 rows take the spans (below) unless the row
// kernel's switch is off, so the column step runs them once more with it off.
TEST(MlaDecode, Bfloat16OnTheAmxTilesWithinTheBf16Contract) {
  if (!cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 tiles on this CPU";
  const test::ForcedAmx forced;
  expect_latent_step_within_the_bf16_contract();
  cpu::set_amx_row_forward_for_test(false);
  const std::size_t spans_before = cpu::amx_latent_spans();
  expect_latent_step_within_the_bf16_contract();
  EXPECT_EQ(cpu::amx_latent_spans(), spans_before) << "the switch off: no span";
  cpu::set_amx_row_forward_for_test(std::nullopt);
}

// On the AMX tiles a bfloat16 cache with ≥ 128 query rows a tile (heads × queries) takes
// the row-layout spans (decode_latent-inl.h's LatentSpan): blocks of 512 keys, each packed
// once into the tiles' order and attended by groups of up to 64 query rows. Caches longer
// than a span (several spans per chunk and a partial last one), the last block of an
// Nq > 1 step seen by each row up to its own key (per-row key ranges in the span), 128 × 1,
// 64 × 2, 48 × 3 (a 16-row group after two of 64) and 16 × 8 rows, rows read in place
// (contiguous; pages of 128 keys) and gathered (pages of 16 keys; a latent part of 40
// channels, not whole tiles), indices (a gathered problem of the listed keys), each within
// the bound expect_matches states, and the spans counted: the kernel did run. 2 threads,
// so chunks merge.
TEST(MlaDecode, Bfloat16OnTheAmxSpansWithinTheBf16Contract) {
  if (!cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 tiles on this CPU";
  const test::ForcedAmx forced;
  struct Rows {
    int64_t heads, q_len, dc, dr;
  };
  test::for_each_simd_target([&](int64_t) {
    std::uint64_t seed = 4100;
    for (const Rows r : {Rows{128, 1, 64, 16}, Rows{64, 2, 64, 16}, Rows{48, 3, 64, 16}, Rows{16, 8, 64, 16},
                         Rows{128, 1, 40, 8}})
      for (int64_t block : {0, 16, 128}) {
        const Shape s{3, r.q_len, r.heads, r.dc, r.dr, {600, 1500, 2}, 1536, block};
        const std::string what = std::to_string(r.heads) + " heads, Nq " + std::to_string(r.q_len) + ", dc " +
                                 std::to_string(r.dc) + (block > 0 ? ", pages of " + std::to_string(block) : ", contiguous");
        const std::size_t spans_before = cpu::amx_latent_spans();
        expect_matches(Case<bfloat16>(s, seed++), Backend::automatic, what, Precision::fast);
        // (dc 40 on a target of 8 lanes: the accumulator rows are not whole tiles, so the
        // column step takes the call.)
        if (r.dc % 16 == 0) {
          EXPECT_GT(cpu::amx_latent_spans(), spans_before) << what;
        }
        if (block == 0) expect_matches(Case<bfloat16>(s, seed++, 300), Backend::automatic, what + ", indices", Precision::fast);
      }
  });
}

// A NaN in the value of the newest key of an Nq = 3 step on the spans (64 heads): only the query
// that sees that key gets NaN (the inputs put it there); the two before it, whose part of
// the last block ends earlier, stay finite and equal to the result without the NaN (on
// the spans) within what rounding P once adds — the span, which would add 0·NaN on the
// tiles, gives that block to the float step.
TEST(MlaDecode, AmxSpansKeepAHiddenNanOutOfEarlierQueries) {
  if (!cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 tiles on this CPU";
  const test::ForcedAmx forced;
  const Shape s{1, 3, 64, 64, 16, {700}, 704, 0};
  const Case<bfloat16> clean(s, 77);
  Case<bfloat16> c(s, 77);
  const int64_t newest = 699;
  c.ckv[static_cast<std::size_t>(newest * s.dc + 5)] = bfloat16(std::numeric_limits<float>::quiet_NaN());
  Tensor<float, 4> out({1, 3, 64, 64}), want({1, 3, 64, 64});
  Tensor<float, 3> lse({1, 64, 3});
  const std::size_t spans_before = cpu::amx_latent_spans();
  mla_decode(clean.args(want, lse), step_options(0.3, 1, Backend::automatic, Precision::fast));
  mla_decode(c.args(out, lse), step_options(0.3, 1, Backend::automatic, Precision::fast));
  EXPECT_GT(cpu::amx_latent_spans(), spans_before);
  // Both runs round q and P to bfloat16 once (the span's P, the float step's exact P):
  // they differ by at most what that rounding adds, u·Σ_j P_j·|v_j| ≤ 2⁻⁸·max|v| each.
  double largest = 0.0;
  for (const bfloat16 v : clean.ckv) largest = std::max(largest, std::abs(static_cast<double>(float(v))));
  for (int64_t h = 0; h < 64; ++h) {
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t x = 0; x < 64; ++x) {
        ASSERT_TRUE(std::isfinite(out(0, i, h, x))) << "query " << i << " head " << h;
        EXPECT_NEAR(out(0, i, h, x), want(0, i, h, x), 2.0 * largest / 256.0) << "query " << i << " head " << h;
      }
    EXPECT_TRUE(std::isnan(out(0, 2, h, 5))) << "head " << h;
  }
}

// Spans where the values are not the keys' own channels: qkv::decode over one kv head of
// 128 query heads (multi-query attention) with a separate bfloat16 value cache (dv 48 ≠ d
// 80), 2 queries (the last block seen per row), caches of 0, 300 and 1100 keys (three
// spans). Against the formula over the stored values with the bf16-rounded queries,
// within what P rounded once adds (u·Σ_j P_j·|v_j|, u = 2⁻⁸) plus float32 sums; the spans
// counted.
TEST(MlaDecode, AmxSpansWithSeparateValues) {
  if (!cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 tiles on this CPU";
  const test::ForcedAmx forced;
  const int64_t batch = 3, q_len = 2, heads = 128, d = 80, dv = 48, capacity = 1104;
  const std::vector<int64_t> lengths{0, 300, 1100};
  const Tensor<float, 4> k_wide = random_tensor<float, 4>({batch, capacity, 1, d}, 11);
  const Tensor<float, 4> v_wide = random_tensor<float, 4>({batch, capacity, 1, dv}, 12);
  Tensor<bfloat16, 4> k({batch, capacity, 1, d}), v({batch, capacity, 1, dv});
  for (std::size_t n = 0; n < k.size(); ++n) k[n] = bfloat16(k_wide[n]);
  for (std::size_t n = 0; n < v.size(); ++n) v[n] = bfloat16(v_wide[n]);
  const Tensor<float, 4> q = random_tensor<float, 4>({batch, q_len, heads, d}, 13);
  Tensor<float, 4> out({batch, q_len, heads, dv});
  Tensor<float, 3> lse({batch, heads, q_len});
  const double scale = 0.1;
  const std::size_t spans_before = cpu::amx_latent_spans();
  decode(DecodeArgs<bfloat16>{.q = q.cview(), .k_cache = k.cview(), .v_cache = v.cview(), .cache_lengths = lengths,
                              .out = out.view(), .lse = lse.view()},
         step_options(scale, 2, Backend::automatic, Precision::fast));
  EXPECT_GT(cpu::amx_latent_spans(), spans_before);
  double largest = 1.0;
  for (std::size_t n = 0; n < v.size(); ++n) largest = std::max(largest, std::abs(static_cast<double>(float(v[n]))));
  const double floor = static_cast<double>(d + 1100) * std::numeric_limits<float>::epsilon() * largest;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < q_len; ++i)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t visible = std::max<int64_t>(0, lengths[static_cast<std::size_t>(b)] - q_len + i + 1);
        SCOPED_TRACE(testing::Message() << "b " << b << " i " << i << " h " << h);
        if (visible == 0) {
          for (int64_t c = 0; c < dv; ++c) EXPECT_EQ(out(b, i, h, c), 0.0f);
          EXPECT_EQ(lse(b, h, i), -std::numeric_limits<float>::infinity());
          continue;
        }
        std::vector<double> logit(static_cast<std::size_t>(visible));
        double top = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < visible; ++j) {
          double dot = 0.0;
          for (int64_t c = 0; c < d; ++c)
            dot += static_cast<double>(float(bfloat16(q(b, i, h, c)))) * static_cast<double>(float(k(b, j, 0, c)));
          logit[static_cast<std::size_t>(j)] = scale * dot;
          top = std::max(top, scale * dot);
        }
        double sum = 0.0;
        for (double& x : logit) sum += (x = std::exp(x - top));
        EXPECT_NEAR(lse(b, h, i), top + std::log(sum), 1e-5 * std::max(1.0, std::abs(top + std::log(sum))));
        for (int64_t c = 0; c < dv; ++c) {
          double want = 0.0, weighted_abs = 0.0;
          for (int64_t j = 0; j < visible; ++j) {
            const double x = static_cast<double>(float(v(b, j, 0, c))), w = logit[static_cast<std::size_t>(j)] / sum;
            want += w * x;
            weighted_abs += w * std::abs(x);
          }
          EXPECT_LE(std::abs(out(b, i, h, c) - want), weighted_abs / 256.0 + floor) << "c " << c;
        }
      }
}

// A float8 latent pool (vLLM's FP8 MLA cache: [c_kv | k_pe] rows in float8, one scale for
// the tensor) through qkv::decode, the values the keys' first dc channels, Precision::fast
// with vdpbf16ps forced on: the latent step widens the float8 rows to bfloat16 exactly and
// applies the scale to each block's scores and weights. Against the formula over the
// stored values (float8 × scale) with the bf16-rounded queries, within what the weight
// P·s rounded once to bfloat16 adds, u·Σ_j P_j·|v_j| (u = 2⁻⁸ as above), plus float32 sums
// over ≤ 300 keys of 80 channels ((d + keys)·ε of the largest value). Nq 3: the newest
// keys' partly visible block takes the float step in the same rows. The bits differ
// from Precision::exact's (the dot products ran). row_scales: a scale per token, the
// keys' and the values' different (the factors on each key's scores and weights).
// heads 128 on the AMX tiles: 384 query rows a tile, so the spans run (counted), a whole
// span and a partial one, the last block's rows each up to their own key.
template <class F>
void expect_float8_latent_pool_on_the_dot_unit(int64_t heads = 16, bool row_scales = false) {
  const int64_t batch = 2, q_len = 3, dc = 64, dr = 16, d = dc + dr;
  const int64_t longest = heads >= 128 ? 700 : 300, capacity = longest + 4;
  const std::vector<int64_t> lengths{77, longest};
  const float s8 = 0.02f;
  const Tensor<float, 4> wide = random_tensor<float, 4>({batch, capacity, 1, d}, 5, 1.0 / s8);
  Tensor<F, 4> pool({batch, capacity, 1, d});
  for (std::size_t n = 0; n < pool.size(); ++n) pool[n] = F(wide[n]);
  const Tensor<float, 4> q = random_tensor<float, 4>({batch, q_len, heads, d}, 6);
  const auto kv = pool.cview();
  const View4<const F> values(kv.data, {batch, capacity, 1, dc}, kv.strides);
  std::vector<float> k_scales(static_cast<std::size_t>(batch * capacity), s8), v_scales = k_scales;
  if (row_scales) {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> spread(0.5f, 1.5f);
    for (float& x : k_scales) x = s8 * spread(rng);
    for (float& x : v_scales) x = s8 * spread(rng);
  }
  const View3<const float> k_scale(k_scales.data(), {batch, capacity, 1}, {capacity, 1, 1});
  const View3<const float> v_scale(v_scales.data(), {batch, capacity, 1}, {capacity, 1, 1});
  const auto ks = [&](int64_t b, int64_t j) { return static_cast<double>(k_scales[static_cast<std::size_t>(b * capacity + j)]); };
  const auto vs = [&](int64_t b, int64_t j) { return static_cast<double>(v_scales[static_cast<std::size_t>(b * capacity + j)]); };
  const double scale = 0.1;
  auto run = [&](Precision precision, Tensor<float, 4>& out, Tensor<float, 3>& lse) {
    decode(DecodeArgs<F>{.q = q.cview(), .k_cache = kv, .v_cache = values, .cache_lengths = lengths,
                         .out = out.view(), .lse = lse.view(), .k_scale = k_scale, .v_scale = v_scale},
           step_options(scale, 2, Backend::automatic, precision));
  };
  test::for_each_simd_target([&](int64_t) {
    Tensor<float, 4> out({batch, q_len, heads, dc}), exact({batch, q_len, heads, dc});
    Tensor<float, 3> lse({batch, heads, q_len}), exact_lse({batch, heads, q_len});
    const std::size_t spans_before = cpu::amx_latent_spans();
    run(Precision::fast, out, lse);
    if (heads >= 128 && cpu::bf16_unit(Precision::fast) == cpu::Bf16Unit::amx && cpu::amx_row_forward()) {
      EXPECT_GT(cpu::amx_latent_spans(), spans_before) << "128 heads on the tiles: spans";
    }
    run(Precision::exact, exact, exact_lse);
    EXPECT_NE(0, std::memcmp(out.data(), exact.data(), out.size() * sizeof(float)));
    double largest = 1.0;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < capacity; ++j)
        for (int64_t c = 0; c < d; ++c)
          largest = std::max(largest, std::abs(static_cast<double>(float(pool(b, j, 0, c)))) * std::max(ks(b, j), vs(b, j)));
    const double floor = static_cast<double>(d + longest) * std::numeric_limits<float>::epsilon() * largest;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t visible = lengths[b] - q_len + i + 1;
          std::vector<double> logit(static_cast<std::size_t>(visible));
          double top = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < visible; ++j) {
            double dot = 0.0;
            for (int64_t c = 0; c < d; ++c)
              dot += static_cast<double>(float(bfloat16(q(b, i, h, c)))) * float(pool(b, j, 0, c)) * ks(b, j);
            logit[static_cast<std::size_t>(j)] = scale * dot;
            top = std::max(top, scale * dot);
          }
          double sum = 0.0;
          for (double& x : logit) sum += (x = std::exp(x - top));
          SCOPED_TRACE(testing::Message() << "b " << b << " i " << i << " h " << h);
          EXPECT_NEAR(lse(b, h, i), top + std::log(sum), 1e-5 * std::max(1.0, std::abs(top + std::log(sum))));
          for (int64_t c = 0; c < dc; ++c) {
            double want = 0.0, weighted_abs = 0.0;
            for (int64_t j = 0; j < visible; ++j) {
              const double v = static_cast<double>(float(pool(b, j, 0, c))) * vs(b, j), p = logit[static_cast<std::size_t>(j)] / sum;
              want += p * v;
              weighted_abs += p * std::abs(v);
            }
            EXPECT_LE(std::abs(out(b, i, h, c) - want), weighted_abs / 256.0 + floor) << "c " << c;
          }
        }
  });
}

TEST(MlaDecode, Float8LatentPoolOnTheDotUnitWithinTheBf16Contract) {
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const test::ForcedVdpbf16ps forced;
  expect_float8_latent_pool_on_the_dot_unit<float8_e4m3fn>();
  expect_float8_latent_pool_on_the_dot_unit<float8_e5m2>();
}

TEST(MlaDecode, Float8LatentPoolOnTheAmxTilesWithinTheBf16Contract) {
  if (!cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 tiles on this CPU";
  const test::ForcedAmx forced;
  expect_float8_latent_pool_on_the_dot_unit<float8_e4m3fn>();
  expect_float8_latent_pool_on_the_dot_unit<float8_e5m2>();
  expect_float8_latent_pool_on_the_dot_unit<float8_e4m3fn>(16, true);
}

// 128 heads: the spans (above), with a scale per token, the keys' and values' apart, and
// once more on the column step with the switch off (no span counted).
TEST(MlaDecode, Float8LatentPoolOnTheAmxSpansWithinTheBf16Contract) {
  if (!cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 tiles on this CPU";
  const test::ForcedAmx forced;
  expect_float8_latent_pool_on_the_dot_unit<float8_e4m3fn>(128, true);
  expect_float8_latent_pool_on_the_dot_unit<float8_e5m2>(128, false);
  cpu::set_amx_row_forward_for_test(false);
  const std::size_t spans_before = cpu::amx_latent_spans();
  expect_float8_latent_pool_on_the_dot_unit<float8_e4m3fn>(128, true);
  EXPECT_EQ(cpu::amx_latent_spans(), spans_before) << "the switch off: no span";
  cpu::set_amx_row_forward_for_test(std::nullopt);
}

TEST(MlaDecode, Float32MatchesTheFormulaOnEveryTarget) { every_shape<float>("float32"); }
TEST(MlaDecode, Bfloat16MatchesTheFormulaOnEveryTarget) { every_shape<bfloat16>("bfloat16"); }
TEST(MlaDecode, Float16MatchesTheFormulaOnEveryTarget) { every_shape<float16>("float16"); }

TEST(MlaDecode, ReferenceBackendMatchesTheFormula) {
  std::uint64_t seed = 101;
  for (const Shape& s : shapes()) {
    expect_matches(Case<float>(s, seed++), Backend::reference, "reference");
    expect_matches(Case<bfloat16>(s, seed++, 7), Backend::reference, "reference bf16 indices");
  }
}

TEST(MlaDecode, BitwiseEqualForAnyThreadCount) {
  for (int64_t block : {0, 16}) {
    const Case<bfloat16> c({2, 3, 16, 64, 16, {700, 1500}, 1504, block}, 7);
    const Case<bfloat16> listed({2, 3, 16, 64, 16, {700, 1500}, 1504, block}, 8, 300);
    for (const Case<bfloat16>* cc : {&c, &listed}) test::expect_same_bits_for_any_thread_count(*cc);
  }
}

TEST(MlaDecode, BadCallsNameTheArgumentAndWriteNothing) {
  expect_refused([](auto&, AttentionOptions& o) { o.scale.reset(); }, "options.scale: required");
  expect_refused([](auto& a, auto&) { a.q_pe.shape[3] = 4; }, "kpe_cache");
  expect_refused([](auto& a, auto&) { a.q_pe.shape[2] = 3; }, "q_pe");
  expect_refused([](auto& a, auto&) { a.kpe_cache.shape[1] = 4; }, "kpe_cache");
  expect_refused([](auto& a, auto&) { a.out.shape[3] = 8; }, "out");
  expect_refused([](auto& a, auto&) { a.lse.shape[1] = 2; }, "lse");
  static std::vector<int64_t> too_long{5, 17};
  expect_refused([](auto& a, auto&) { a.cache_lengths = too_long; }, "cache_lengths[1]");
  static std::vector<int32_t> bad_table{0, 1, 2, 99};
  expect_refused([](auto& a, auto&) { a.block_table = TensorView<const int32_t, 2>::contiguous(bad_table.data(), {2, 2}); },
                 "block_table[1, 1]");
  static std::vector<int64_t> bad_index(2 * 2 * 4, 0);
  bad_index[5] = 9;  // sequence 0 holds 5 keys
  expect_refused([](auto& a, auto&) { a.indices = TensorView<const int64_t, 3>::contiguous(bad_index.data(), {2, 2, 4}); },
                 "indices");
  expect_refused([](auto&, AttentionOptions& o) { o.window = Window{4, 0}; }, "window");
  static std::vector<int64_t> key_lengths{1, 1};
  expect_refused([](auto&, AttentionOptions& o) { o.key_lengths = key_lengths; }, "key_lengths");
}

}  // namespace
}  // namespace qkv
