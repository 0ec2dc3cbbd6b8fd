// qkv::decode over int8 caches with Precision::fast on AVX512-VNNI (cpu/int8_dot.hpp):
// each query row quantized to int8 once per task, exact int32 dot products with the
// stored rows, scales per query and per key. Forced on (skipped where the CPU lacks
// VNNI), against the same call in Precision::exact (the float32 arithmetic over the same
// stored values, itself tested against the fp64 reference in test_decode.cpp):
//
//   quantizing q_r (scale·q, float) with step s_r = max_c |q_rc| / 127 moves it by at most
//   s_r/2 per element, so each logit moves by δ_rj ≤ (s_r/2)·Σ_c |k_jc| (k the stored
//   values, int8 · scale). Weights then change by a factor within e^(±2δ) (δ = max_j δ_rj),
//   so |Σ_j (P'_j − P_j) v_j| ≤ (e^(2δ) − 1)·max_j |v_j|; plus the float32 noise (1e-5).
//
// The measured error, far below that bound, is in bench/RESULTS.md §9. Also: thread
// counts bitwise, odd head dims (masked loads, the packed plan), paged caches, variants,
// and that the path really runs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/dot_products.hpp"
#include "decode_case.hpp"
#include "half_check.hpp"  // ForcedDotProducts

namespace qkv {
namespace {

using test::DecodeCase;
using test::DecodeSpec;

// (e^(2δ) − 1)·max|v| + 1e-5·max(1, max|out|), δ from the case's stored values.
template <class T>
double quantization_bound(const DecodeCase<T>& dc, const DecodeSpec& s, double max_out) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  const int64_t group = s.q_heads / s.kv_heads;
  double delta = 0.0, max_v = 0.0;
  for (std::size_t i = 0; i < dc.c.v.size(); ++i) max_v = std::max(max_v, std::abs(double{dc.c.v[i]}));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.q_len; ++i)
      for (int64_t h = 0; h < s.q_heads; ++h) {
        double largest = 0.0;
        for (int64_t c = 0; c < s.head_dim; ++c) largest = std::max(largest, std::abs(scale * dc.c.q(b, i, h, c)));
        const double step = largest / 127.0;
        for (int64_t j = 0; j < dc.lengths[static_cast<std::size_t>(b)]; ++j) {
          double norm1 = 0.0;
          for (int64_t c = 0; c < s.head_dim; ++c) norm1 += std::abs(double{dc.c.k(b, j, h / group, c)});
          delta = std::max(delta, step / 2 * norm1);
        }
      }
  return (std::exp(2 * delta) - 1) * max_v + 1e-5 * std::max(1.0, max_out);
}

void check(const DecodeSpec& spec) {
  SCOPED_TRACE(spec.name + " block=" + std::to_string(spec.block_size));
  DecodeSpec s = spec;
  s.type = StorageType::int8;
  const DecodeCase<std::int8_t> dc(s);
  const test::Outputs exact = test::run_decode(dc, s, 2, Precision::exact);
  const test::ForcedDotProducts on(true);
  const test::Outputs fast = test::run_decode(dc, s, 2, Precision::fast);
  double max_out = 0.0, worst = 0.0;
  for (std::size_t i = 0; i < exact.out.size(); ++i) {
    max_out = std::max(max_out, std::abs(double{exact.out[i]}));
    worst = std::max(worst, std::abs(double{fast.out[i]} - double{exact.out[i]}));
  }
  EXPECT_LE(worst, quantization_bound(dc, s, max_out)) << "max |out| " << max_out;
  // (d = 1: q quantizes to ±127·s_r, which is q itself up to a float rounding.)
  if (s.head_dim > 1) {
    EXPECT_GT(worst, 0.0) << "forced on, the int8 dot products never ran";
  }
  if (std::getenv("QKV_TEST_PRINT_ERRORS") != nullptr)
    std::printf("%s: max |fast - exact| = %.3g = %.3g%% of max |out| (bound %.3g)\n", s.name.c_str(), worst,
                100 * worst / max_out, quantization_bound(dc, s, max_out));
  // Thread counts: the same bits.
  for (int threads : {1, 3}) {
    const test::Outputs again = test::run_decode(dc, s, threads, Precision::fast);
    EXPECT_EQ(std::memcmp(again.out.data(), fast.out.data(), fast.out.size() * sizeof(float)), 0) << threads;
    EXPECT_EQ(std::memcmp(again.lse.data(), fast.lse.data(), fast.lse.size() * sizeof(float)), 0) << threads;
  }
}

#define QKV_REQUIRE_VNNI() \
  if (!cpu::cpu_has_int8_dot()) GTEST_SKIP() << "no AVX512-VNNI on this CPU"

TEST(Int8Dot, DecodeWithinTheQueryQuantizationBound) {
  QKV_REQUIRE_VNNI();
  const std::vector<DecodeSpec> specs{
      {.name = "gqa4_d128", .batch = 2, .q_len = 1, .capacity = 700, .q_heads = 8, .kv_heads = 2,
       .head_dim = 128, .v_dim = 128, .lengths = {700, 333}},
      {.name = "gqa8_q3_d64", .batch = 1, .q_len = 3, .capacity = 300, .q_heads = 16, .kv_heads = 2},
      {.name = "odd_dims", .batch = 2, .q_len = 3, .capacity = 77, .q_heads = 3, .kv_heads = 1,
       .head_dim = 59, .v_dim = 13, .lengths = {77, 2}},
      {.name = "d1", .batch = 1, .q_len = 1, .capacity = 5, .head_dim = 1, .v_dim = 1},
      {.name = "d200_mqa", .batch = 1, .q_len = 4, .capacity = 100, .q_heads = 4, .kv_heads = 1,
       .head_dim = 200, .v_dim = 64, .lengths = {97}},
      {.name = "chunks_paged", .batch = 2, .q_len = 1, .capacity = 2600, .q_heads = 8, .kv_heads = 8,
       .lengths = {2600, 1100}, .block_size = 16},
      {.name = "variants", .batch = 1, .q_len = 2, .capacity = 200, .q_heads = 4, .kv_heads = 2,
       .head_dim = 64, .v_dim = 64, .window = {50, 0}, .softcap = 20.0f, .alibi = true, .sinks = true},
  };
  for (const DecodeSpec& s : specs) check(s);
}

// Precision::exact, and the switch off, keep the float32 arithmetic over int8 caches.
TEST(Int8Dot, ExactIgnoresTheSwitch) {
  DecodeSpec s{.name = "exact", .batch = 1, .q_len = 2, .capacity = 300, .q_heads = 8, .kv_heads = 2};
  s.type = StorageType::int8;
  const DecodeCase<std::int8_t> dc(s);
  test::Outputs off_fast;
  test::Outputs exact = test::run_decode(dc, s, 2, Precision::exact);
  {
    const test::ForcedDotProducts off(false);
    off_fast = test::run_decode(dc, s, 2, Precision::fast);
  }
  EXPECT_EQ(std::memcmp(exact.out.data(), off_fast.out.data(), exact.out.size() * sizeof(float)), 0);
  if (!cpu::cpu_has_int8_dot()) return;
  const test::ForcedDotProducts on(true);
  const test::Outputs on_exact = test::run_decode(dc, s, 2, Precision::exact);
  EXPECT_EQ(std::memcmp(exact.out.data(), on_exact.out.data(), exact.out.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace qkv
