// qkv::mla_decode over float8 latent caches kept as two arrays (c_kv and k_pe in
// float8_e4m3fn or float8_e5m2, a scale per tensor each: vLLM's and SGLang's FP8 MLA
// caches when an engine keeps the parts apart):
// - Precision::exact against the fp64 oracle of the stored values (element · scale),
//   with different scales for the two parts (the kpe_scale / ckv_scale factor on q_pe),
//   every SIMD target, contiguous and paged, Nq 1..4, key lists; tolerance as
//   test_mla_decode.cpp's (float32 arithmetic; the oracle's values are element · scale
//   rounded once to float32, 2⁻²⁴ relative, far inside it);
// - equal scales give exactly the bits of qkv::decode over the combined [c_kv | k_pe]
//   pool (the path test_mla_decode.cpp's float8 pool test checks against the formula on
//   the bf16 dot unit), exact and fast, with vdpbf16ps forced on where the CPU has it;
// - 1/2/3 threads bitwise equal; bad scales a qkv::Error naming the argument, nothing written.
#include <gtest/gtest.h>

#include <qkv/decode.hpp>
#include <qkv/error.hpp>
#include <qkv/float8.hpp>
#include <qkv/mla.hpp>

#include <cmath>
#include <cstring>
#include <limits>
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
using test::Float8Scales;
using test::Shape;
using test::expect_refused;
using test::step_options;

template <class F>
void every_shape_exact(const char* storage) {
  test::for_each_simd_target([&](int64_t) {
    std::uint64_t seed = 211;
    for (const Shape& s : test::shapes()) {
      const std::string what = std::string(storage) + " Nq " + std::to_string(s.q_len) + " dc " +
                               std::to_string(s.dc) + " dr " + std::to_string(s.dr) +
                               (s.block_size > 0 ? " paged" : " contiguous");
      test::expect_matches(Case<F>(s, seed++), Backend::automatic, what, Precision::exact);
      test::expect_matches(Case<F>(s, seed++, 9), Backend::automatic, what + " indices", Precision::exact);
    }
  });
}

TEST(MlaDecodeFloat8, E4m3MatchesTheFormulaOnEveryTarget) { every_shape_exact<float8_e4m3fn>("float8_e4m3fn"); }
TEST(MlaDecodeFloat8, E5m2MatchesTheFormulaOnEveryTarget) { every_shape_exact<float8_e5m2>("float8_e5m2"); }

TEST(MlaDecodeFloat8, ReferenceBackendMatchesTheFormula) {
  std::uint64_t seed = 301;
  for (const Shape& s : test::shapes()) {
    test::expect_matches(Case<float8_e4m3fn>(s, seed++), Backend::reference, "reference e4m3", Precision::exact);
    test::expect_matches(Case<float8_e5m2>(s, seed++, 7), Backend::reference, "reference e5m2 indices",
                         Precision::exact);
  }
}

// The case's two caches as one combined pool [outer, inner, 1, dc + dr] (row r = [c_kv
// row r | k_pe row r]) and its queries as [q_nope | q_pe]; qkv::decode over it, values
// the first dc channels, k_scale = v_scale = the one scale.
template <class F>
void decode_combined(const Case<F>& c, float s8, const AttentionOptions& options, Tensor<float, 4>& out,
                     Tensor<float, 3>& lse) {
  const Shape& s = c.s;
  const int64_t d = s.dc + s.dr;
  const int64_t outer = s.block_size > 0 ? c.blocks : s.batch, inner = s.block_size > 0 ? s.block_size : s.capacity;
  Tensor<F, 4> pool({outer, inner, 1, d});
  for (int64_t r = 0; r < outer * inner; ++r) {
    for (int64_t x = 0; x < s.dc; ++x) pool[static_cast<std::size_t>(r * d + x)] = c.ckv[static_cast<std::size_t>(r * s.dc + x)];
    for (int64_t x = 0; x < s.dr; ++x)
      pool[static_cast<std::size_t>(r * d + s.dc + x)] = c.kpe[static_cast<std::size_t>(r * s.dr + x)];
  }
  Tensor<float, 4> q({s.batch, s.q_len, s.heads, d});
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.q_len; ++i)
      for (int64_t h = 0; h < s.heads; ++h) {
        for (int64_t x = 0; x < s.dc; ++x) q(b, i, h, x) = c.q_nope(b, i, h, x);
        for (int64_t x = 0; x < s.dr; ++x) q(b, i, h, s.dc + x) = c.q_pe(b, i, h, x);
      }
  const auto kv = pool.cview();
  DecodeArgs<F> a{.q = q.cview(), .k_cache = kv, .v_cache = View4<const F>(kv.data, {outer, inner, 1, s.dc}, kv.strides),
                  .cache_lengths = s.lengths, .out = out.view(), .lse = lse.view(),
                  .k_scale = View3<const float>(&s8, {outer, inner, 1}, {0, 0, 0}),
                  .v_scale = View3<const float>(&s8, {outer, inner, 1}, {0, 0, 0})};
  if (s.block_size > 0)
    a.block_table = TensorView<const int32_t, 2>::contiguous(c.table.data(), {s.batch, c.blocks / s.batch});
  decode(a, options);
}

template <class F>
void expect_combined_pool_bits(Precision precision) {
  const float s8 = 0.04f;
  std::uint64_t seed = 401;
  test::for_each_simd_target([&](int64_t) {
    // 16 heads: the latent step's tiles on the dot unit (fast); Nq 3: a partly visible
    // block takes the float step within the same rows.
    for (const Shape& s : {Shape{2, 3, 16, 64, 16, {77, 300}, 304, 0}, Shape{2, 3, 16, 64, 16, {77, 300}, 304, 16},
                           Shape{3, 1, 5, 12, 4, {0, 2, 77}, 80, 8}}) {
      const Case<F> c(s, seed++, 0, Float8Scales{s8, s8});
      const AttentionOptions options = step_options(0.2, 2, Backend::automatic, precision);
      Tensor<float, 4> got({s.batch, s.q_len, s.heads, s.dc}), want({s.batch, s.q_len, s.heads, s.dc});
      Tensor<float, 3> got_lse({s.batch, s.heads, s.q_len}), want_lse({s.batch, s.heads, s.q_len});
      mla_decode(c.args(got, got_lse), options);
      decode_combined(c, s8, options, want, want_lse);
      const std::string what = "heads " + std::to_string(s.heads) + (s.block_size > 0 ? " paged" : " contiguous");
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << what;
      EXPECT_EQ(0, std::memcmp(got_lse.data(), want_lse.data(), got_lse.size() * sizeof(float))) << what;
    }
  });
}

TEST(MlaDecodeFloat8, EqualScalesGiveTheCombinedPoolsBitsExact) {
  expect_combined_pool_bits<float8_e4m3fn>(Precision::exact);
  expect_combined_pool_bits<float8_e5m2>(Precision::exact);
}

TEST(MlaDecodeFloat8, EqualScalesGiveTheCombinedPoolsBitsOnTheDotUnit) {
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const test::ForcedVdpbf16ps forced;
  expect_combined_pool_bits<float8_e4m3fn>(Precision::fast);
  expect_combined_pool_bits<float8_e5m2>(Precision::fast);
}

TEST(MlaDecodeFloat8, BitwiseEqualForAnyThreadCount) {
  for (Precision precision : {Precision::exact, Precision::fast})
    for (int64_t block : {0, 16}) {
      const Case<float8_e4m3fn> c({2, 3, 16, 64, 16, {700, 1500}, 1504, block}, 17, 0);
      const Case<float8_e4m3fn> listed({2, 3, 16, 64, 16, {700, 1500}, 1504, block}, 18, 300);
      for (const Case<float8_e4m3fn>* cc : {&c, &listed}) test::expect_same_bits_for_any_thread_count(*cc, precision);
    }
}

TEST(MlaDecodeFloat8, BadScalesNameTheArgumentAndWriteNothing) {
  using F = float8_e4m3fn;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  expect_refused<F>([](auto& a, auto&) { a.ckv_scale.reset(); }, "qkv::mla_decode: ckv_scale: a float8 cache needs its scale");
  expect_refused<F>([](auto& a, auto&) { a.kpe_scale.reset(); }, "kpe_scale: a float8 cache needs its scale");
  expect_refused<F>([](auto& a, auto&) { a.ckv_scale = 0.0f; }, "ckv_scale: expected a positive finite scale, got 0");
  expect_refused<F>([](auto& a, auto&) { a.kpe_scale = -1.0f; }, "kpe_scale: expected a positive finite scale, got -1");
  expect_refused<F>([nan](auto& a, auto&) { a.ckv_scale = nan; }, "ckv_scale: expected a positive finite scale");
  expect_refused<F>([inf](auto& a, auto&) { a.kpe_scale = inf; }, "kpe_scale: expected a positive finite scale");
  expect_refused<F>(
      [](auto& a, auto&) {
        a.ckv_scale = 1e-30f;
        a.kpe_scale = 1e30f;
      },
      "kpe_scale: kpe_scale / ckv_scale");
  expect_refused<float>([](auto& a, auto&) { a.ckv_scale = 1.0f; }, "ckv_scale: only float8 caches take scales");
  expect_refused<bfloat16>([](auto& a, auto&) { a.kpe_scale = 1.0f; }, "kpe_scale: only float8 caches take scales");
}

}  // namespace
}  // namespace qkv
