// Rotary embedding + cache append + attention in one call (qkv/rotary.hpp,
// BatchPlan::run_appending, KVCache::append with a Rotary).
//   - apply_rotary is bitwise the textbook rotation x·cos + rotate_half(x)·sin written out
//     here with each product and sum rounded once (what PyTorch's float32 computes): NeoX
//     and interleaved pairs, partial rotary, tables read through positions.
//   - run_appending equals, bit for bit, rotating q and k by hand, writing the new rows
//     into the caches by hand (rounded, or quantized per row as KVCache does) and calling
//     run(BatchArgs): the same caches, scales and outputs, the caller's q untouched. Over
//     float32, bfloat16, float16, int8 and float8 caches, contiguous and shuffled paged,
//     a step mixing decode tokens with a prefill chunk (> 32 queries: the tiled schedule),
//     GQA, dv ≠ d.
//   - KVCache::append with a Rotary stores what an append of keys rotated by hand stores.
//   - Every bad argument is a qkv::Error naming it, with caches, scales and out unchanged.
#include <gtest/gtest.h>

#include <qkv/batch_plan.hpp>
#include <qkv/error.hpp>
#include <qkv/kv_cache.hpp>
#include <qkv/rotary.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
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
using test::Tables;
using test::tables;

bool same_bytes(const void* a, const void* b, std::size_t n) { return std::memcmp(a, b, n) == 0; }

TEST(Rotary, ApplyRotaryIsTheTextbookRotationBitwise) {
  for (const bool interleaved : {false, true})
    for (const int64_t dim : {64, 32, 2}) {
      const int64_t n = 7, heads = 3, d = 64;
      const auto x = test::random_tensor<float, 3>({n, heads, d}, 5, 3.0);
      const Tables t = tables(n, dim, interleaved, 1000);
      Tensor<float, 3> out({n, heads, d}), expect({n, heads, d});
      Rotary rotary{.cos = t.cos.cview(), .sin = t.sin.cview(), .positions = {}, .rotary_dim = 0, .interleaved = interleaved};
      apply_rotary(x.cview(), out.view(), rotary);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t h = 0; h < heads; ++h)
          rotate_by_hand(&x(r, h, 0), &t.cos(r, 0), &t.sin(r, 0), dim, d, interleaved, &expect(r, h, 0));
      EXPECT_TRUE(same_bytes(out.data(), expect.data(), out.size() * 4)) << "interleaved " << interleaved << " dim " << dim;
      // In place gives the same bits.
      Tensor<float, 3> inplace = x;
      apply_rotary(inplace.cview(), inplace.view(), rotary);
      EXPECT_TRUE(same_bytes(inplace.data(), expect.data(), out.size() * 4));
    }
}

TEST(Rotary, PositionsIndexTheTables) {
  const int64_t n = 5, d = 16;
  const auto x = test::random_tensor<float, 3>({n, 2, d}, 9);
  const Tables table = tables(50, d, false);
  const std::vector<int64_t> positions{49, 0, 17, 17, 3};
  Tensor<float, 2> cos({n, d}), sin({n, d});
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) {
      cos(r, c) = table.cos(positions[r], c);
      sin(r, c) = table.sin(positions[r], c);
    }
  Tensor<float, 3> a({n, 2, d}), b({n, 2, d});
  apply_rotary(x.cview(), a.view(), Rotary{.cos = table.cos.cview(), .sin = table.sin.cview(),
                                           .positions = std::span<const int64_t>(positions)});
  apply_rotary(x.cview(), b.view(), Rotary{.cos = cos.cview(), .sin = sin.cview()});
  EXPECT_TRUE(same_bytes(a.data(), b.data(), a.size() * 4));
  // The rotation changed something (the test can fail).
  EXPECT_GT(test::max_abs_diff(a, x), 0.1);
}

// A step: packed q, new k/v, and caches whose old rows are random and whose new rows are
// poisoned (NaN, int8 0 with NaN scales) so that a row not written shows.
template <class T>
struct Step {
  static constexpr bool kScaled = std::is_same_v<T, std::int8_t> || is_float8(storage_type_of<T>);
  std::vector<int64_t> queries{1, 3, 40, 1}, lengths{9, 12, 60, 5}, cu{0};
  int64_t hq = 8, hkv = 2, d = 64, dv = 32, block_size = 0, capacity = 60, max_blocks = 0;
  Tensor<float, 3> q, k_new, v_new, k_scale, v_scale;
  Tensor<T, 4> k, v;
  Tensor<int32_t, 2> table;

  explicit Step(int64_t block) : block_size(block) {
    const auto batch = static_cast<int64_t>(queries.size());
    for (int64_t n : queries) cu.push_back(cu.back() + n);
    q = test::random_tensor<float, 3>({cu.back(), hq, d}, 1);
    k_new = test::random_tensor<float, 3>({cu.back(), hkv, d}, 2);
    v_new = test::random_tensor<float, 3>({cu.back(), hkv, dv}, 3);
    int64_t rows0 = batch, rows1 = capacity;
    if (block_size > 0) {
      max_blocks = (capacity + block_size - 1) / block_size;
      rows0 = batch * max_blocks + 3;
      rows1 = block_size;
      table = test::shuffled_table(batch, max_blocks, rows0, 7);
    }
    k = Tensor<T, 4>({rows0, rows1, hkv, d});
    v = Tensor<T, 4>({rows0, rows1, hkv, dv});
    k_scale = Tensor<float, 3>({rows0, rows1, hkv});
    v_scale = Tensor<float, 3>({rows0, rows1, hkv});
    const auto old_k = test::random_tensor<float, 4>({rows0, rows1, hkv, d}, 4);
    const auto old_v = test::random_tensor<float, 4>({rows0, rows1, hkv, dv}, 5);
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = element(old_k[i] * (kScaled && !is_float8(storage_type_of<T>) ? 40 : 1));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = element(old_v[i] * (kScaled && !is_float8(storage_type_of<T>) ? 40 : 1));
    for (std::size_t i = 0; i < k_scale.size(); ++i) k_scale[i] = v_scale[i] = is_float8(storage_type_of<T>) ? 0.0625f : 0.02f;
    for (int64_t b = 0; b < batch; ++b)  // the new rows: poisoned
      for (int64_t j = lengths[b] - queries[b]; j < lengths[b]; ++j) {
        const auto [r0, r1] = at(b, j);
        for (int64_t h = 0; h < hkv; ++h) {
          for (int64_t c = 0; c < d; ++c) k(r0, r1, h, c) = element(std::nanf(""));
          for (int64_t c = 0; c < dv; ++c) v(r0, r1, h, c) = element(std::nanf(""));
          if (std::is_same_v<T, std::int8_t>) k_scale(r0, r1, h) = v_scale(r0, r1, h) = std::nanf("");
        }
      }
  }

  static T element(float x) {
    if constexpr (std::is_same_v<T, std::int8_t>) return static_cast<T>(std::isnan(x) ? 0.0f : std::clamp(std::nearbyint(x), -127.0f, 127.0f));
    else if constexpr (std::is_same_v<T, float>) return x;
    else return T(x);
  }

  std::pair<int64_t, int64_t> at(int64_t b, int64_t j) const {
    if (block_size == 0) return {b, j};
    return {table(b, j / block_size), j % block_size};
  }

  BatchLayout layout() const {
    BatchLayout l;
    l.cu_seqlens_q = std::span<const int64_t>(cu);
    l.cache_lengths = std::span<const int64_t>(lengths);
    if (block_size > 0) {
      l.block_table = table.cview();
      l.block_size = block_size;
    }
    l.num_heads = hq;
    l.num_kv_heads = hkv;
    l.head_dim = d;
    l.v_dim = dv;
    l.storage = storage_type_of<T>;
    return l;
  }

  // Row x of `count` stored as the appending run stores it, written out independently:
  // int8 scale max|x| / 127 with levels rounded half to even; float8 x / scale.
  void store(const float* x, int64_t count, T* dst, float* scale) const {
    if constexpr (std::is_same_v<T, std::int8_t>) {
      float largest = 0.0f;
      for (int64_t c = 0; c < count; ++c) largest = std::max(largest, std::abs(x[c]));
      *scale = largest / 127.0f;
      for (int64_t c = 0; c < count; ++c) dst[c] = static_cast<T>(std::clamp(std::nearbyint(x[c] / *scale), -127.0f, 127.0f));
    } else if constexpr (is_float8(storage_type_of<T>)) {
      for (int64_t c = 0; c < count; ++c) dst[c] = T(x[c] / *scale);
    } else {
      for (int64_t c = 0; c < count; ++c) dst[c] = element(x[c]);
    }
  }

  BatchAppendArgs<T> appending(Tensor<float, 3>& out, Tensor<float, 2>& lse, const Rotary& rotary) {
    BatchAppendArgs<T> a;
    a.q = q.cview();
    a.k_new = k_new.cview();
    a.v_new = v_new.cview();
    a.rotary = rotary;
    a.k_cache = k.view();
    a.v_cache = v.view();
    a.out = out.view();
    a.lse = lse.view();
    if constexpr (kScaled) {
      a.k_scale = k_scale.view();
      a.v_scale = v_scale.view();
    }
    return a;
  }
};

struct Case {
  bool paged, interleaved, positions;
  int64_t rotary_dim;  // 0: no rotary
};

template <class T>
void check_against_by_hand(const Case& c) {
  SCOPED_TRACE(std::string("paged ") + std::to_string(c.paged) + " interleaved " + std::to_string(c.interleaved) +
               " positions " + std::to_string(c.positions) + " rotary_dim " + std::to_string(c.rotary_dim));
  Step<T> step(c.paged ? 4 : 0);
  const int64_t total = step.cu.back();
  // Per-token tables (each token at its own position in its sequence), or one table
  // [64, r] and the positions.
  std::vector<int64_t> positions;
  for (std::size_t b = 0; b < step.queries.size(); ++b)
    for (int64_t t = 0; t < step.queries[b]; ++t) positions.push_back(step.lengths[b] - step.queries[b] + t);
  const int64_t r = c.rotary_dim;
  const Tables table = tables(64, std::max<int64_t>(r, 2), c.interleaved);
  Tensor<float, 2> cos({total, std::max<int64_t>(r, 2)}), sin({total, std::max<int64_t>(r, 2)});
  for (int64_t n = 0; n < total; ++n)
    for (int64_t i = 0; i < cos.shape()[1]; ++i) {
      cos(n, i) = table.cos(positions[n], i);
      sin(n, i) = table.sin(positions[n], i);
    }
  Rotary rotary;
  if (r > 0) {
    rotary = Rotary{.cos = c.positions ? table.cos.cview() : cos.cview(), .sin = c.positions ? table.sin.cview() : sin.cview(),
                    .positions = {}, .rotary_dim = 0, .interleaved = c.interleaved};
    if (c.positions) rotary.positions = std::span<const int64_t>(positions);
  }

  // By hand: rotate, write, run.
  Step<T> hand = step;
  Tensor<float, 3> q_rot = step.q, k_rot = step.k_new;
  if (r > 0)
    for (int64_t n = 0; n < total; ++n) {
      for (int64_t h = 0; h < step.hq; ++h)
        rotate_by_hand(&step.q(n, h, 0), &cos(n, 0), &sin(n, 0), r, step.d, c.interleaved, &q_rot(n, h, 0));
      for (int64_t h = 0; h < step.hkv; ++h)
        rotate_by_hand(&step.k_new(n, h, 0), &cos(n, 0), &sin(n, 0), r, step.d, c.interleaved, &k_rot(n, h, 0));
    }
  for (std::size_t b = 0; b < step.queries.size(); ++b)
    for (int64_t t = 0; t < step.queries[b]; ++t) {
      const int64_t n = step.cu[b] + t;
      const auto [r0, r1] = hand.at(static_cast<int64_t>(b), step.lengths[b] - step.queries[b] + t);
      for (int64_t h = 0; h < step.hkv; ++h) {
        hand.store(&k_rot(n, h, 0), step.d, &hand.k(r0, r1, h, 0), &hand.k_scale(r0, r1, h));
        hand.store(&step.v_new(n, h, 0), step.dv, &hand.v(r0, r1, h, 0), &hand.v_scale(r0, r1, h));
      }
    }
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  const BatchPlan plan(step.layout(), options);
  Tensor<float, 3> expect_out({total, step.hq, step.dv}), out({total, step.hq, step.dv});
  Tensor<float, 2> expect_lse({step.hq, total}), lse({step.hq, total});
  BatchArgs<T> args;
  args.q = q_rot.cview();
  args.k_cache = hand.k.cview();
  args.v_cache = hand.v.cview();
  args.out = expect_out.view();
  args.lse = expect_lse.view();
  if constexpr (Step<T>::kScaled) {
    args.k_scale = hand.k_scale.cview();
    args.v_scale = hand.v_scale.cview();
  }
  plan.run(args);
  ASSERT_TRUE(test::all_finite(expect_out));  // every new row was written by hand

  const Tensor<float, 3> q_before = step.q;
  plan.run_appending(step.appending(out, lse, rotary));
  EXPECT_TRUE(same_bytes(step.q.data(), q_before.data(), q_before.size() * 4)) << "the caller's q was written";
  EXPECT_TRUE(same_bytes(step.k.data(), hand.k.data(), step.k.size() * sizeof(T))) << "k_cache";
  EXPECT_TRUE(same_bytes(step.v.data(), hand.v.data(), step.v.size() * sizeof(T))) << "v_cache";
  EXPECT_TRUE(same_bytes(step.k_scale.data(), hand.k_scale.data(), step.k_scale.size() * 4)) << "k_scale";
  EXPECT_TRUE(same_bytes(step.v_scale.data(), hand.v_scale.data(), step.v_scale.size() * 4)) << "v_scale";
  EXPECT_TRUE(same_bytes(out.data(), expect_out.data(), out.size() * 4)) << "out";
  EXPECT_TRUE(same_bytes(lse.data(), expect_lse.data(), lse.size() * 4)) << "lse";
}

template <class T>
void check_every_case() {
  for (const bool paged : {false, true}) {
    check_against_by_hand<T>({paged, false, false, 0});  // appending alone, no rotary
    for (const bool interleaved : {false, true})
      for (const bool positions : {false, true})
        for (const int64_t dim : {64, 32}) check_against_by_hand<T>({paged, interleaved, positions, dim});
  }
}

TEST(RotaryAppend, Float32EqualsRotateWriteRun) { check_every_case<float>(); }
TEST(RotaryAppend, Bfloat16EqualsRotateWriteRun) { check_every_case<bfloat16>(); }
TEST(RotaryAppend, Float16EqualsRotateWriteRun) { check_every_case<float16>(); }
TEST(RotaryAppend, Int8EqualsRotateWriteRun) { check_every_case<std::int8_t>(); }
TEST(RotaryAppend, Float8EqualsRotateWriteRun) { check_every_case<float8_e4m3fn>(); }

// Every bad call: a qkv::Error naming the argument, and nothing written.
TEST(RotaryAppend, BadCallsWriteNothing) {
  Step<float> step(4);
  const BatchPlan plan(step.layout(), AttentionOptions{});
  const int64_t total = step.cu.back();
  const Tables per_token = tables(total, 32, false);
  const Tables odd = tables(total, 31, false);
  const Tables wide = tables(total, 66, false);
  const Tables table = tables(30, 32, false);
  const std::vector<int64_t> positions(static_cast<std::size_t>(total), 30);  // one past the table
  const std::vector<int64_t> too_few(3, 0);
  Tensor<float, 3> out({total, step.hq, step.dv});
  Tensor<float, 2> lse({step.hq, total});
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = 7.0f;
  const Tensor<float, 4> k_before = step.k, v_before = step.v;
  const Tensor<float, 3> wrong_k = test::random_tensor<float, 3>({total, step.hkv, 16}, 3);
  const auto call = [&](auto edit, const std::string& needle) {
    Rotary rotary{.cos = per_token.cos.cview(), .sin = per_token.sin.cview()};
    BatchAppendArgs<float> a = step.appending(out, lse, rotary);
    edit(a);
    expect_error([&] { plan.run_appending(a); }, needle);
    EXPECT_TRUE(same_bytes(step.k.data(), k_before.data(), k_before.size() * 4)) << needle;
    EXPECT_TRUE(same_bytes(step.v.data(), v_before.data(), v_before.size() * 4)) << needle;
    for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], 7.0f) << needle;
  };
  using A = BatchAppendArgs<float>;
  call([](A& a) { a.v_new = {}; }, "v_new: expected with k_new");
  call([](A& a) { a.k_new = {}; }, "k_new: expected with v_new");
  call([](A& a) { a.k_new = {}, a.v_new = {}; }, "rotary.cos: only with k_new");
  call([](A& a) { a.k_new = {}, a.v_new = {}, a.rotary = {}; }, "k_new: expected the step's new keys");
  call([&](A& a) { a.k_new = wrong_k.cview(); }, "k_new.shape[2] (head_dim): expected 64");
  call([&](A& a) { a.rotary.sin = {}; }, "rotary.sin: expected with rotary.cos");
  call([&](A& a) { a.rotary.cos = odd.cos.cview(), a.rotary.sin = odd.sin.cview(); }, "expected an even number 2..64");
  call([&](A& a) { a.rotary.cos = wide.cos.cview(), a.rotary.sin = wide.sin.cview(); }, "expected an even number 2..64");
  call([&](A& a) { a.rotary.rotary_dim = 16; }, "rotary.rotary_dim: expected rotary.cos.shape[1] (32");
  call([&](A& a) { a.rotary.cos = table.cos.cview(), a.rotary.sin = table.sin.cview(); },
       "rotary.cos.shape[0] (new tokens): expected 45");
  call([&](A& a) {
    a.rotary.cos = table.cos.cview(), a.rotary.sin = table.sin.cview();
    a.rotary.positions = std::span<const int64_t>(positions);
  }, "rotary.positions[0]: expected a row of the tables, 0..29");
  call([&](A& a) {
    a.rotary.cos = table.cos.cview(), a.rotary.sin = table.sin.cview();
    a.rotary.positions = std::span<const int64_t>(too_few);
  }, "rotary.positions: expected one position per new token (45)");
  call([&](A& a) { a.k_new = View3<const float>(&step.k(0, 0, 0, 0), {total, step.hkv, step.d}, {step.hkv * step.d, step.d, 1}); },
       "k_cache: must not share memory with k_new");
  call([&](A& a) { a.v_cache = step.k.view(); }, "v_cache.shape[3] (head_dim): expected 32");
  // A contiguous cache too short for a sequence's new tokens.
  Step<float> flat(0);
  const BatchPlan flat_plan(flat.layout(), AttentionOptions{});
  Tensor<float, 4> short_k({4, 30, 2, 64}), short_v({4, 30, 2, 32});
  BatchAppendArgs<float> a = flat.appending(out, lse, {});
  a.k_cache = short_k.view();
  a.v_cache = short_v.view();
  expect_error([&] { flat_plan.run_appending(a); }, "k_cache.shape[1] (capacity): expected at least cache_lengths[2] = 60");
  // int8 without the scales it writes.
  Step<std::int8_t> int8(0);
  const BatchPlan int8_plan(int8.layout(), AttentionOptions{});
  BatchAppendArgs<std::int8_t> b = int8.appending(out, lse, {});
  b.k_scale = {};
  expect_error([&] { int8_plan.run_appending(b); }, "k_scale");
  // The plan's storage decides the type.
  expect_error([&] { int8_plan.run_appending(step.appending(out, lse, {})); }, "k_cache: expected int8 elements");
}

// KVCache::append with a Rotary stores exactly what an append of keys rotated by hand
// stores, for every storage (int4 and channel scales through the same append).
TEST(RotaryAppend, KVCacheAppendRotatesTheKeys) {
  for (const StorageType dtype : {StorageType::float32, StorageType::bfloat16, StorageType::int8, StorageType::int4}) {
    SCOPED_TRACE(storage_name(dtype));
    const int64_t batch = 2, tokens = 5, hkv = 2, d = 64;
    KVCacheConfig config{.batch = batch, .capacity = 16, .kv_heads = hkv, .head_dim = d, .dtype = dtype,
                         .paged = true, .block_size = 4,
                         .key_scales = dtype == StorageType::int4 ? KeyScales::channel : KeyScales::row, .group_size = 4};
    KVCache rotated(config), by_hand(config);
    const auto k = test::random_tensor<float, 4>({batch, tokens, hkv, d}, 11);
    const auto v = test::random_tensor<float, 4>({batch, tokens, hkv, d}, 12);
    const Tables t = tables(batch * tokens, 32, true, 3);
    Tensor<float, 4> k_rot = k;
    for (int64_t n = 0; n < batch * tokens; ++n)
      for (int64_t h = 0; h < hkv; ++h)
        rotate_by_hand(&k(n / tokens, n % tokens, h, 0), &t.cos(n, 0), &t.sin(n, 0), 32, d, true,
                       &k_rot(n / tokens, n % tokens, h, 0));
    const Tensor<float, 4> k_before = k;
    rotated.append(k.cview(), v.cview(), Rotary{.cos = t.cos.cview(), .sin = t.sin.cview(), .positions = {},
                                                .rotary_dim = 32, .interleaved = true});
    by_hand.append(k_rot.cview(), v.cview());
    EXPECT_TRUE(same_bytes(k.data(), k_before.data(), k.size() * 4));
    for (int64_t b = 0; b < batch; ++b) {
      const auto [ka, va] = rotated.stored(b);
      const auto [kb, vb] = by_hand.stored(b);
      EXPECT_TRUE(same_bytes(ka.data(), kb.data(), ka.size() * 4));
      EXPECT_TRUE(same_bytes(va.data(), vb.data(), va.size() * 4));
    }
    // A bad table changes nothing.
    const Tables odd = tables(batch * tokens, 3, false);
    expect_error([&] { rotated.append(k.cview(), v.cview(), Rotary{.cos = odd.cos.cview(), .sin = odd.sin.cview()}); },
                 "qkv::KVCache::append: rotary.cos.shape[1] (rotary_dim): expected an even number");
    EXPECT_EQ(rotated.lengths()[0], tokens);
  }
}

}  // namespace
}  // namespace qkv
