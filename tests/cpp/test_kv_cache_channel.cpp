// qkv::KVCache with int8 keys quantized per channel (KeyScales::channel: a scale and a
// zero point per channel and group of tokens): every stored key within half a step of
// the appended one; the stored cache independent of how tokens
// were split into appends; paged = contiguous bitwise; decode on every SIMD target equal
// to the fp64 reference over the stored values (and the same bits for any thread count);
// a non-finite key poisons only itself; BatchPlan reads the same cache; bad configs and
// arguments named.
#include <gtest/gtest.h>

#include <qkv/batch_plan.hpp>
#include <qkv/kv_cache.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "cache_test_support.hpp"
#include "simd_targets.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

constexpr int64_t kBatch = 2, kCapacity = 96, kKvHeads = 2;

KVCacheConfig channel_config(int64_t d, int64_t group, bool paged = false, int64_t block_size = 32) {
  return {.batch = kBatch, .capacity = kCapacity, .kv_heads = kKvHeads, .head_dim = d, .v_dim = d,
          .dtype = StorageType::int8, .paged = paged, .block_size = block_size,
          .key_scales = KeyScales::channel, .group_size = group};
}

// Keys with outlier channels (cache_test_support.hpp) for this file's caches.
Tensor<float, 4> outlier_keys(int64_t tokens, int64_t d, std::uint64_t seed) {
  return test::outlier_keys(kBatch, tokens, kKvHeads, d, seed);
}

using test::append_range;

// Key (b, j, h) as the cache stores it: its integers, row scale, channel scales and zero
// points; value(c) = row_scale · (ints[c] · channel[c] + zero[c]), in double.
struct StoredKey {
  const std::int8_t* ints;
  float row_scale;
  const float* channel;
  const float* zero;

  double value(int64_t c) const { return double(row_scale) * (double(ints[c]) * channel[c] + zero[c]); }
};

StoredKey stored_key(const KVCache& cache, int64_t b, int64_t j, int64_t h) {
  const KVCacheConfig& c = cache.config();
  int64_t outer = b, row = j;  // contiguous: [B, capacity]
  if (c.paged) {
    outer = cache.block_table()[static_cast<std::size_t>(b * cache.blocks_per_sequence() + j / c.block_size)];
    row = j % c.block_size;
  }
  const int64_t rows = cache.k_shape()[1], groups = cache.k_channel_shape()[1];
  const int64_t at = (outer * rows + row) * c.kv_heads + h;
  const int64_t channel_at = ((outer * groups + row / c.group_size) * c.kv_heads + h) * c.head_dim;
  return {static_cast<const std::int8_t*>(cache.k_data()) + at * c.head_dim, cache.k_scales()[static_cast<std::size_t>(at)],
          cache.k_channel_scales().data() + channel_at, cache.k_channel_zeros().data() + channel_at};
}

// Each value within half a step (its channel scale; the row scale is 1) of the appended
// one, up to the rounding of the float zero point; per group and channel, scale = (max −
// min) / 255 and zero = min + 128·scale, so the group's smallest key is −128 and its
// largest 127.
TEST(KVCacheChannel, EveryKeyIsWithinHalfAStep) {
  const int64_t d = 64, group = 16, tokens = 61;
  const auto k = outlier_keys(tokens, d, 11);
  const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 12);
  KVCache cache(channel_config(d, group));
  for (auto [from, to] : {std::pair<int64_t, int64_t>{0, 7}, {7, 8}, {8, 40}, {40, 61}}) append_range(cache, k, v, from, to);
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t h = 0; h < kKvHeads; ++h)
      for (int64_t j = 0; j < tokens; ++j) {
        const StoredKey s = stored_key(cache, b, j, h);
        ASSERT_EQ(s.row_scale, 1.0f);
        const double eps = std::numeric_limits<float>::epsilon();
        for (int64_t c = 0; c < d; ++c) {
          const double error = std::abs(static_cast<double>(k(b, j, h, c)) - s.value(c));
          ASSERT_LE(error, 0.5 * s.channel[c] * (1 + 1e-6) + eps * std::abs(s.zero[c])) << b << " " << j << " " << h << " " << c;
        }
        if (j % group != 0) continue;
        for (int64_t c = 0; c < d; ++c) {  // the group's range, mapped onto −128..127
          float lo = k(b, j, h, c), hi = lo;
          int lowest = 127, highest = -128;
          for (int64_t i = j; i < std::min(j + group, tokens); ++i) {
            lo = std::min(lo, k(b, i, h, c));
            hi = std::max(hi, k(b, i, h, c));
            lowest = std::min(lowest, int(stored_key(cache, b, i, h).ints[c]));
            highest = std::max(highest, int(stored_key(cache, b, i, h).ints[c]));
          }
          // hi/255 − lo/255 (hi − lo itself overflows for a range past float's), the zero
          // point summed in double: both finite for any finite keys.
          EXPECT_EQ(s.channel[c], hi / 255.0f - lo / 255.0f) << j << " " << c;
          EXPECT_EQ(s.zero[c], static_cast<float>(double{lo} + 128.0 * double{s.channel[c]})) << j << " " << c;
          EXPECT_EQ(lowest, -128) << j << " " << c;
          EXPECT_EQ(highest, 127) << j << " " << c;
        }
      }
}

// The newest, partial group is quantized from its float32 rows again at each append, so
// the stored cache depends only on the tokens, not on how they were split into appends.
TEST(KVCacheChannel, StorageDoesNotDependOnHowTokensWereAppended) {
  const int64_t d = 32, group = 16, tokens = 53;
  const auto k = outlier_keys(tokens, d, 21);
  const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 22);
  KVCache whole(channel_config(d, group)), one_by_one(channel_config(d, group)), uneven(channel_config(d, group));
  append_range(whole, k, v, 0, tokens);
  for (int64_t t = 0; t < tokens; ++t) append_range(one_by_one, k, v, t, t + 1);
  for (auto [from, to] : {std::pair<int64_t, int64_t>{0, 3}, {3, 20}, {20, 21}, {21, 48}, {48, 53}})
    append_range(uneven, k, v, from, to);
  for (const KVCache* other : {&one_by_one, &uneven})
    for (int64_t b = 0; b < kBatch; ++b)
      for (int64_t j = 0; j < tokens; ++j)
        for (int64_t h = 0; h < kKvHeads; ++h) {
          const StoredKey x = stored_key(whole, b, j, h), y = stored_key(*other, b, j, h);
          ASSERT_EQ(std::memcmp(x.ints, y.ints, d), 0) << j;
          ASSERT_EQ(std::memcmp(&x.row_scale, &y.row_scale, sizeof(float)), 0) << j;
          ASSERT_EQ(std::memcmp(x.channel, y.channel, d * sizeof(float)), 0) << j;
          ASSERT_EQ(std::memcmp(x.zero, y.zero, d * sizeof(float)), 0) << j;
        }
}

using Result = test::AttendResult;
using test::attend;
using test::same_bits;

// The error bound of the fp32 kernel against the fp64 reference over the same stored
// values: a logit's dot product over d terms, summed in lanes and then a tree, is within
// (d/lanes + log2(lanes) + 3)·ε·Σ_c|scale·q_c·k_c| ≤ 24·ε·L for d ≤ 64 (L the largest such
// sum over the stored keys k_c = int8·c + z: the kernel maps each level to its key with one
// rounding before the dot product, so the bound is relative to the stored keys themselves,
// not to their integer and zero-point terms, which cancel on a channel with a wide range),
// which moves the softmax's output by at most 2·that·max|v|; plus P·V's own 4·ε·max|v|.
double kernel_bound(const KVCache& cache, const Tensor<float, 4>& q, const Tensor<float, 4>& v) {
  double max_v = 0.0;
  for (std::size_t x = 0; x < v.size(); ++x) max_v = std::max(max_v, double(std::abs(v[x])));
  const KVCacheConfig& c = cache.config();
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const int64_t group = q.shape()[2] / c.kv_heads;
  double largest_sum = 0.0;
  for (int64_t b = 0; b < q.shape()[0]; ++b)
    for (int64_t i = 0; i < q.shape()[1]; ++i)
      for (int64_t hq = 0; hq < q.shape()[2]; ++hq)
        for (int64_t j = 0; j < cache.lengths()[static_cast<std::size_t>(b)]; ++j) {
          const StoredKey s = stored_key(cache, b, j, hq / group);
          double sum = 0.0;
          for (int64_t x = 0; x < c.head_dim; ++x)
            sum += std::abs(scale * q(b, i, hq, x)) * std::abs(s.value(x));
          largest_sum = std::max(largest_sum, sum);
        }
  const double eps = std::numeric_limits<float>::epsilon();
  return (48.0 * largest_sum + 4.0) * eps * max_v;
}

// Head sizes on the in-place path (64, a whole number of vectors) and the packed one (20);
// groups that are whole vectors (16, 32) or not (5: a vector of keys spans two groups);
// one and three queries per sequence (speculative decoding); GQA 8 : 2.
TEST(KVCacheChannel, DecodeMatchesTheReferenceOnEveryTarget) {
  test::for_each_simd_target([](int64_t) {
    for (int64_t d : {64, 20})
      for (int64_t group : {16, 5, 32}) {
        SCOPED_TRACE("d=" + std::to_string(d) + " group=" + std::to_string(group));
        const int64_t tokens = 75;
        const auto k = outlier_keys(tokens, d, 31 + d + group);
        const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 32);
        KVCache cache(channel_config(d, group));
        append_range(cache, k, v, 0, 50);
        append_range(cache, k, v, 50, tokens);
        for (int64_t q_len : {1, 3}) {
          const auto q = test::random_tensor<float, 4>({kBatch, q_len, 8, d}, 33 + q_len);
          test::expect_kernel_matches_reference(cache, q, kernel_bound(cache, q, v));
        }
      }
  });
}

// One key entry far outside its channel (issue 45: 1e8 gave zero points of ~5e7, and the
// kernel's q·(c⊙int8) and q·z, summed apart, cancelled: rows that never saw that key moved
// by 0.87), and a channel holding both ±3e38 (hi − lo overflowed: the group stored
// non-finite, attend gave NaN). Every key stored finite, and each query row within
// kernel_bound's form taken over the keys that row sees — relative to the stored keys, so
// rows that do not see the outlier key keep a tight bound — on every target (EMU128's
// affine map takes std::fma). The outlier is the last key: the first two of three queries
// (bottom-right causal) see the rest of its group but not it.
TEST(KVCacheChannel, WideRangeChannelsMatchTheReferenceOnEveryTarget) {
  test::for_each_simd_target([](int64_t) {
    for (int64_t d : {64, 20})
      for (float outlier : {1e6f, 1e8f, -1e8f, 3e38f}) {
        SCOPED_TRACE("d=" + std::to_string(d) + " outlier=" + std::to_string(outlier));
        const int64_t tokens = 40, group = 16, q_len = 3, q_heads = 8;
        auto k = outlier_keys(tokens, d, 41);
        for (int64_t b = 0; b < kBatch; ++b) k(b, tokens - 1, 0, 3) = outlier;
        if (outlier == 3e38f) k(1, 33, 1, 2) = outlier, k(1, 35, 1, 2) = -outlier;
        const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 42);
        KVCache cache(channel_config(d, group));
        append_range(cache, k, v, 0, tokens);
        for (int64_t b = 0; b < kBatch; ++b)
          for (int64_t j = 0; j < tokens; ++j)
            for (int64_t h = 0; h < kKvHeads; ++h)
              for (int64_t c = 0; c < d; ++c) ASSERT_TRUE(std::isfinite(stored_key(cache, b, j, h).value(c))) << j;
        // Queries small enough that float32 scores of keys ~3e38 stay finite.
        auto q = test::random_tensor<float, 4>({kBatch, q_len, q_heads, d}, 43);
        if (outlier == 3e38f)
          for (std::size_t x = 0; x < q.size(); ++x) q[x] *= 1e-37f;
        const Result fast = attend(cache, q, Backend::cpu, 2), ref = attend(cache, q, Backend::reference, 1);
        double max_v = 0.0;
        for (std::size_t x = 0; x < v.size(); ++x) max_v = std::max(max_v, double(std::abs(v[x])));
        const double eps = std::numeric_limits<float>::epsilon(), scale = 1.0 / std::sqrt(double(d));
        for (int64_t b = 0; b < kBatch; ++b)
          for (int64_t i = 0; i < q_len; ++i)
            for (int64_t hq = 0; hq < q_heads; ++hq) {
              double largest_sum = 0.0;
              for (int64_t j = 0; j <= tokens - q_len + i; ++j) {  // the keys row i sees
                const StoredKey key = stored_key(cache, b, j, hq / (q_heads / kKvHeads));
                double sum = 0.0;
                for (int64_t x = 0; x < d; ++x) sum += std::abs(scale * q(b, i, hq, x) * key.value(x));
                largest_sum = std::max(largest_sum, sum);
              }
              const double bound = (48.0 * largest_sum + 4.0) * eps * max_v;
              for (int64_t c = 0; c < d; ++c)
                ASSERT_LE(std::abs(double(fast.out(b, i, hq, c)) - ref.out(b, i, hq, c)), bound)
                    << "b " << b << " row " << i << " head " << hq;
            }
      }
  });
}

// Paged caches (blocks of 32 and 16 keys, groups of 16; the pool handed out out of order)
// hold and attend to the same bits as a contiguous one.
TEST(KVCacheChannel, PagedEqualsContiguousBitwise) {
  const int64_t d = 64, group = 16, tokens = 70;
  const auto k = outlier_keys(tokens, d, 41);
  const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 42);
  KVCache contiguous(channel_config(d, group)), paged32(channel_config(d, group, true, 32)),
      paged16(channel_config(d, group, true, 16));
  // Sequence 1 first into the paged pools, so that its blocks come before sequence 0's.
  for (KVCache* cache : {&contiguous, &paged32, &paged16})
    for (int64_t b : {1, 0}) test::append_sequence(*cache, k, v, b, 0, 9);
  for (KVCache* cache : {&contiguous, &paged32, &paged16}) append_range(*cache, k, v, 9, tokens);
  EXPECT_NE(paged16.block_table()[0], 0);  // sequence 0 does not start at block 0
  const auto q = test::random_tensor<float, 4>({kBatch, 2, 8, d}, 43);
  const Result a = attend(contiguous, q, Backend::cpu, 2);
  EXPECT_TRUE(same_bits(a, attend(paged32, q, Backend::cpu, 2)));
  EXPECT_TRUE(same_bits(a, attend(paged16, q, Backend::cpu, 1)));
}

// A key holding NaN or inf is stored as zeros with row scale NaN: a query that sees it
// gets NaN, one that does not see it (causal) the result without it; the channel scales
// of its group come from the finite keys only.
TEST(KVCacheChannel, ANonFiniteKeyPoisonsOnlyItself) {
  const int64_t d = 32, group = 16, tokens = 12;
  auto k = outlier_keys(tokens, d, 51);
  const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 52);
  auto clean = k;
  k(0, tokens - 1, 0, 3) = std::numeric_limits<float>::infinity();  // the newest key of (seq 0, head 0)
  KVCache poisoned(channel_config(d, group)), without(channel_config(d, group));
  append_range(poisoned, k, v, 0, tokens);
  append_range(without, clean, v, 0, tokens - 1);
  EXPECT_TRUE(std::isnan(stored_key(poisoned, 0, tokens - 1, 0).row_scale));
  for (int64_t j = 0; j < tokens - 1; ++j)  // the other keys are stored as without it
    for (int64_t h = 0; h < kKvHeads; ++h) {
      const StoredKey x = stored_key(poisoned, 0, j, h), y = stored_key(without, 0, j, h);
      if (h == 1) continue;  // head 1's group has the clean newest key too
      EXPECT_EQ(std::memcmp(x.ints, y.ints, d), 0) << j;
      EXPECT_EQ(std::memcmp(x.channel, y.channel, d * sizeof(float)), 0) << j;
      EXPECT_EQ(std::memcmp(x.zero, y.zero, d * sizeof(float)), 0) << j;
    }
  // Two queries: query 0 sees keys 0..tokens−2, query 1 every key.
  const auto q = test::random_tensor<float, 4>({kBatch, 2, 4, d}, 53);
  const Result r = attend(poisoned, q, Backend::cpu, 1);
  for (int64_t hq = 0; hq < 4; ++hq) {
    const bool sees_it = hq / 2 == 0;  // query heads 0, 1 read kv head 0
    EXPECT_EQ(std::isnan(r.out(0, 1, hq, 0)), sees_it) << hq;
    EXPECT_FALSE(std::isnan(r.out(0, 0, hq, 0))) << hq;
    EXPECT_FALSE(std::isnan(r.out(1, 1, hq, 0))) << hq;
  }
}

// What the channel scales are for: attention over keys with outlier channels, against
// fp64 attention over the original keys and values — several times closer than with one
// scale per row (6.3× here, measured; the test asks for 3×).
TEST(KVCacheChannel, BeatsRowScalesOnOutlierChannels) {
  const int64_t d = 64, tokens = 90;
  const auto k = outlier_keys(tokens, d, 61);
  const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 62);
  const auto q = test::random_tensor<float, 4>({kBatch, 1, 8, d}, 63);
  KVCacheConfig row_config = channel_config(d, 32);
  row_config.key_scales = KeyScales::row;
  KVCache by_row(row_config), by_channel(channel_config(d, 32)), exact({.batch = kBatch, .capacity = kCapacity,
                                                                       .kv_heads = kKvHeads, .head_dim = d});
  for (KVCache* cache : {&by_row, &by_channel, &exact}) append_range(*cache, k, v, 0, tokens);
  const Result truth = attend(exact, q, Backend::reference, 1);
  const auto error = [&](const KVCache& cache) { return test::l2_distance(attend(cache, q, Backend::cpu, 1).out, truth.out); };
  EXPECT_LT(3.0 * error(by_channel), error(by_row));
}

// BatchPlan over the cache's views: the decode rows as cache.attend's, bit for bit; a
// prefill chunk (tiled, over keys gathered as int8 · row scale · channel scale) within
// the kernel bound of the reference.
TEST(KVCacheChannel, BatchPlanReadsTheSameCache) {
  const int64_t d = 64, group = 16, tokens = 60;
  const auto k = outlier_keys(tokens, d, 71);
  const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 72);
  KVCache cache(channel_config(d, group, true, 32));
  append_range(cache, k, v, 0, tokens);
  const std::vector<int64_t> cu_q{0, 1, 1 + 20}, lengths{tokens, tokens};  // seq 0 decodes, seq 1 a chunk of 20
  const DecodeArgs<std::int8_t> views = cache.views<std::int8_t>();
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  const BatchPlan plan({.cu_seqlens_q = std::span<const int64_t>(cu_q), .cache_lengths = std::span<const int64_t>(lengths), .block_table = views.block_table,
                        .block_size = 32, .num_heads = 8, .num_kv_heads = kKvHeads, .head_dim = d,
                        .storage = StorageType::int8},
                       options);
  const auto q = test::random_tensor<float, 3>({21, 8, d}, 73);
  Tensor<float, 3> out({21, 8, d});
  plan.run(BatchArgs<std::int8_t>{.q = q.cview(), .k_cache = views.k_cache, .v_cache = views.v_cache, .out = out.view(),
                                  .k_scale = views.k_scale, .v_scale = views.v_scale,
                                  .k_channel_scale = views.k_channel_scale, .k_channel_zero = views.k_channel_zero,
                                  .key_group = views.key_group});
  // Sequence 0's one query through cache.attend (sequence 1 gets a copy of the same query).
  Tensor<float, 4> q0({kBatch, 1, 8, d});
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t h = 0; h < 8; ++h)
      for (int64_t c = 0; c < d; ++c) q0(b, 0, h, c) = q(0, h, c);
  const Result alone = attend(cache, q0, Backend::cpu, 1);
  EXPECT_EQ(std::memcmp(&out(0, 0, 0), &alone.out(0, 0, 0, 0), 8 * d * sizeof(float)), 0);
  // Sequence 1's chunk against the reference over the same cache (queries 40..59 of it).
  Tensor<float, 4> q1({kBatch, 20, 8, d});
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t i = 0; i < 20; ++i)
      for (int64_t h = 0; h < 8; ++h)
        for (int64_t c = 0; c < d; ++c) q1(b, i, h, c) = q(1 + i, h, c);
  const Result ref = attend(cache, q1, Backend::reference, 1);
  double worst = 0.0;
  for (int64_t i = 0; i < 20; ++i)
    for (int64_t h = 0; h < 8; ++h)
      for (int64_t c = 0; c < d; ++c) worst = std::max(worst, double(std::abs(out(1 + i, h, c) - ref.out(1, i, h, c))));
  EXPECT_LE(worst, kernel_bound(cache, q1, v));
}

using test::expect_error;

TEST(KVCacheChannel, BadConfigsAndArgumentsAreNamed) {
  KVCacheConfig c = channel_config(16, 16);
  c.dtype = StorageType::bfloat16;
  expect_error([&] { KVCache{c}; }, "config.key_scales: channel scales are for int8 and int4 caches, got dtype bfloat16");
  c = channel_config(16, 0);
  expect_error([&] { KVCache{c}; }, "config.group_size: expected 1..96");
  c = channel_config(16, 97);
  expect_error([&] { KVCache{c}; }, "config.group_size: expected 1..96");
  c = channel_config(16, 12, true, 16);
  expect_error([&] { KVCache{c}; }, "config.group_size: must divide config.block_size (16)");

  KVCache cache(channel_config(16, 8));
  const auto k = test::random_tensor<float, 4>({kBatch, 10, kKvHeads, 16}, 81);
  cache.append(k.cview(), k.cview());
  Tensor<float, 4> q({kBatch, 1, 4, 16}), out({kBatch, 1, 4, 16});
  const auto decode_with = [&](DecodeArgs<std::int8_t> args) {
    return [&, args]() mutable {
      args.q = q.cview();
      args.out = out.view();
      decode(args, AttentionOptions{});
    };
  };
  DecodeArgs<std::int8_t> args = cache.views<std::int8_t>();
  args.k_channel_scale.shape[1] = 3;
  expect_error(decode_with(args), "k_channel_scale.shape[1] (groups): expected 12");
  args = cache.views<std::int8_t>();
  args.key_group = 0;
  expect_error(decode_with(args), "key_group: expected 1..96 keys per channel-scale group");
  args = cache.views<std::int8_t>();
  args.k_channel_scale = {};
  args.k_channel_zero = {};
  expect_error(decode_with(args), "key_group: expected 0 without k_channel_scale, got 8");
  args = cache.views<std::int8_t>();
  args.k_channel_scale.shape[3] = 8;
  expect_error(decode_with(args), "k_channel_scale.shape[3] (head_dim): expected 16");
  args = cache.views<std::int8_t>();
  args.k_channel_zero.shape[2] = 1;
  expect_error(decode_with(args), "k_channel_zero.shape[2] (kv heads): expected 2 (as k_channel_scale.shape[2])");
  args = cache.views<std::int8_t>();
  args.k_channel_zero.strides[1] = 1;
  expect_error(decode_with(args), "k_channel_zero.strides[1]: expected 32 (as k_channel_scale's)");
  args = cache.views<std::int8_t>();
  args.k_channel_scale = {};
  args.key_group = 0;
  expect_error(decode_with(args), "k_channel_zero: zero points come with k_channel_scale");
  // Nothing was written by the failed calls.
  for (std::size_t x = 0; x < out.size(); ++x) ASSERT_EQ(out[x], 0.0f);

  KVCache floats({.batch = 1, .capacity = 8, .kv_heads = 2, .head_dim = 16});
  DecodeArgs<float> fargs = floats.views<float>();
  fargs.k_channel_scale = cache.views<std::int8_t>().k_channel_scale;
  fargs.key_group = 8;
  Tensor<float, 4> fq({1, 1, 4, 16}), fout({1, 1, 4, 16});
  fargs.q = fq.cview();
  fargs.out = fout.view();
  expect_error([&] { decode(fargs, AttentionOptions{}); }, "k_channel_scale: only int8 caches take channel scales");
}

}  // namespace
}  // namespace qkv
