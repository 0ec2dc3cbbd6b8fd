// BatchPlan::run_appending for latent attention's caches (qkv/batch_plan.hpp, "Keys in two
// parts" and "FlashMLA's FP8 records"): a serving step's new latent rows and rotary keys
// rotated, written and attended in one call, as FlashInfer's append_paged_mla_kv_cache
// followed by its MLA run.
//   - Two pools (c_kv [.., Hkv, dc], k_pe [.., Hkv, dr]; float32, bfloat16, float16):
//     bitwise equal to rotating q's last dr channels and k_rope_new by the textbook
//     rotation (rotary_by_hand.hpp), writing the rows by hand and calling run(BatchArgs)
//     with k_rope_cache — caches, out, lse, and the caller's q untouched. Values the
//     latent rows themselves (v_cache the view of k_cache, no v_new) or a pool of their
//     own; contiguous and shuffled paged; decode tokens with a 40-query prefill chunk
//     (the tiled schedule); NeoX, pairs and partial rotary; one and two kv heads.
//   - FlashMLA's FP8 records: bitwise equal to rotating by hand, qkv::pack_mla_records
//     of each new row stored by hand, and run(BatchRecordArgs); both kinds of scale, key
//     lists, contiguous and paged.
//   - Bad calls: a qkv::Error naming the argument, and nothing written.
#include <gtest/gtest.h>

#include <qkv/batch_plan.hpp>
#include <qkv/error.hpp>
#include <qkv/mla.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "batch_layout.hpp"
#include "rotary_by_hand.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

using test::expect_error;
using test::rotate_by_hand;

bool same_bytes(const void* a, const void* b, std::size_t n) { return std::memcmp(a, b, n) == 0; }

// A step's sequences: decode tokens, a speculative step, a 40-query prefill chunk.
struct Sequences {
  std::vector<int64_t> queries{1, 3, 40, 1}, lengths{9, 12, 60, 5}, cu{0};
  int64_t block_size = 0, max_blocks = 0, rows0 = 0, rows1 = 0;
  Tensor<int32_t, 2> table;

  explicit Sequences(int64_t block) : block_size(block) {
    for (int64_t n : queries) cu.push_back(cu.back() + n);
    const auto batch = static_cast<int64_t>(queries.size());
    const int64_t capacity = 60;
    rows0 = batch;
    rows1 = capacity;
    if (block_size > 0) {
      max_blocks = (capacity + block_size - 1) / block_size;
      rows0 = batch * max_blocks + 3;
      rows1 = block_size;
      table = test::shuffled_table(batch, max_blocks, rows0, 7);
    }
  }
  int64_t total() const { return cu.back(); }
  // The slot (pool block, row) or (sequence, key) of sequence b's key j.
  std::pair<int64_t, int64_t> at(int64_t b, int64_t j) const {
    if (block_size == 0) return {b, j};
    return {table(b, j / block_size), j % block_size};
  }
  // Calls f(packed row n, slot) for every new token.
  template <class F>
  void each_new(F f) const {
    for (std::size_t b = 0; b < queries.size(); ++b)
      for (int64_t t = 0; t < queries[b]; ++t) {
        const auto [r0, r1] = at(static_cast<int64_t>(b), lengths[b] - queries[b] + t);
        f(cu[b] + t, r0, r1);
      }
  }
};

// Per-token tables (token n at its position in its sequence) of width r, or none (r 0).
struct TokenTables {
  Tensor<float, 2> cos, sin;
  Rotary rotary;
  TokenTables(const Sequences& s, int64_t r, bool interleaved) {
    if (r == 0) return;
    const test::Tables table = test::tables(64, r, interleaved);
    cos = Tensor<float, 2>({s.total(), r});
    sin = Tensor<float, 2>({s.total(), r});
    for (std::size_t b = 0; b < s.queries.size(); ++b)
      for (int64_t t = 0; t < s.queries[b]; ++t)
        for (int64_t c = 0; c < r; ++c) {
          cos(s.cu[b] + t, c) = table.cos(s.lengths[b] - s.queries[b] + t, c);
          sin(s.cu[b] + t, c) = table.sin(s.lengths[b] - s.queries[b] + t, c);
        }
    rotary = Rotary{.cos = cos.cview(), .sin = sin.cview(), .positions = {}, .rotary_dim = 0, .interleaved = interleaved};
  }
  // q [n, H, dc + dr] with its last dr channels rotated by hand (q_nope as it is).
  Tensor<float, 3> rotated_queries(const Tensor<float, 3>& q, int64_t dc) const {
    Tensor<float, 3> out = q;
    const int64_t dr = q.shape()[2] - dc;
    if (!rotary.empty())
      for (int64_t n = 0; n < q.shape()[0]; ++n)
        for (int64_t h = 0; h < q.shape()[1]; ++h)
          rotate_by_hand(&q(n, h, dc), &cos(n, 0), &sin(n, 0), cos.shape()[1], dr, rotary.interleaved, &out(n, h, dc));
    return out;
  }
  void rotate_row(int64_t n, const float* x, int64_t dr, float* out) const {
    if (rotary.empty()) std::copy(x, x + dr, out);
    else rotate_by_hand(x, &cos(n, 0), &sin(n, 0), cos.shape()[1], dr, rotary.interleaved, out);
  }
};

AttentionOptions options() {
  AttentionOptions o;
  o.causal = Causal::bottom_right;
  o.scale = 0.15;
  return o;
}

// ---- two pools ----

struct PoolCase {
  bool paged, latent, interleaved;
  int64_t rotary_dim, kv_heads;
};

template <class T>
void check_two_pools(const PoolCase& c) {
  SCOPED_TRACE(std::string("paged ") + std::to_string(c.paged) + " latent " + std::to_string(c.latent) +
               " interleaved " + std::to_string(c.interleaved) + " rotary_dim " + std::to_string(c.rotary_dim) +
               " kv heads " + std::to_string(c.kv_heads));
  const Sequences s(c.paged ? 4 : 0);
  const int64_t hq = 8, hkv = c.kv_heads, dc = 32, dr = 16, d = dc + dr, dv = c.latent ? dc : 24, n = s.total();
  const auto q = test::random_tensor<float, 3>({n, hq, d}, 1);
  const auto k_new = test::random_tensor<float, 3>({n, hkv, dc}, 2);
  const auto rope_new = test::random_tensor<float, 3>({n, hkv, dr}, 3);
  const auto v_new = test::random_tensor<float, 3>({n, hkv, dv}, 4);
  // Old rows random, the new tokens' slots NaN: a slot not written shows in out.
  const auto fill = [&](Tensor<T, 4>& pool, std::uint64_t seed) {
    const auto x = test::random_tensor<float, 4>(pool.shape(), seed);
    for (std::size_t i = 0; i < pool.size(); ++i) pool[i] = T(x[i]);
    s.each_new([&](int64_t, int64_t r0, int64_t r1) {
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t ch = 0; ch < pool.shape()[3]; ++ch) pool(r0, r1, h, ch) = T(std::nanf(""));
    });
  };
  Tensor<T, 4> k({s.rows0, s.rows1, hkv, dc}), rope({s.rows0, s.rows1, hkv, dr}), v({s.rows0, s.rows1, hkv, dv});
  fill(k, 5);
  fill(rope, 6);
  fill(v, 7);
  const TokenTables tables(s, c.rotary_dim, c.interleaved);

  // By hand: rotate, write, run.
  Tensor<T, 4> hand_k = k, hand_rope = rope, hand_v = v;
  std::vector<float> row(static_cast<std::size_t>(dr));
  s.each_new([&](int64_t r, int64_t r0, int64_t r1) {
    for (int64_t h = 0; h < hkv; ++h) {
      for (int64_t ch = 0; ch < dc; ++ch) hand_k(r0, r1, h, ch) = T(k_new(r, h, ch));
      tables.rotate_row(r, &rope_new(r, h, 0), dr, row.data());
      for (int64_t ch = 0; ch < dr; ++ch) hand_rope(r0, r1, h, ch) = T(row[static_cast<std::size_t>(ch)]);
      if (!c.latent)
        for (int64_t ch = 0; ch < dv; ++ch) hand_v(r0, r1, h, ch) = T(v_new(r, h, ch));
    }
  });
  const BatchPlan plan(test::batch_layout(s.cu, s.lengths, s.table, s.block_size,
                                          {.heads = hq, .kv_heads = hkv, .head_dim = d, .v_dim = dv}, storage_type_of<T>),
                       options());
  const Tensor<float, 3> q_rot = tables.rotated_queries(q, dc);
  Tensor<float, 3> expect_out({n, hq, dv}), out({n, hq, dv});
  Tensor<float, 2> expect_lse({hq, n}), lse({hq, n});
  BatchArgs<T> by_hand;
  by_hand.q = q_rot.cview();
  by_hand.k_cache = hand_k.cview();
  by_hand.v_cache = c.latent ? View4<const T>(hand_k.data(), {s.rows0, s.rows1, hkv, dv}, hand_k.cview().strides)
                             : hand_v.cview();
  by_hand.k_rope_cache = hand_rope.cview();
  by_hand.out = expect_out.view();
  by_hand.lse = expect_lse.view();
  plan.run(by_hand);
  ASSERT_TRUE(test::all_finite(expect_out));  // every new slot was written by hand

  const Tensor<float, 3> q_before = q;
  BatchAppendArgs<T> a;
  a.q = q.cview();
  a.k_new = k_new.cview();
  if (!c.latent) a.v_new = v_new.cview();
  a.k_rope_new = rope_new.cview();
  a.rotary = tables.rotary;
  a.k_cache = k.view();
  a.v_cache = c.latent ? View4<T>(k.data(), {s.rows0, s.rows1, hkv, dv}, k.view().strides) : v.view();
  a.k_rope_cache = rope.view();
  a.out = out.view();
  a.lse = lse.view();
  plan.run_appending(a);
  EXPECT_TRUE(same_bytes(q.data(), q_before.data(), q.size() * 4)) << "the caller's q was written";
  EXPECT_TRUE(same_bytes(k.data(), hand_k.data(), k.size() * sizeof(T))) << "k_cache";
  EXPECT_TRUE(same_bytes(rope.data(), hand_rope.data(), rope.size() * sizeof(T))) << "k_rope_cache";
  EXPECT_TRUE(same_bytes(v.data(), hand_v.data(), v.size() * sizeof(T))) << "v_cache";
  EXPECT_TRUE(same_bytes(out.data(), expect_out.data(), out.size() * 4)) << "out";
  EXPECT_TRUE(same_bytes(lse.data(), expect_lse.data(), lse.size() * 4)) << "lse";
  if (c.rotary_dim > 0) {
    EXPECT_GT(test::max_abs_diff(q_rot, q), 0.1);  // the rotation did something
  }
}

template <class T>
void check_every_pool_case() {
  for (const bool paged : {false, true})
    for (const bool latent : {true, false}) {
      check_two_pools<T>({paged, latent, false, 0, 1});
      check_two_pools<T>({paged, latent, false, 16, 1});
      check_two_pools<T>({paged, latent, true, 16, 2});
      check_two_pools<T>({paged, latent, false, 8, 2});  // partial: the first 8 of the 16 rotary channels
    }
}

TEST(LatentAppend, TwoPoolsFloat32EqualRotateWriteRun) { check_every_pool_case<float>(); }
TEST(LatentAppend, TwoPoolsBfloat16EqualRotateWriteRun) { check_every_pool_case<bfloat16>(); }
TEST(LatentAppend, TwoPoolsFloat16EqualRotateWriteRun) { check_every_pool_case<float16>(); }

// ---- FlashMLA's FP8 records ----

struct RecordCase {
  bool paged;
  int64_t rotary_dim;
  RecordScales scales;
  int64_t topk;  // > 0: key lists
};

void check_records(const RecordCase& c) {
  SCOPED_TRACE(std::string("paged ") + std::to_string(c.paged) + " rotary_dim " + std::to_string(c.rotary_dim) +
               " amax " + std::to_string(c.scales == RecordScales::amax) + " topk " + std::to_string(c.topk));
  const Sequences s(c.paged ? 8 : 0);
  const int64_t hq = 8, dc = 128, dr = 16, d = dc + dr, n = s.total(), bytes = mla_record_bytes(dc, dr);
  const auto q = test::random_tensor<float, 3>({n, hq, d}, 11);
  const auto k_new = test::random_tensor<float, 2>({n, dc}, 12);
  const auto k_rope_new = test::random_tensor<float, 2>({n, dr}, 13);
  // Old records packed from random rows; the new tokens' slots 0xFF (NaN values and scales).
  std::vector<std::uint8_t> pool(static_cast<std::size_t>(s.rows0 * s.rows1 * bytes));
  {
    const int64_t slots = s.rows0 * s.rows1;
    const auto c_kv = test::random_tensor<float, 2>({slots, dc}, 14);
    const auto k_pe = test::random_tensor<float, 2>({slots, dr}, 15);
    pack_mla_records(c_kv.cview(), k_pe.cview(), TensorView<std::uint8_t, 2>::contiguous(pool.data(), {slots, bytes}),
                     c.scales);
    s.each_new([&](int64_t, int64_t r0, int64_t r1) {
      std::memset(pool.data() + (r0 * s.rows1 + r1) * bytes, 0xFF, static_cast<std::size_t>(bytes));
    });
  }
  std::vector<int64_t> lists;
  std::mt19937_64 rng(21);
  for (std::size_t b = 0; b < s.queries.size(); ++b)
    for (int64_t t = 0; t < s.queries[b] * c.topk; ++t)
      lists.push_back(rng() % 5 == 0 ? -1 : static_cast<int64_t>(rng() % static_cast<std::uint64_t>(s.lengths[b])));
  const KeyIndices indices =
      c.topk > 0 ? KeyIndices(TensorView<const int64_t, 2>::contiguous(lists.data(), {n, c.topk})) : KeyIndices{};
  const TokenTables tables(s, c.rotary_dim, false);

  // By hand: rotate, pack, store, run.
  std::vector<std::uint8_t> hand = pool, record(static_cast<std::size_t>(bytes));
  std::vector<float> row(static_cast<std::size_t>(dr));
  s.each_new([&](int64_t r, int64_t r0, int64_t r1) {
    tables.rotate_row(r, &k_rope_new(r, 0), dr, row.data());
    pack_mla_records(TensorView<const float, 2>(&k_new(r, 0), {1, dc}, {dc, 1}),
                     TensorView<const float, 2>(row.data(), {1, dr}, {dr, 1}),
                     TensorView<std::uint8_t, 2>(record.data(), {1, bytes}, {bytes, 1}), c.scales);
    std::memcpy(hand.data() + (r0 * s.rows1 + r1) * bytes, record.data(), static_cast<std::size_t>(bytes));
  });
  const BatchPlan plan(test::batch_layout(s.cu, s.lengths, s.table, s.block_size,
                                          {.heads = hq, .kv_heads = 1, .head_dim = d, .v_dim = dc},
                                          StorageType::float8_e4m3fn),
                       options());
  const Tensor<float, 3> q_rot = tables.rotated_queries(q, dc);
  Tensor<float, 3> expect_out({n, hq, dc}), out({n, hq, dc});
  Tensor<float, 2> expect_lse({hq, n}), lse({hq, n});
  plan.run(BatchRecordArgs{.q = q_rot.cview(),
                           .records = View3<const std::uint8_t>::contiguous(hand.data(), {s.rows0, s.rows1, bytes}),
                           .out = expect_out.view(), .lse = expect_lse.view(), .indices = indices});
  ASSERT_TRUE(test::all_finite(expect_out));

  const Tensor<float, 3> q_before = q;
  plan.run_appending(BatchRecordAppendArgs{
      .q = q.cview(), .k_new = k_new.cview(), .k_rope_new = k_rope_new.cview(), .rotary = tables.rotary,
      .records = View3<std::uint8_t>::contiguous(pool.data(), {s.rows0, s.rows1, bytes}), .out = out.view(),
      .lse = lse.view(), .indices = indices, .scales = c.scales});
  EXPECT_TRUE(same_bytes(q.data(), q_before.data(), q.size() * 4)) << "the caller's q was written";
  EXPECT_TRUE(same_bytes(pool.data(), hand.data(), pool.size())) << "records";
  EXPECT_TRUE(same_bytes(out.data(), expect_out.data(), out.size() * 4)) << "out";
  EXPECT_TRUE(same_bytes(lse.data(), expect_lse.data(), lse.size() * 4)) << "lse";
}

TEST(LatentAppend, RecordsEqualRotatePackWriteRun) {
  for (const bool paged : {false, true}) {
    check_records({paged, 0, RecordScales::power_of_two, 0});
    check_records({paged, 16, RecordScales::power_of_two, 0});
    check_records({paged, 16, RecordScales::amax, 0});
    check_records({paged, 8, RecordScales::power_of_two, 6});
  }
}

// ---- bad calls ----

TEST(LatentAppend, BadTwoPoolCallsWriteNothing) {
  const Sequences s(4);
  const int64_t hq = 4, dc = 32, dr = 16, d = dc + dr, n = s.total();
  const auto q = test::random_tensor<float, 3>({n, hq, d}, 1);
  const auto k_new = test::random_tensor<float, 3>({n, 1, dc}, 2);
  const auto rope_new = test::random_tensor<float, 3>({n, 1, dr}, 3);
  const auto v_new = test::random_tensor<float, 3>({n, 1, dc}, 4);
  const auto wide_rope = test::random_tensor<float, 3>({n, 1, dr + 2}, 3);
  auto k = test::random_tensor<float, 4>({s.rows0, s.rows1, 1, dc}, 5);
  auto rope = test::random_tensor<float, 4>({s.rows0, s.rows1, 1, dr}, 6);
  const Tensor<float, 4> k_before = k, rope_before = rope;
  const TokenTables per_token(s, dr, false), too_wide(s, dr + 4, false);
  const BatchPlan plan(test::batch_layout(s.cu, s.lengths, s.table, s.block_size,
                                          {.heads = hq, .kv_heads = 1, .head_dim = d, .v_dim = dc}, StorageType::float32),
                       options());
  Tensor<float, 3> out({n, hq, dc});
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = 7.0f;
  const auto call = [&](auto edit, const std::string& needle) {
    BatchAppendArgs<float> a;
    a.q = q.cview();
    a.k_new = k_new.cview();
    a.k_rope_new = rope_new.cview();
    a.rotary = per_token.rotary;
    a.k_cache = k.view();
    a.v_cache = k.view();
    a.k_rope_cache = rope.view();
    a.out = out.view();
    edit(a);
    expect_error([&] { plan.run_appending(a); }, needle);
    EXPECT_TRUE(same_bytes(k.data(), k_before.data(), k.size() * 4)) << needle;
    EXPECT_TRUE(same_bytes(rope.data(), rope_before.data(), rope.size() * 4)) << needle;
    for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], 7.0f) << needle;
  };
  using A = BatchAppendArgs<float>;
  call([&](A& a) { a.v_new = v_new.cview(); }, "v_new: not with v_cache the view of k_cache");
  call([](A& a) { a.k_rope_new = {}; }, "k_rope_new: expected with k_rope_cache");
  call([](A& a) { a.k_new = {}; }, "rotary.cos: only with k_new");
  call([](A& a) { a.k_new = {}, a.rotary = {}; }, "k_new: expected the step's new keys");
  call([&](A& a) { a.k_rope_cache = {}; }, "k_rope_new: only with k_rope_cache");
  call([&](A& a) { a.k_rope_new = wide_rope.cview(); }, "k_rope_new.shape[2] (dr): expected 16");
  call([&](A& a) { a.k_new = rope_new.cview(); }, "k_new.shape[2] (head_dim - dr): expected 32");
  call([&](A& a) { a.rotary = too_wide.rotary; }, "expected an even number 2..16 (dr, the keys' rotary part");
  call([&](A& a) { a.k_rope_new = View3<const float>(&rope(0, 0, 0, 0), {n, 1, dr}, {dr, dr, 1}); },
       "k_rope_cache: must not share memory with k_rope_new");
  call([&](A& a) { a.k_rope_cache = View4<float>(&k(0, 0, 0, 0), {s.rows0, s.rows1, 1, dr}, k.view().strides); },
       "must not share memory with");
  // A separate value pool without v_new.
  Tensor<float, 4> v({s.rows0, s.rows1, 1, dc});
  call([&](A& a) { a.v_cache = v.view(); }, "v_new: expected with k_new");
  // int8 caches cannot be two pools (run()'s refusal, before anything is written).
  const BatchPlan int8_plan(test::batch_layout(s.cu, s.lengths, s.table, s.block_size,
                                               {.heads = hq, .kv_heads = 1, .head_dim = d, .v_dim = dc}, StorageType::int8),
                            options());
  Tensor<std::int8_t, 4> k8({s.rows0, s.rows1, 1, dc}), rope8({s.rows0, s.rows1, 1, dr});
  Tensor<float, 3> scales({s.rows0, s.rows1, 1});
  BatchAppendArgs<std::int8_t> b;
  b.q = q.cview();
  b.k_new = k_new.cview();
  b.k_rope_new = rope_new.cview();
  b.k_cache = k8.view();
  b.v_cache = k8.view();
  b.k_rope_cache = rope8.view();
  b.k_scale = scales.view();
  b.v_scale = scales.view();
  b.out = out.view();
  expect_error([&] { int8_plan.run_appending(b); }, "k_rope_cache: not with int8 caches");
}

TEST(LatentAppend, BadRecordCallsWriteNothing) {
  const Sequences s(8);
  const int64_t hq = 4, dc = 128, dr = 16, d = dc + dr, n = s.total(), bytes = mla_record_bytes(dc, dr);
  const auto q = test::random_tensor<float, 3>({n, hq, d}, 1);
  auto k_new = test::random_tensor<float, 2>({n, dc}, 2);
  const auto k_rope_new = test::random_tensor<float, 2>({n, dr}, 3);
  std::vector<std::uint8_t> pool(static_cast<std::size_t>(s.rows0 * s.rows1 * bytes), 0x11);
  const std::vector<std::uint8_t> before = pool;
  const TokenTables per_token(s, dr, false), too_wide(s, dr + 2, false);
  std::vector<int64_t> bad_lists(static_cast<std::size_t>(n * 2), 0);
  bad_lists.at(5) = 9999;  // sequence 1's first row: past its 12 keys
  const BatchPlan plan(test::batch_layout(s.cu, s.lengths, s.table, s.block_size,
                                          {.heads = hq, .kv_heads = 1, .head_dim = d, .v_dim = dc},
                                          StorageType::float8_e4m3fn),
                       options());
  Tensor<float, 3> out({n, hq, dc});
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = 7.0f;
  const auto call = [&](auto edit, const std::string& needle) {
    BatchRecordAppendArgs a{.q = q.cview(), .k_new = k_new.cview(), .k_rope_new = k_rope_new.cview(),
                            .rotary = per_token.rotary,
                            .records = View3<std::uint8_t>::contiguous(pool.data(), {s.rows0, s.rows1, bytes}),
                            .out = out.view()};
    edit(a);
    expect_error([&] { plan.run_appending(a); }, needle);
    EXPECT_TRUE(same_bytes(pool.data(), before.data(), pool.size())) << needle;
    for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], 7.0f) << needle;
  };
  using A = BatchRecordAppendArgs;
  call([&](A& a) { a.k_new = TensorView<const float, 2>(&k_new(0, 0), {n, 64}, {dc, 1}); },
       "k_new.shape[1] (dc): expected 128");
  call([&](A& a) { a.k_rope_new = {}; }, "k_rope_new.shape[0] (total_q): expected 45");
  call([&](A& a) { a.rotary = too_wide.rotary; }, "expected an even number 2..16 (dr, the keys' rotary part");
  call([&](A& a) {
    a.indices = KeyIndices(TensorView<const int64_t, 2>::contiguous(bad_lists.data(), {n, 2}));
  }, "indices");
  call([&](A& a) { a.records = View3<std::uint8_t>::contiguous(pool.data(), {s.rows0, s.rows1, bytes - 2}); },
       "records.shape[2] (record bytes)");
  call([&](A& a) {
    a.k_new = TensorView<const float, 2>(reinterpret_cast<const float*>(pool.data()), {n, dc}, {dc, 1});
  }, "records: must not share memory with k_new");
  k_new(3, 5) = std::numeric_limits<float>::infinity();
  call([](A&) {}, "k_new[3, 5]: expected a finite value");
}

}  // namespace
}  // namespace qkv
