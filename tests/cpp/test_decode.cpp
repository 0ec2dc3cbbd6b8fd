// qkv::decode against the fp64 reference backend on the same (rounded) cache values:
// contiguous and paged caches, float32/bfloat16/float16 storage, GQA, 1..17 queries,
// ragged lengths (0 and 1 included), causal alignments, thread counts (bitwise
// identical), every compiled SIMD target, non-finite values behind masks.
//
// Tolerance, as for the fused forward: max |decode − ref64| ≤ 2·max |plain32 − ref64| +
// floor, with plain32 the unfused fp32 loop (plain_fp32.hpp) on the same rounded cache
// and floor = 8·ε₃₂·max(1, max |ref64|).
#include <gtest/gtest.h>

#include <qkv/decode.hpp>
#include <qkv/threads.hpp>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>

#include "cpu/decode_plan.hpp"  // DecodePlan: the split by kv heads
#include "decode_case.hpp"
#include "plain_fp32.hpp"
#include "simd_targets.hpp"

namespace qkv {
namespace {

using test::DecodeCase;
using test::DecodeSpec;
using test::Outputs;
using test::error;
using test::max_abs;
using test::run_decode;
using test::to_storage;

template <class T>
void check_spec(const DecodeSpec& s) {
  SCOPED_TRACE(s.name + " storage=" + storage_name(s.type) + " block=" + std::to_string(s.block_size));
  const DecodeCase<T> dc(s);
  const Outputs got = run_decode(dc, s, s.threads);

  const test::Reference64 ref = test::reference_of(dc, s);
  const Tensor<double, 4>& ref_out = ref.out;
  const Tensor<double, 3>& ref_lse = ref.lse;
  const test::PlainResult plain = test::plain_fp32(dc.c, nullptr);
  const double floor = 8.0 * std::numeric_limits<float>::epsilon() * std::max(1.0, max_abs(ref_out));
  EXPECT_LE(error(got.out, ref_out), 2.0 * error(plain.out, ref_out) + floor)
      << "plain fp32 error " << error(plain.out, ref_out);
  const double lse_floor = 8.0 * std::numeric_limits<float>::epsilon() * std::max(1.0, max_abs(ref_lse));
  EXPECT_LE(error(got.lse, ref_lse), 2.0 * error(plain.lse, ref_lse) + lse_floor)
      << "plain fp32 error " << error(plain.lse, ref_lse);
}

void check_any(const DecodeSpec& s) {
  switch (s.type) {
    case StorageType::float32: return check_spec<float>(s);
    case StorageType::bfloat16: return check_spec<bfloat16>(s);
    case StorageType::float16: return check_spec<float16>(s);
    case StorageType::int8: return check_spec<std::int8_t>(s);
    case StorageType::float8_e4m3fn: return check_spec<float8_e4m3fn>(s);
    case StorageType::float8_e5m2: return check_spec<float8_e5m2>(s);
    case StorageType::int4: ADD_FAILURE() << "int4 has no DecodeArgs (qkv::KVCache only)"; return;
  }
}

std::vector<DecodeSpec> decode_specs() {
  std::vector<DecodeSpec> specs;
  const std::vector<DecodeSpec> shapes{
      {.name = "mha_d64", .batch = 3, .q_len = 1, .capacity = 200, .q_heads = 4, .kv_heads = 4,
       .lengths = {200, 1, 0}},
      {.name = "gqa4_d128", .batch = 2, .q_len = 2, .capacity = 700, .q_heads = 8, .kv_heads = 2,
       .head_dim = 128, .v_dim = 128, .lengths = {700, 333}},
      {.name = "gqa8_q16", .batch = 2, .q_len = 16, .capacity = 150, .q_heads = 16, .kv_heads = 2,
       .head_dim = 32, .v_dim = 32, .lengths = {150, 9}},
      {.name = "q17_two_tiles", .batch = 1, .q_len = 17, .capacity = 90, .q_heads = 2, .kv_heads = 1,
       .head_dim = 16, .v_dim = 16},
      {.name = "odd_dims", .batch = 2, .q_len = 3, .capacity = 77, .q_heads = 3, .kv_heads = 1,
       .head_dim = 59, .v_dim = 13, .lengths = {77, 2}},
      {.name = "d1", .batch = 1, .q_len = 1, .capacity = 5, .q_heads = 1, .kv_heads = 1, .head_dim = 1, .v_dim = 1},
      {.name = "d256_mqa", .batch = 1, .q_len = 4, .capacity = 100, .q_heads = 4, .kv_heads = 1,
       .head_dim = 256, .v_dim = 256, .lengths = {97}},
      {.name = "chunks", .batch = 2, .q_len = 1, .capacity = 2600, .q_heads = 8, .kv_heads = 8,
       .head_dim = 64, .v_dim = 64, .lengths = {2600, 1100}, .threads = 3},
      {.name = "top_left", .batch = 1, .q_len = 5, .capacity = 40, .q_heads = 2, .kv_heads = 2,
       .head_dim = 8, .v_dim = 8, .lengths = {30}, .causal = Causal::top_left},
      {.name = "not_causal", .batch = 2, .q_len = 5, .capacity = 40, .q_heads = 4, .kv_heads = 2,
       .head_dim = 24, .v_dim = 40, .lengths = {3, 40}, .causal = Causal::none},
      // Fewer keys than queries: the first rows see nothing (out 0, lse -inf).
      {.name = "short_sequence", .batch = 2, .q_len = 6, .capacity = 20, .q_heads = 2, .kv_heads = 1,
       .head_dim = 16, .v_dim = 16, .lengths = {4, 0}},
  };
  for (const DecodeSpec& shape : shapes)
    for (StorageType type : {StorageType::float32, StorageType::bfloat16, StorageType::float16, StorageType::int8,
                              StorageType::float8_e4m3fn, StorageType::float8_e5m2})
      for (int64_t block : {0, 16, 128}) {
        DecodeSpec s = shape;
        s.type = type;
        s.block_size = block;
        specs.push_back(s);
      }
  // Odd page sizes: blocks that straddle pages, pages smaller than a vector.
  specs.push_back({.name = "page7", .batch = 2, .q_len = 3, .capacity = 100, .q_heads = 4, .kv_heads = 2,
                   .head_dim = 48, .v_dim = 48, .lengths = {100, 50}, .block_size = 7});
  specs.push_back({.name = "page1_bf16", .batch = 1, .q_len = 1, .capacity = 30, .q_heads = 2, .kv_heads = 1,
                   .head_dim = 16, .v_dim = 16, .type = StorageType::bfloat16, .block_size = 1});
  return specs;
}

TEST(Decode, MatchesTheReferenceOnEveryLayoutAndStorage) {
  for (const DecodeSpec& s : decode_specs()) check_any(s);
}

TEST(Decode, EveryCompiledSimdTargetMatchesTheReference) {
  const std::vector<DecodeSpec> specs{
      {.name = "t_gqa", .batch = 2, .q_len = 2, .capacity = 300, .q_heads = 4, .kv_heads = 2,
       .lengths = {300, 17}, .type = StorageType::bfloat16, .block_size = 16},
      {.name = "t_odd", .batch = 1, .q_len = 3, .capacity = 70, .q_heads = 3, .kv_heads = 3, .head_dim = 37,
       .v_dim = 19, .type = StorageType::float16},
      {.name = "t_f32", .batch = 1, .q_len = 1, .capacity = 1500, .q_heads = 8, .kv_heads = 1,
       .head_dim = 128, .v_dim = 128, .lengths = {1499}},
      // bfloat16 read in place (widened in the kernels' loads), 4 + 2 rows, paged.
      {.name = "t_g6_bf16", .batch = 1, .q_len = 1, .capacity = 500, .q_heads = 6, .kv_heads = 1,
       .type = StorageType::bfloat16, .block_size = 16},
      // int8 rows (converted in the loads, scaled per key), GQA 4, and an odd head size.
      {.name = "t_int8", .batch = 2, .q_len = 2, .capacity = 400, .q_heads = 8, .kv_heads = 2,
       .lengths = {400, 33}, .type = StorageType::int8, .block_size = 16},
      {.name = "t_int8_odd", .batch = 1, .q_len = 1, .capacity = 90, .q_heads = 2, .kv_heads = 1, .head_dim = 37,
       .v_dim = 19, .type = StorageType::int8},
  };
  test::for_each_simd_target([&](int64_t) {
    for (const DecodeSpec& s : specs) check_any(s);
  });
}

template <class T>
void expect_thread_count_invariant(DecodeSpec s) {
  const DecodeCase<T> dc(s, 11);
  const Outputs first = run_decode(dc, s, 1);
  for (int threads : {1, 2, 3, 8}) {
    const Outputs again = run_decode(dc, s, threads);
    EXPECT_EQ(std::memcmp(first.out.data(), again.out.data(), first.out.size() * sizeof(float)), 0)
        << threads << " threads, " << storage_name(s.type);
    EXPECT_EQ(std::memcmp(first.lse.data(), again.lse.data(), first.lse.size() * sizeof(float)), 0)
        << threads << " threads, " << storage_name(s.type);
  }
}

TEST(Decode, BitwiseIdenticalForAnyThreadCount) {
  // Several chunks per sequence (≥ 1024 keys), ragged lengths, a paged pool.
  DecodeSpec s{.name = "det", .batch = 3, .q_len = 2, .capacity = 5000, .q_heads = 8, .kv_heads = 2,
               .lengths = {5000, 1700, 1}, .block_size = 32};
  expect_thread_count_invariant<float>(s);
  s.type = StorageType::bfloat16;
  s.block_size = 0;
  expect_thread_count_invariant<bfloat16>(s);
}

// A call of few chunks (a small model's decode step) is split by kv heads into parts that
// share each chunk's state: every part's rows are its own, so the bits are those of any
// thread count, and with spinning workers (qkv/threads.hpp) such calls do use threads.
TEST(Decode, FewChunksSplitByKvHeadsWithTheSameBits) {
  detail::Extents e{.batch = 1, .q_len = 1, .k_len = 540, .q_heads = 9, .kv_heads = 3, .head_dim = 64, .v_dim = 64};
  detail::MaskRule mask;
  mask.causal = Causal::bottom_right;
  mask.sequences = {.count = 1, .dense_q_len = 1, .dense_k_len = 540};
  const cpu::DecodePlan plan(e, mask, StorageType::float32, 16);
  ASSERT_EQ(plan.units.size(), 1u);
  EXPECT_EQ(plan.units[0].chunks, 2);  // keys [0, 512) and [512, 540)
  EXPECT_EQ(plan.units[0].head_parts, 3);
  ASSERT_EQ(plan.tasks.size(), 6u);
  for (std::size_t t = 0; t < plan.tasks.size(); ++t) {
    EXPECT_EQ(plan.tasks[t].first_kv_head, static_cast<int64_t>(t % 3));
    EXPECT_EQ(plan.tasks[t].end_kv_head, static_cast<int64_t>(t % 3 + 1));
    EXPECT_EQ(plan.tasks[t].state_offset, plan.chunk_task(plan.units[0], static_cast<int64_t>(t / 3)).state_offset);
  }
  EXPECT_EQ(plan.threads(2), 1);  // 830 KB: not worth waking a sleeping worker
  set_idle_workers_spin(true);
  EXPECT_EQ(plan.threads(2), 2);  // worth a spinning one
  // Many sequences: enough tasks, no split.
  e.batch = 8;
  mask.sequences.count = 8;
  const cpu::DecodePlan batch_plan(e, mask, StorageType::float32, 16);
  EXPECT_EQ(batch_plan.tasks.size(), 16u);
  EXPECT_EQ(batch_plan.units[0].head_parts, 1);

  // On every compiled target; fp32, bf16 (widened in the loads) and int8 (VNNI where present).
  test::for_each_simd_target([&](int64_t) {
    for (const DecodeSpec& s : {DecodeSpec{.name = "smollm", .batch = 1, .q_len = 1, .capacity = 540, .q_heads = 9,
                                            .kv_heads = 3},
                                DecodeSpec{.name = "ragged", .batch = 2, .q_len = 3, .capacity = 1500, .q_heads = 8,
                                            .kv_heads = 4, .lengths = {1500, 700}, .block_size = 16}}) {
      check_any(s);
      expect_thread_count_invariant<float>(s);
      DecodeSpec other = s;
      other.type = StorageType::bfloat16;
      check_any(other);
      expect_thread_count_invariant<bfloat16>(other);
      other.type = StorageType::int8;
      check_any(other);
      expect_thread_count_invariant<std::int8_t>(other);
    }
  });
  set_idle_workers_spin(false);
}

// attention_forward picks the decode kernel for few queries (no elementwise mask): same
// bits as a direct decode call on the same float32 tensors.
TEST(Decode, AttentionForwardRoutesSmallQueryCountsToDecode) {
  const DecodeSpec s{.name = "route", .batch = 2, .q_len = 3, .capacity = 600, .q_heads = 8, .kv_heads = 2,
                     .lengths = {600, 250}};
  const DecodeCase<float> dc(s);
  const Outputs direct = run_decode(dc, s, 2);
  Tensor<float, 4> out({s.batch, s.q_len, s.q_heads, s.v_dim});
  Tensor<float, 3> lse({s.batch, s.q_heads, s.q_len});
  AttentionOptions options = dc.c.options;
  options.execution.backend = Backend::cpu;
  options.execution.threads = 2;
  attention_forward({.q = dc.c.q.cview(), .k = dc.k_cache.cview(), .v = dc.v_cache.cview(), .out = out.view(),
                     .lse = lse.view()},
                    options);
  EXPECT_EQ(std::memcmp(out.data(), direct.out.data(), out.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(lse.data(), direct.lse.data(), lse.size() * sizeof(float)), 0);
}

// NaN/Inf in keys/values a row does not see (its causal future within the tile) reach
// no other row; the rows that see them are NaN.
TEST(Decode, NonFiniteBehindTheCausalEdgeStaysThere) {
  for (StorageType type : {StorageType::float32, StorageType::float16}) {
    const DecodeSpec s{.name = "nan", .batch = 1, .q_len = 4, .capacity = 40, .q_heads = 2, .kv_heads = 1,
                       .head_dim = 16, .v_dim = 16, .type = type};
    auto poisoned_run = [&](auto tag) {
      using T = decltype(tag);
      DecodeCase<T> dc(s);
      // Key 38 is seen by queries 2 and 3 only (bottom-right: query i sees j ≤ 36 + i).
      dc.k_cache(0, 38, 0, 3) = to_storage<T>(std::nanf(""));
      dc.v_cache(0, 38, 0, 5) = to_storage<T>(INFINITY);
      const Outputs r = run_decode(dc, s, 2);
      const DecodeCase<T> clean(s);
      const Outputs ok = run_decode(clean, s, 2);
      for (int64_t i = 0; i < 4; ++i)
        for (int64_t h = 0; h < 2; ++h) {
          bool any_nan = false;
          for (int64_t x = 0; x < 16; ++x) any_nan = any_nan || std::isnan(r.out(0, i, h, x));
          EXPECT_EQ(any_nan, i >= 2) << "query " << i << " head " << h;
          if (i >= 2) continue;
          // The exact path sums in another order: a few ulps at most.
          for (int64_t x = 0; x < 16; ++x) EXPECT_NEAR(r.out(0, i, h, x), ok.out(0, i, h, x), 1e-6);
        }
    };
    if (type == StorageType::float32) poisoned_run(float{});
    else poisoned_run(float16{});
  }
}

TEST(Decode, EmptySequencesGiveZeroAndMinusInfinity) {
  const DecodeSpec s{.name = "empty", .batch = 2, .q_len = 2, .capacity = 8, .q_heads = 2, .kv_heads = 1,
                     .head_dim = 4, .v_dim = 4, .lengths = {0, 8}};
  const DecodeCase<float> dc(s);
  const Outputs r = run_decode(dc, s, 2);
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t h = 0; h < 2; ++h) {
      EXPECT_EQ(r.lse(0, h, i), -INFINITY);
      for (int64_t x = 0; x < 4; ++x) EXPECT_EQ(r.out(0, i, h, x), 0.0f);
      EXPECT_TRUE(std::isfinite(r.lse(1, h, i)));
    }
}

// The usual decode step: the queries are their sequences' newest tokens.
AttentionOptions step_options() {
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  return options;
}

TEST(Decode, HugeLogitsStayFinite) {
  DecodeSpec s{.name = "huge", .batch = 1, .q_len = 1, .capacity = 300, .q_heads = 2, .kv_heads = 1,
               .head_dim = 64, .v_dim = 8};
  DecodeCase<float> dc(s);
  for (std::size_t i = 0; i < dc.k_cache.size(); ++i) dc.k_cache[i] *= 200.0f;
  Tensor<float, 4> q = dc.c.q;
  for (std::size_t i = 0; i < q.size(); ++i) q[i] *= 200.0f;  // logits ~ 1e5
  Tensor<float, 4> out({1, 1, 2, 8});
  Tensor<float, 3> lse({1, 2, 1});
  DecodeArgs<float> a = dc.args(out, lse);
  a.q = q.cview();
  decode(a, step_options());
  EXPECT_TRUE(test::all_finite(out));
  EXPECT_TRUE(test::all_finite(lse));
}

// ----------------------------------------------------------------------------------
// Bad calls: a qkv::Error naming the argument, and nothing written.

struct BadCall {
  Tensor<float, 4> q{{2, 1, 4, 8}}, k{{2, 10, 2, 8}}, v{{2, 10, 2, 8}}, out{{2, 1, 4, 8}};
  Tensor<float, 3> lse{{2, 4, 1}};
  std::vector<int64_t> lengths{10, 3};
  Tensor<int32_t, 2> table{{2, 3}};
  DecodeArgs<float> args() {
    return {.q = q.cview(), .k_cache = k.cview(), .v_cache = v.cview(), .cache_lengths = lengths,
            .out = out.view(), .lse = lse.view()};
  }
};

void expect_error(const DecodeArgs<float>& args, const std::string& needle, const Tensor<float, 4>& out,
                  const AttentionOptions& options = step_options()) {
  Tensor<float, 4> before = out;
  try {
    decode(args, options);
    ADD_FAILURE() << "no error; expected one mentioning " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("qkv::decode"), std::string::npos) << e.what();
  }
  EXPECT_EQ(std::memcmp(before.data(), out.data(), out.size() * sizeof(float)), 0) << needle;
}

TEST(DecodeErrors, NameTheArgument) {
  BadCall c;
  test::fill(c.out, 5.0f);
  auto a = c.args();
  a.cache_lengths = std::span<const int64_t>(c.lengths.data(), 1);
  expect_error(a, "cache_lengths: expected one length per sequence (2), got 1", c.out);
  c.lengths = {11, 3};
  expect_error(c.args(), "cache_lengths[0]: expected 0..10", c.out);
  c.lengths = {10, -1};
  expect_error(c.args(), "cache_lengths[1]", c.out);
  c.lengths = {10, 3};

  Tensor<float, 4> q5({2, 1, 5, 8});
  a = c.args();
  a.q = q5.cview();
  expect_error(a, "q.shape[2] (heads): expected a multiple of k_cache.shape[2]", c.out);
  Tensor<float, 4> k7({2, 10, 2, 7});
  a = c.args();
  a.k_cache = k7.cview();
  expect_error(a, "k_cache.shape[3] (head_dim): expected 8", c.out);
  Tensor<float, 4> v9({2, 9, 2, 8});
  a = c.args();
  a.v_cache = v9.cview();
  expect_error(a, "v_cache.shape[1] (capacity): expected 10", c.out);
  Tensor<float, 4> k3({3, 10, 2, 8});
  a = c.args();
  a.k_cache = k3.cview();
  a.v_cache = k3.cview();
  expect_error(a, "k_cache.shape[0] (batch): expected 2", c.out);
  a = c.args();
  a.out.shape[3] = 4;
  expect_error(a, "out.shape[3] (head_dim): expected 8", c.out);
  a = c.args();
  a.lse.shape[1] = 3;
  expect_error(a, "lse.shape[1] (heads): expected 4", c.out);
  a = c.args();
  a.q.strides[3] = 2;
  expect_error(a, "q.strides[3]: expected 1", c.out);
  a = c.args();
  a.out.data = c.q.data();  // aliasing an input
  a.out = View4<float>(c.q.data(), c.out.shape(), a.out.strides);
  expect_error(a, "out: must not share memory with q", c.q);
  a = c.args();
  a.lse = View3<float>(c.out.data(), {2, 4, 1}, {4, 1, 1});
  expect_error(a, "lse: must not share memory with out", c.out);
  a = c.args();
  a.out.strides[2] = 0;
  expect_error(a, "out: an output's elements must not overlap", c.out);

  AttentionOptions bad_scale;
  bad_scale.causal = Causal::bottom_right;
  bad_scale.scale = -1.0;
  expect_error(c.args(), "options.scale: expected a finite value > 0", c.out, bad_scale);
  AttentionOptions bad_threads;
  bad_threads.causal = Causal::bottom_right;
  bad_threads.execution.threads = -2;
  expect_error(c.args(), "threads: expected >= 0", c.out, bad_threads);
  AttentionOptions bad_causal;
  bad_causal.causal = static_cast<Causal>(9);
  expect_error(c.args(), "options.causal", c.out, bad_causal);

  // Paged: the pool is k_cache [blocks, block_size, Hkv, d]; table [B, blocks per sequence].
  Tensor<float, 4> pool({4, 4, 2, 8});
  for (int32_t i = 0; i < 6; ++i) c.table[static_cast<std::size_t>(i)] = i % 4;
  a = c.args();
  a.k_cache = pool.cview();
  a.v_cache = pool.cview();
  a.block_table = c.table.cview();
  c.lengths = {12, 3};
  decode(a, step_options());  // fine: 3 blocks of 4 keys, all in the pool
  c.lengths = {13, 3};
  expect_error(a, "cache_lengths[0]: expected 0..12 (block_table.shape[1] · block_size)", c.out);
  c.lengths = {12, 3};
  c.table(1, 0) = 4;
  expect_error(a, "block_table[1, 0]: expected a pool block 0..3", c.out);
  c.table(1, 0) = 0;
  c.table(1, 1) = -7;  // not used by a sequence of 3 keys: never read, never checked
  decode(a, step_options());
  Tensor<int32_t, 2> table3({3, 3});
  a.block_table = table3.cview();
  expect_error(a, "block_table.shape[0] (batch): expected 2", c.out);
}

}  // namespace
}  // namespace qkv

namespace qkv {
namespace {

// A NaN query poisons its own row only, across several chunks of keys.
TEST(Decode, NanQueryReachesOnlyItsRow) {
  const DecodeSpec s{.name = "nan_q", .batch = 1, .q_len = 2, .capacity = 2100, .q_heads = 4, .kv_heads = 2,
                     .head_dim = 16, .v_dim = 16};
  DecodeCase<float> dc(s);
  dc.c.q(0, 1, 2, 7) = std::nanf("");
  const Outputs r = run_decode(dc, s, 2);
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t h = 0; h < 4; ++h) {
      const bool poisoned = i == 1 && h == 2;
      EXPECT_EQ(std::isnan(r.lse(0, h, i)), poisoned) << i << " " << h;
      for (int64_t x = 0; x < 16; ++x) EXPECT_EQ(std::isnan(r.out(0, i, h, x)), poisoned) << i << " " << h;
    }
}

}  // namespace
}  // namespace qkv

namespace qkv {
namespace {

// Group sizes whose rows do not fill the kernels' 4-row tiles (G = 5, 6, 3 × 5 queries),
// head sizes that are whole vectors (K/V read in place) next to ones that are not
// (packed), several blocks and chunks with a partial last block.
TEST(Decode, RowTileRemaindersMatchTheReference) {
  const std::vector<DecodeSpec> shapes{
      {.name = "g5", .batch = 2, .q_len = 1, .capacity = 1300, .q_heads = 10, .kv_heads = 2,
       .head_dim = 128, .v_dim = 128, .lengths = {1300, 77}},
      {.name = "g6_d64", .batch = 1, .q_len = 1, .capacity = 611, .q_heads = 6, .kv_heads = 1},
      {.name = "g3_q5", .batch = 1, .q_len = 5, .capacity = 333, .q_heads = 6, .kv_heads = 2,
       .head_dim = 32, .v_dim = 64},
      {.name = "g2_d72", .batch = 1, .q_len = 2, .capacity = 150, .q_heads = 4, .kv_heads = 2,
       .head_dim = 72, .v_dim = 72},
  };
  for (const DecodeSpec& shape : shapes)
    for (StorageType type : {StorageType::float32, StorageType::bfloat16})
      for (int64_t block : {0, 16}) {
        DecodeSpec s = shape;
        s.type = type;
        s.block_size = block;
        check_any(s);
      }
}

// The same keys in a [B, N, Hkv, d] cache, PyTorch's [B, Hkv, N, d] buffer (strided view)
// and a paged pool give the same bits: the kernel's arithmetic does not depend on where
// rows live.
TEST(Decode, EveryLayoutGivesTheSameBits) {
  DecodeSpec s{.name = "layouts", .batch = 2, .q_len = 1, .capacity = 900, .q_heads = 8, .kv_heads = 2,
               .lengths = {900, 450}, .type = StorageType::bfloat16};
  const DecodeCase<bfloat16> contiguous(s);
  const Outputs a = run_decode(contiguous, s, 2);

  // Head-major copy of the contiguous cache, read through from_bhsd views.
  const int64_t n = s.capacity, hkv = s.kv_heads, d = s.head_dim;
  Tensor<bfloat16, 4> k_bhsd({s.batch, hkv, n, d}), v_bhsd({s.batch, hkv, n, d});
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t x = 0; x < d; ++x) {
          k_bhsd(b, h, j, x) = contiguous.k_cache(b, j, h, x);
          v_bhsd(b, h, j, x) = contiguous.v_cache(b, j, h, x);
        }
  Outputs b{Tensor<float, 4>({s.batch, 1, s.q_heads, d}), Tensor<float, 3>({s.batch, s.q_heads, 1})};
  DecodeArgs<bfloat16> args = contiguous.args(b.out, b.lse);
  args.k_cache = TensorView<const bfloat16, 4>::from_bhsd(k_bhsd.data(), s.batch, hkv, n, d);
  args.v_cache = TensorView<const bfloat16, 4>::from_bhsd(v_bhsd.data(), s.batch, hkv, n, d);
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  options.execution.threads = 2;
  decode(args, options);
  EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)), 0);

  s.block_size = 16;
  const Outputs c = run_decode(DecodeCase<bfloat16>(s), s, 2);
  EXPECT_EQ(std::memcmp(a.out.data(), c.out.data(), a.out.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(a.lse.data(), c.lse.data(), a.lse.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace qkv
