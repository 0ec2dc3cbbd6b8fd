// The decode kernel with the inference variants — sliding window, soft-cap, ALiBi,
// sinks — alone and combined, on every cache layout and storage, against the fp64
// reference on the same (rounded) cache; the same bits through attention_forward; bitwise
// identical for any thread count; keys before a window never reach a row; errors.
//
// Tolerance, as test_variants.cpp states for the fused forward with variants:
// 4e-6·max(1, max|ref|) for out and LSE. The kernel sums ≤ 1500 keys in fp32 blocks of 64
// merged by LSE (observed errors 1e-7 to 1e-6 on these O(1) values); a variant applied
// wrongly, or at the wrong key, moves outputs by O(0.01–1).
#include <gtest/gtest.h>

#include <qkv/decode.hpp>
#include <qkv/qkv.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "decode_case.hpp"
#include "simd_targets.hpp"

namespace qkv {
namespace {

using test::DecodeCase;
using test::DecodeSpec;
using test::Outputs;

constexpr double kTolerance = 4e-6;

template <class T>
void expect_near_reference(const DecodeSpec& s) {
  SCOPED_TRACE(s.name + " storage=" + storage_name(s.type) + " block=" + std::to_string(s.block_size));
  const DecodeCase<T> dc(s);
  const Outputs got = test::run_decode(dc, s, s.threads);
  const auto q = test::widen<double>(dc.c.q), k = test::widen<double>(dc.c.k), v = test::widen<double>(dc.c.v);
  Tensor<double, 4> ref_out({s.batch, s.q_len, s.q_heads, s.v_dim});
  Tensor<double, 3> ref_lse({s.batch, s.q_heads, s.q_len});
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = ref_out.view(), .lse = ref_lse.view()},
                    dc.c.options);
  EXPECT_LE(test::error(got.out, ref_out), test::relative_tolerance(kTolerance, ref_out)) << "out";
  EXPECT_LE(test::error(got.lse, ref_lse), test::relative_tolerance(kTolerance, ref_lse)) << "lse";
}

void expect_near_reference_any(const DecodeSpec& s) {
  switch (s.type) {
    case StorageType::float32: return expect_near_reference<float>(s);
    case StorageType::bfloat16: return expect_near_reference<bfloat16>(s);
    case StorageType::float16: return expect_near_reference<float16>(s);
    case StorageType::int8: return expect_near_reference<std::int8_t>(s);
    case StorageType::float8_e4m3fn: return expect_near_reference<float8_e4m3fn>(s);
    case StorageType::float8_e5m2: return expect_near_reference<float8_e5m2>(s);
    case StorageType::int4: ADD_FAILURE() << "int4 has no DecodeArgs (qkv::KVCache only)"; return;
  }
}

std::vector<DecodeSpec> variant_specs() {
  return {
      // Mistral-style decode: one query, a 300-key window over 1500 cached keys, chunks
      // split across threads, most keys skipped.
      {.name = "window_decode", .batch = 2, .q_len = 1, .capacity = 1500, .q_heads = 8, .kv_heads = 2,
       .lengths = {1500, 200}, .threads = 3, .window = {.left = 300, .right = -1}},
      // Chunked prefill under a window with a right bound of 0 (causal by the window too);
      // the short sequence's first queries see nothing.
      {.name = "window_prefill", .batch = 2, .q_len = 5, .capacity = 40, .q_heads = 4, .kv_heads = 2,
       .head_dim = 16, .v_dim = 16, .lengths = {40, 3}, .window = {.left = 7, .right = 0}},
      // No causality, a window on both sides (positions aligned bottom-right).
      {.name = "window_two_sided", .batch = 1, .q_len = 3, .capacity = 90, .q_heads = 2, .kv_heads = 1,
       .head_dim = 32, .v_dim = 32, .causal = Causal::none, .window = {.left = 10, .right = 2}},
      {.name = "window_top_left", .batch = 1, .q_len = 6, .capacity = 30, .q_heads = 2, .kv_heads = 2,
       .head_dim = 8, .v_dim = 8, .lengths = {20}, .causal = Causal::top_left, .window = {.left = 2, .right = -1}},
      // A strong cap (logits of O(1) squeezed into ±0.5), GQA 4.
      {.name = "softcap", .batch = 2, .q_len = 2, .capacity = 300, .q_heads = 4, .kv_heads = 1,
       .lengths = {300, 45}, .softcap = 0.5f},
      {.name = "alibi", .batch = 2, .q_len = 3, .capacity = 500, .q_heads = 4, .kv_heads = 2,
       .lengths = {500, 77}, .alibi = true},
      // Sinks, with rows that see no key at all (they give their weight to the sink).
      {.name = "sinks", .batch = 2, .q_len = 6, .capacity = 20, .q_heads = 2, .kv_heads = 1,
       .head_dim = 16, .v_dim = 16, .lengths = {4, 0}, .sinks = true},
      // gpt-oss / Gemma 2 style: everything at once, GQA 8, two query tiles.
      {.name = "all", .batch = 2, .q_len = 17, .capacity = 1200, .q_heads = 16, .kv_heads = 2,
       .head_dim = 32, .v_dim = 32, .lengths = {1200, 600}, .window = {.left = 128, .right = -1},
       .softcap = 30.0f, .alibi = true, .sinks = true},
  };
}

TEST(DecodeVariants, MatchTheReferenceOnEveryLayoutAndStorage) {
  for (const DecodeSpec& shape : variant_specs())
    for (StorageType type : {StorageType::float32, StorageType::bfloat16, StorageType::float16, StorageType::int8,
                              StorageType::float8_e4m3fn, StorageType::float8_e5m2})
      for (int64_t block : {0, 16, 128}) {
        DecodeSpec s = shape;
        s.type = type;
        s.block_size = block;
        expect_near_reference_any(s);
      }
}

TEST(DecodeVariants, EveryCompiledSimdTargetMatchesTheReference) {
  DecodeSpec s = variant_specs().back();
  s.type = StorageType::bfloat16;
  s.block_size = 16;
  test::for_each_simd_target([&](int64_t) { expect_near_reference_any(s); });
}

TEST(DecodeVariants, BitwiseIdenticalForAnyThreadCount) {
  DecodeSpec s = variant_specs().back();
  s.block_size = 32;
  const DecodeCase<float> dc(s, 11);
  const Outputs first = test::run_decode(dc, s, 1);
  for (int threads : {2, 3, 8}) {
    const Outputs again = test::run_decode(dc, s, threads);
    EXPECT_EQ(std::memcmp(first.out.data(), again.out.data(), first.out.size() * sizeof(float)), 0) << threads;
    EXPECT_EQ(std::memcmp(first.lse.data(), again.lse.data(), first.lse.size() * sizeof(float)), 0) << threads;
  }
}

// attention_forward sends a decode-shaped call with variants to the decode kernel: the
// same bits as qkv::decode on the same float32 tensors.
TEST(DecodeVariants, AttentionForwardRoutesThemToDecode) {
  for (const DecodeSpec& s : variant_specs()) {
    if (s.q_len > 16) continue;  // more queries than a decode tile: the tiled forward
    SCOPED_TRACE(s.name);
    const DecodeCase<float> dc(s);
    const Outputs direct = test::run_decode(dc, s, 2);
    Tensor<float, 4> out({s.batch, s.q_len, s.q_heads, s.v_dim});
    Tensor<float, 3> lse({s.batch, s.q_heads, s.q_len});
    AttentionOptions options = dc.c.options;
    options.causal = s.causal;
    options.execution.backend = Backend::cpu;
    options.execution.threads = 2;
    attention_forward({.q = dc.c.q.cview(), .k = dc.k_cache.cview(), .v = dc.v_cache.cview(),
                       .out = out.view(), .lse = lse.view()},
                      options);
    EXPECT_EQ(std::memcmp(out.data(), direct.out.data(), out.size() * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(lse.data(), direct.lse.data(), lse.size() * sizeof(float)), 0);
  }
}

// Keys before every row's window are never read: NaN there changes no bit of the result.
TEST(DecodeVariants, KeysBeforeTheWindowNeverReachARow) {
  for (int64_t block : {0, 16}) {
    DecodeSpec s = variant_specs().front();  // window 300 over 1500 and 200 keys
    s.block_size = block;
    const DecodeCase<float> clean(s);
    DecodeCase<float> poisoned(s);
    // Sequence 0's single query (position 1499) sees keys 1199..1499.
    for (int64_t j = 0; j < 1199; ++j)
      for (int64_t h = 0; h < s.kv_heads; ++h)
        for (int64_t x = 0; x < s.head_dim; ++x) {
          const int64_t row = block == 0 ? j : j % block;
          const int64_t where = block == 0 ? 0 : poisoned.table(0, j / block);
          poisoned.k_cache(where, row, h, x) = std::nanf("");
          poisoned.v_cache(where, row, h, x) = INFINITY;
        }
    const Outputs a = test::run_decode(clean, s, 2), b = test::run_decode(poisoned, s, 2);
    EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)), 0) << block;
    EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)), 0) << block;
  }
}

// A window bound past any sequence means unbounded (normalized when checked, so the
// kernels' position arithmetic cannot overflow): the same bits as -1.
TEST(DecodeVariants, AHugeWindowBoundIsUnbounded) {
  DecodeSpec s{.name = "huge_bound", .batch = 2, .q_len = 3, .capacity = 300, .q_heads = 4, .kv_heads = 2,
               .lengths = {300, 2}, .causal = Causal::none, .window = {.left = 20, .right = -1}};
  const DecodeCase<float> unbounded(s);
  const Outputs want = test::run_decode(unbounded, s, 2);
  s.window.right = INT64_MAX;
  const DecodeCase<float> huge(s);
  const Outputs got = test::run_decode(huge, s, 2);
  EXPECT_EQ(std::memcmp(want.out.data(), got.out.data(), want.out.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(want.lse.data(), got.lse.data(), want.lse.size() * sizeof(float)), 0);
  s.window = {.left = INT64_MAX, .right = INT64_MAX};  // both sides: plain attention
  s.causal = Causal::bottom_right;
  const DecodeCase<float> both(s);
  DecodeSpec plain = s;
  plain.window = {};
  const DecodeCase<float> reference(plain);
  const Outputs a = test::run_decode(both, s, 2), b = test::run_decode(reference, plain, 2);
  EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)), 0);
}

// A row that sees no key gives all its weight to its sink: out 0, LSE = the sink.
TEST(DecodeVariants, AnEmptyRowWithASinkHasTheSinksLse) {
  const DecodeSpec s{.name = "empty_sink", .batch = 1, .q_len = 2, .capacity = 8, .q_heads = 2, .kv_heads = 1,
                     .head_dim = 4, .v_dim = 4, .lengths = {0}, .sinks = true};
  const DecodeCase<float> dc(s);
  const Outputs r = test::run_decode(dc, s, 1);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 2; ++i) {
      EXPECT_EQ(r.lse(0, h, i), dc.sinks[static_cast<std::size_t>(h)]);
      for (int64_t x = 0; x < 4; ++x) EXPECT_EQ(r.out(0, i, h, x), 0.0f);
    }
}

TEST(DecodeVariants, BadOptionsAreErrorsAndWriteNothing) {
  const DecodeSpec s{.name = "bad", .batch = 1, .q_len = 1, .capacity = 8, .q_heads = 4, .kv_heads = 2,
                     .head_dim = 8, .v_dim = 8};
  const DecodeCase<float> dc(s);
  Tensor<float, 4> out({1, 1, 4, 8});
  Tensor<float, 3> lse({1, 4, 1});
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = 5.0f;
  const std::vector<float> three{0.1f, 0.2f, 0.3f}, with_nan{0.1f, NAN, 0.3f, 0.4f};
  struct Bad {
    std::string needle;
    AttentionOptions options;
  };
  std::vector<Bad> bad(5);
  bad[0] = {"options.sinks: expected one value per query head (4), got 3", {}};
  bad[0].options.sinks = three;
  bad[1] = {"options.alibi_slopes[1]: expected a finite value", {}};
  bad[1].options.alibi_slopes = with_nan;
  bad[2] = {"options.softcap: expected 0 (off) or a finite value > 0", {}};
  bad[2].options.softcap = -1.0f;
  bad[3] = {"options.softcap", {}};
  bad[3].options.softcap = INFINITY;
  bad[4] = {"options.window: expected left and right >= 0, or -1", {}};
  bad[4].options.window = {.left = -2, .right = 0};
  for (const Bad& b : bad) {
    try {
      decode(dc.args(out, lse), b.options);
      ADD_FAILURE() << "no error; expected " << b.needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(b.needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("qkv::decode"), std::string::npos) << e.what();
    }
    for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], 5.0f) << b.needle;
  }
}

}  // namespace
}  // namespace qkv
