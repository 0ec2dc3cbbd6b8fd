// qkv::KVCache with int4 storage (keys per channel over groups of tokens, values per row
// and group of 32 channels, a scale and zero point each) and the float window for the
// newest tokens (int4 and int8): every stored value within half a step of the appended
// one, the window's rows exact, the stored cache independent of how tokens were split
// into appends (and of a reset), empty and partial groups, paged = contiguous bitwise,
// decode on every SIMD target within the kernel's bound of the fp64 reference over the
// stored values (and the same bits for any thread count), non-finite rows poisoning only
// the queries that see them, bad configs named.
#include <gtest/gtest.h>

#include <qkv/batch_plan.hpp>
#include <qkv/kv_cache.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cache_test_support.hpp"
#include "simd_targets.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

constexpr int64_t kBatch = 2, kCapacity = 112, kKvHeads = 2;
const double kEps = std::numeric_limits<float>::epsilon();

KVCacheConfig int4_config(int64_t d, int64_t group, int64_t window = 0, bool paged = false, int64_t block_size = 32,
                          StorageType scales = StorageType::float32) {
  return {.batch = kBatch, .capacity = kCapacity, .kv_heads = kKvHeads, .head_dim = d, .v_dim = d,
          .dtype = StorageType::int4, .paged = paged, .block_size = block_size,
          .key_scales = KeyScales::channel, .group_size = group, .float_window = window, .scale_dtype = scales};
}

constexpr StorageType kScaleTypes[] = {StorageType::float32, StorageType::float16};

// Keys with outlier channels (cache_test_support.hpp) for this file's caches.
Tensor<float, 4> outlier_keys(int64_t tokens, int64_t d, std::uint64_t seed) {
  return test::outlier_keys(kBatch, tokens, kKvHeads, d, seed);
}

using test::append_range;

// [min, max] of x(i) over i in [from, to).
template <class X>
std::pair<float, float> range_of(int64_t from, int64_t to, X x) {
  float lo = x(from), hi = lo;
  for (int64_t i = from; i < to; ++i) {
    lo = std::min(lo, x(i));
    hi = std::max(hi, x(i));
  }
  return {lo, hi};
}

// The range [lo, hi] key (b, j, h) channel c was quantized in: its group of `group`
// tokens (the newest, partial group over its tokens so far, of `tokens`).
std::pair<float, float> key_group_range(const Tensor<float, 4>& k, int64_t b, int64_t j, int64_t h, int64_t c,
                                        int64_t group, int64_t tokens) {
  const int64_t first = j / group * group;
  return range_of(first, std::min(first + group, tokens), [&](int64_t i) { return k(b, i, h, c); });
}

// The range of value row (b, j, h)'s group of kValueGroup channels holding channel c.
std::pair<float, float> value_group_range(const Tensor<float, 4>& v, int64_t b, int64_t j, int64_t h, int64_t c,
                                          int64_t d) {
  const int64_t from = c / kValueGroup * kValueGroup;
  return range_of(from, std::min(from + kValueGroup, d), [&](int64_t x) { return v(b, j, h, x); });
}

// x within half a step of its stored value, the step being (hi − lo) / 15 of the range
// it was quantized in (the scale rounded to float: a relative 1e-6 more), up to the float
// rounding of the zero point lo and of the stored value; and the range's least value
// stored as lo itself (level 0).
void expect_within_half_a_step(float x, float stored, float lo, float hi, const std::string& where) {
  const double step = (static_cast<double>(hi) - lo) / 15.0;
  const double bound = 0.5 * step * (1 + 1e-6) + 4 * kEps * (std::abs(x) + std::abs(lo));
  ASSERT_LE(std::abs(static_cast<double>(x) - stored), bound) << where;
  if (x == lo) {
    ASSERT_EQ(stored, lo) << where;
  }
}

// Keys: per channel over each group of group_size tokens (the newest group over its rows
// so far); values: per row over each 32 channels. Checked against ranges the test
// computes itself, with d = 40 (a last value group of 8 channels) and odd d = 7.
TEST(KVCacheInt4, EveryValueIsWithinHalfAStep) {
  for (int64_t d : {40, 7}) {
    const int64_t group = 16, tokens = 57;
    const auto k = outlier_keys(tokens, d, 11 + d);
    const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 12);
    KVCache cache(int4_config(d, group));
    for (auto [from, to] : {std::pair<int64_t, int64_t>{0, 7}, {7, 8}, {8, 40}, {40, 57}}) append_range(cache, k, v, from, to);
    for (int64_t b = 0; b < kBatch; ++b) {
      const auto [ks, vs] = cache.stored(b);
      ASSERT_EQ(ks.size(), static_cast<std::size_t>(tokens * kKvHeads * d));
      const auto at = [&](int64_t j, int64_t h, int64_t c) { return static_cast<std::size_t>((j * kKvHeads + h) * d + c); };
      for (int64_t h = 0; h < kKvHeads; ++h)
        for (int64_t j = 0; j < tokens; ++j)
          for (int64_t c = 0; c < d; ++c) {
            const auto [lo, hi] = key_group_range(k, b, j, h, c, group, tokens);
            const std::string where = "d " + std::to_string(d) + " key " + std::to_string(j) + " channel " + std::to_string(c);
            expect_within_half_a_step(k(b, j, h, c), ks[at(j, h, c)], lo, hi, where);
            const auto [vlo, vhi] = value_group_range(v, b, j, h, c, d);
            expect_within_half_a_step(v(b, j, h, c), vs[at(j, h, c)], vlo, vhi, "value: " + where);
          }
    }
  }
}

// float16's spacing at x (the gap between x and the next float16 away from 0; the
// subnormals' 2⁻²⁴ below 2⁻¹⁴).
double float16_spacing(double x) {
  const double a = std::abs(x);
  return a < std::ldexp(1.0, -14) ? std::ldexp(1.0, -24) : std::ldexp(1.0, std::ilogb(a) - 10);
}

// With float16 scales (scale_dtype float16) the zero point is lo rounded down to a
// float16 and the scale (hi − z) / 15 rounded up: every value within half of that step
// of its stored value, the zero point at most one float16 spacing below lo and the step
// at most one float16 rounding and lo's spacing / 15 above (hi − lo) / 15 — against
// ranges the test computes from the appended keys (outliers, channels offset by 1000.3
// where lo is far from a float16, a constant channel) and values, read through the
// cache's own float16 arrays.
TEST(KVCacheInt4, Float16ScalesKeepEveryValueWithinHalfAStep) {
  for (int64_t d : {40, 7}) {
    SCOPED_TRACE("d " + std::to_string(d));
    const int64_t group = 16, tokens = 57;
    auto k = outlier_keys(tokens, d, 111 + d);
    auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 112);
    for (int64_t b = 0; b < kBatch; ++b)
      for (int64_t j = 0; j < tokens; ++j)
        for (int64_t h = 0; h < kKvHeads; ++h) {
          k(b, j, h, 1) += 1000.3f;
          k(b, j, h, 2) = 0.1f;  // one value per group: a step of at most 2⁻²⁴ covers it
          v(b, j, h, 0) -= 200.7f;
        }
    KVCache cache(int4_config(d, group, 0, false, 32, StorageType::float16));
    for (auto [from, to] : {std::pair<int64_t, int64_t>{0, 7}, {7, 8}, {8, 40}, {40, 57}}) append_range(cache, k, v, from, to);
    ASSERT_EQ(cache.config().scale_dtype, StorageType::float16);
    const auto scales = cache.k_channel_scales<float16>(), zeros = cache.k_channel_zeros<float16>();
    const auto groups = cache.v_group_scales<float16>();
    const int64_t value_groups = (d + kValueGroup - 1) / kValueGroup;
    ASSERT_EQ(groups.size(), static_cast<std::size_t>(kBatch * kCapacity * kKvHeads * 2 * value_groups));
    // Checks x against the stored value with (s, z) stored for the range [lo, hi].
    const auto check = [&](float x, float stored, float s, float z, float lo, float hi, const std::string& where) {
      ASSERT_LE(z, lo) << where;
      ASSERT_LE(lo - z, float16_spacing(lo)) << where;
      ASSERT_LE(s, ((double(hi) - lo) + float16_spacing(lo)) / 15.0 * (1 + std::ldexp(1.0, -10)) + std::ldexp(1.0, -24))
          << where;
      ASSERT_LE(std::abs(double(x) - stored), 0.5 * s * (1 + 1e-6) + 4 * kEps * (std::abs(x) + std::abs(z))) << where;
    };
    for (int64_t b = 0; b < kBatch; ++b) {
      const auto [ks, vs] = cache.stored(b);
      const auto at = [&](int64_t j, int64_t h, int64_t c) { return static_cast<std::size_t>((j * kKvHeads + h) * d + c); };
      for (int64_t h = 0; h < kKvHeads; ++h)
        for (int64_t j = 0; j < tokens; ++j)
          for (int64_t c = 0; c < d; ++c) {
            const auto [lo, hi] = key_group_range(k, b, j, h, c, group, tokens);
            const auto g = static_cast<std::size_t>(((b * ((kCapacity + group - 1) / group) + j / group) * kKvHeads + h) * d + c);
            const std::string where = "key " + std::to_string(j) + " channel " + std::to_string(c);
            check(k(b, j, h, c), ks[at(j, h, c)], scales[g], zeros[g], lo, hi, where);
            const auto [vlo, vhi] = value_group_range(v, b, j, h, c, d);
            // [B, Hkv, 2·groups, capacity]: group vg's scale, then its zero point.
            const auto vg = c / kValueGroup;
            const auto group_at = [&](int64_t i) {
              return static_cast<std::size_t>(((b * kKvHeads + h) * 2 * value_groups + i) * kCapacity + j);
            };
            check(v(b, j, h, c), vs[at(j, h, c)], groups[group_at(vg)], groups[group_at(value_groups + vg)], vlo, vhi,
                  "value: " + where);
          }
    }
    // The arrays are float16: asking for float32 ones is refused by name.
    test::expect_error([&] { (void)cache.k_channel_scales(); },
                       "qkv::KVCache: k_channel_scales: the cache's scales are float16 (config.scale_dtype); ask for float16");
  }
}

// Values beyond float16's range, which float16 scales cannot cover, are refused with
// their position, the cache unchanged; NaN and ±inf rows are not (they poison as ever).
TEST(KVCacheInt4, Float16ScalesRefuseValuesBeyondTheirRange) {
  const int64_t d = 16;
  KVCache cache(int4_config(d, 8, 0, false, 32, StorageType::float16));
  auto k = test::random_tensor<float, 4>({kBatch, 3, kKvHeads, d}, 121);
  auto v = test::random_tensor<float, 4>({kBatch, 3, kKvHeads, d}, 122);
  append_range(cache, k, v, 0, 3);
  const auto before = cache.stored(0);
  k(1, 2, 1, 5) = -70000.0f;
  test::expect_error([&] { cache.append(k.cview(), v.cview()); },
                     "qkv::KVCache::append: k[1, 2, 1, 5]: -70000.000000 is beyond float16's range (±65504)");
  k(1, 2, 1, 5) = 0.0f;
  v(0, 1, 0, 3) = 65520.0f;
  test::expect_error([&] { cache.append(k.cview(), v.cview()); }, "qkv::KVCache::append: v[0, 1, 0, 3]: 65520.000000");
  EXPECT_EQ(cache.lengths()[0], 3);
  EXPECT_EQ(cache.stored(0), before);
  v(0, 1, 0, 3) = 65504.0f;  // the largest float16 is in range
  k(0, 0, 0, 0) = std::numeric_limits<float>::infinity();
  cache.append(k.cview(), v.cview());
  EXPECT_EQ(cache.lengths()[0], 6);
}

// A float window of W: a group is quantized once its last key is W behind the newest, so
// quantized_lengths = G·⌊(length − W) / G⌋ and the newer rows (≥ W of them) are the
// appended floats exactly; the older ones within half a step. int8 caches with channel
// keys take the window too.
TEST(KVCacheInt4, TheFloatWindowHoldsTheNewestRowsExactly) {
  for (StorageType type : {StorageType::int4, StorageType::int8}) {
    const int64_t d = 32, group = 16, window = 24;
    const auto k = outlier_keys(100, d, 21);
    const auto v = test::random_tensor<float, 4>({kBatch, 100, kKvHeads, d}, 22);
    KVCacheConfig config = int4_config(d, group, window);
    config.dtype = type;
    KVCache cache(config);
    int64_t length = 0;
    for (int64_t to : {5, 23, 40, 41, 64, 100}) {
      append_range(cache, k, v, length, to);
      length = to;
      const int64_t quantized = std::max<int64_t>(0, (length - window) / group * group);
      ASSERT_EQ(cache.quantized_lengths()[0], quantized) << "length " << length;
      const auto [ks, vs] = cache.stored(1);
      for (int64_t j = 0; j < length; ++j)
        for (int64_t h = 0; h < kKvHeads; ++h)
          for (int64_t c = 0; c < d; ++c) {
            const auto at = static_cast<std::size_t>((j * kKvHeads + h) * d + c);
            if (j >= quantized) {
              ASSERT_EQ(ks[at], k(1, j, h, c)) << j;
              ASSERT_EQ(vs[at], v(1, j, h, c)) << j;
            } else {
              const int64_t first = j / group * group;  // quantized: within half a step of its group's range
              float lo = k(1, first, h, c), hi = lo;
              for (int64_t i = first; i < first + group; ++i) {
                lo = std::min(lo, k(1, i, h, c));
                hi = std::max(hi, k(1, i, h, c));
              }
              const double half_step = 0.5 * (double(hi) - lo) / (type == StorageType::int4 ? 15 : 255);
              ASSERT_LE(std::abs(ks[at] - k(1, j, h, c)), half_step * (1 + 1e-5) + 1e-5) << j;
            }
          }
    }
  }
}

using Result = test::AttendResult;
using test::attend;
using test::same_bits;

bool same_storage(const KVCache& a, const KVCache& b) {
  for (int64_t seq = 0; seq < kBatch; ++seq) {
    const auto [ka, va] = a.stored(seq);
    const auto [kb, vb] = b.stored(seq);
    if (ka.size() != kb.size() || std::memcmp(ka.data(), kb.data(), ka.size() * sizeof(float)) != 0 ||
        std::memcmp(va.data(), vb.data(), va.size() * sizeof(float)) != 0)
      return false;
  }
  return true;
}

// Without a window the newest group is quantized again at each append; with one, a group
// once, when due: either way the stored values depend only on the tokens. A reset
// sequence, refilled, holds what a fresh one does.
TEST(KVCacheInt4, StorageDoesNotDependOnHowTokensWereAppended) {
  for (int64_t window : {0, 8}) {
    SCOPED_TRACE("window " + std::to_string(window));
    const int64_t d = 32, group = 16, tokens = 53;
    const auto k = outlier_keys(tokens, d, 31);
    const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 32);
    KVCache whole(int4_config(d, group, window)), one_by_one(int4_config(d, group, window)),
        uneven(int4_config(d, group, window)), reset(int4_config(d, group, window));
    append_range(whole, k, v, 0, tokens);
    for (int64_t t = 0; t < tokens; ++t) append_range(one_by_one, k, v, t, t + 1);
    for (auto [from, to] : {std::pair<int64_t, int64_t>{0, 3}, {3, 20}, {20, 21}, {21, 48}, {48, 53}})
      append_range(uneven, k, v, from, to);
    const auto noise = test::random_tensor<float, 4>({kBatch, 40, kKvHeads, d}, 33);
    append_range(reset, noise, noise, 0, 40);
    reset.reset();
    append_range(reset, k, v, 0, tokens);
    const auto q = test::random_tensor<float, 4>({kBatch, 2, 4, d}, 34);
    const Result expected = attend(whole, q, Backend::cpu, 1);
    for (const KVCache* other : {&one_by_one, &uneven, &reset}) {
      EXPECT_TRUE(same_storage(whole, *other));
      EXPECT_TRUE(same_bits(expected, attend(*other, q, Backend::cpu, 1)));
    }
  }
}

// The fp32 kernel against the fp64 reference over the same stored values. A logit sums
// d terms of (scale·q ⊙ s)·level and the zero points' d terms apart, in lanes and a tree:
// within 24·ε·Σ_c|scale·q_c|·(|level·s_c| + |z_c|) ≤ 24·ε·Σ_c|scale·q_c|·(|k_c| + 2·M_c)
// (M_c the largest |key| of channel c: |z_c| = |lo| ≤ M_c), which moves the output by at
// most 2·that·max|v|; P·V of (P ⊙ s)·level + P·z: 8·ε·(max|v| + 2·max|z|) ≤ 24·ε·max|v|.
double kernel_bound(const KVCache& cache, const Tensor<float, 4>& q) {
  const KVCacheConfig& c = cache.config();
  const int64_t d = c.head_dim, group = q.shape()[2] / c.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double max_v = 0.0, worst = 0.0;
  for (int64_t b = 0; b < q.shape()[0]; ++b) {
    const auto [ks, vs] = cache.stored(b);
    for (float x : vs) max_v = std::max(max_v, double(std::abs(x)));
    const int64_t length = cache.lengths()[static_cast<std::size_t>(b)];
    std::vector<double> largest(static_cast<std::size_t>(kKvHeads * d), 0.0);
    for (int64_t j = 0; j < length; ++j)
      for (int64_t x = 0; x < kKvHeads * d; ++x)
        largest[x] = std::max(largest[x], double(std::abs(ks[static_cast<std::size_t>(j * kKvHeads * d + x)])));
    for (int64_t i = 0; i < q.shape()[1]; ++i)
      for (int64_t hq = 0; hq < q.shape()[2]; ++hq)
        for (int64_t j = 0; j < length; ++j) {
          const int64_t h = hq / group;
          double sum = 0.0;
          for (int64_t x = 0; x < d; ++x)
            sum += std::abs(scale * q(b, i, hq, x)) *
                   (std::abs(ks[static_cast<std::size_t>((j * kKvHeads + h) * d + x)]) + 2 * largest[h * d + x]);
          worst = std::max(worst, sum);
        }
  }
  return (48.0 * worst + 24.0) * kEps * max_v;
}

// Head sizes read in place (64, 32: whole vectors and value groups), packed (20, odd 7)
// and 48 (keys in place on 16-lane targets, values packed: a last value group of 16);
// groups of 16 and 5 (a vector of keys spans two groups); windows 0 and 12 (a block of
// keys split between the storage and the window); one and three queries; GQA 8 : 2.
TEST(KVCacheInt4, DecodeMatchesTheReferenceOnEveryTarget) {
  test::for_each_simd_target([](int64_t) {
    for (StorageType scales : kScaleTypes)
    for (int64_t d : {64, 32, 20, 7, 48})
      for (int64_t group : {16, 5})
        for (int64_t window : {0, 12}) {
          SCOPED_TRACE("d=" + std::to_string(d) + " group=" + std::to_string(group) + " window=" + std::to_string(window) +
                       " scales " + storage_name(scales));
          const int64_t tokens = 87;
          const auto k = outlier_keys(tokens, d, 41 + d + group);
          const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 42);
          KVCache cache(int4_config(d, group, window, false, 32, scales));
          append_range(cache, k, v, 0, 50);
          append_range(cache, k, v, 50, tokens);
          for (int64_t q_len : {1, 3}) {
            const auto q = test::random_tensor<float, 4>({kBatch, q_len, 8, d}, 43 + q_len);
            test::expect_kernel_matches_reference(cache, q, kernel_bound(cache, q));
          }
        }
  });
}

// Values far from zero with a small spread (each group's zero point ~300, its scale
// ~1e-3): P·V sums the levels times P·s and, apart, P·z once per group and block; both
// sums round relative to |v|, so the result stays within the same bound of the stored
// values' attention as any other (fp32 rounding times max |v|), on every target.
TEST(KVCacheInt4, ValuesFarFromZeroStayWithinTheBound) {
  test::for_each_simd_target([](int64_t) {
    for (StorageType scales : kScaleTypes) {
      SCOPED_TRACE(std::string("scales ") + storage_name(scales));
      const int64_t d = 64, tokens = 100;
      const auto k = outlier_keys(tokens, d, 61);
      auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 62);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = 300.0f + 0.01f * v[i];
      KVCache cache(int4_config(d, 16, 0, false, 32, scales));
      append_range(cache, k, v, 0, tokens);
      // Small queries: near-uniform weights, so the bound is mostly the values' own
      // rounding (1e-3 here, ~ε·max |v| times a small constant): an error of 1e-5
      // relative in the zero points' sum (3e-3) fails it — checked by injecting one.
      auto q = test::random_tensor<float, 4>({kBatch, 1, 8, d}, 63);
      for (std::size_t i = 0; i < q.size(); ++i) q[i] *= 1e-3f;
      test::expect_kernel_matches_reference(cache, q, kernel_bound(cache, q));
    }
  });
}

// An empty sequence next to one whose only group is partial (all in the window, or
// quantized from its rows so far): the empty one attends to nothing (out 0, lse −inf),
// the other as the reference over its stored values.
TEST(KVCacheInt4, EmptyAndPartialGroups) {
  for (int64_t window : {0, 8}) {
    SCOPED_TRACE("window " + std::to_string(window));
    const int64_t d = 32;
    const auto k = outlier_keys(5, d, 91);
    const auto v = test::random_tensor<float, 4>({kBatch, 5, kKvHeads, d}, 92);
    KVCache cache(int4_config(d, 16, window));
    test::append_sequence(cache, k, v, 1, 0, 5);
    const auto q = test::random_tensor<float, 4>({kBatch, 1, 4, d}, 93);
    const Result cpu = attend(cache, q, Backend::cpu, 1), ref = attend(cache, q, Backend::reference, 1);
    for (int64_t h = 0; h < 4; ++h) {
      EXPECT_EQ(cpu.lse(0, h, 0), -std::numeric_limits<float>::infinity());
      for (int64_t c = 0; c < d; ++c) {
        EXPECT_EQ(cpu.out(0, 0, h, c), 0.0f);
        EXPECT_NEAR(cpu.out(1, 0, h, c), ref.out(1, 0, h, c), kernel_bound(cache, q));
      }
    }
  }
}

// Paged caches (blocks of 32 and 16, groups of 16, a window of 8; the pool handed out of
// order) hold and attend to the same bits as a contiguous one.
TEST(KVCacheInt4, PagedEqualsContiguousBitwise) {
  for (StorageType scales : kScaleTypes) {
  SCOPED_TRACE(std::string("scales ") + storage_name(scales));
  const int64_t d = 64, group = 16, window = 8, tokens = 70;
  const auto k = outlier_keys(tokens, d, 51);
  const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 52);
  KVCache contiguous(int4_config(d, group, window, false, 32, scales)),
      paged32(int4_config(d, group, window, true, 32, scales)), paged16(int4_config(d, group, window, true, 16, scales));
  for (KVCache* cache : {&contiguous, &paged32, &paged16})
    for (int64_t b : {1, 0}) test::append_sequence(*cache, k, v, b, 0, 9);  // sequence 1's blocks first
  for (KVCache* cache : {&contiguous, &paged32, &paged16}) append_range(*cache, k, v, 9, tokens);
  EXPECT_NE(paged16.block_table()[0], 0);
  EXPECT_TRUE(same_storage(contiguous, paged32));
  EXPECT_TRUE(same_storage(contiguous, paged16));
  const auto q = test::random_tensor<float, 4>({kBatch, 2, 8, d}, 53);
  const Result a = attend(contiguous, q, Backend::cpu, 2);
  EXPECT_TRUE(same_bits(a, attend(paged32, q, Backend::cpu, 2)));
  EXPECT_TRUE(same_bits(a, attend(paged16, q, Backend::cpu, 1)));
  }
}

// A key or value row holding NaN or inf (in the quantized storage, or in the window):
// a query that sees it gets NaN, one that does not (causal) the result without it.
TEST(KVCacheInt4, ANonFiniteRowPoisonsOnlyTheQueriesThatSeeIt) {
  for (StorageType scales : kScaleTypes)
  for (int64_t window : {0, 16})
    for (bool in_values : {false, true}) {
      SCOPED_TRACE("window " + std::to_string(window) + (in_values ? " value" : " key") + " scales " + storage_name(scales));
      const int64_t d = 32, group = 16, tokens = 40;
      auto k = outlier_keys(tokens, d, 61);
      auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 62);
      // The newest key of (seq 0, head 0): with a window of 16 it is float, else quantized.
      // (NaN: a float ±inf key in the window gives a ±inf logit, which −inf makes weight 0.)
      (in_values ? v : k)(0, tokens - 1, 0, 3) = std::numeric_limits<float>::quiet_NaN();
      KVCache cache(int4_config(d, group, window, false, 32, scales));
      append_range(cache, k, v, 0, tokens);
      const auto q = test::random_tensor<float, 4>({kBatch, 2, 4, d}, 63);  // query 0 sees keys 0..38
      for (Backend backend : {Backend::cpu, Backend::reference}) {
        SCOPED_TRACE(backend == Backend::cpu ? "cpu" : "reference");
        const Result r = attend(cache, q, backend, 1);
        const auto any_nan = [&](int64_t b, int64_t i, int64_t hq) {  // a float value row's NaN is one channel's
          bool nan = false;
          for (int64_t c = 0; c < d; ++c) nan = nan || std::isnan(r.out(b, i, hq, c));
          return nan;
        };
        for (int64_t hq = 0; hq < 4; ++hq) {
          EXPECT_EQ(any_nan(0, 1, hq), hq / 2 == 0) << hq;  // heads 0, 1 read kv head 0
          EXPECT_FALSE(any_nan(0, 0, hq)) << hq;
          EXPECT_FALSE(any_nan(1, 1, hq)) << hq;
        }
      }
    }
}

// What the window is for: attention that favours the newest tokens (as a language
// model's does; here each query leans towards its sequence's newest keys) is closer to
// fp64 attention over the original keys and values with the newest 32 tokens float than
// without (5.9× here, measured; the test asks for 3×; on SmolLM2 several times: bench/KV_QUANTIZATION.md).
TEST(KVCacheInt4, TheWindowBuysAccuracy) {
  const int64_t d = 64, tokens = 96, hq = 8, group = hq / kKvHeads;
  const auto k = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 71);
  const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 72);
  auto q = test::random_tensor<float, 4>({kBatch, 1, hq, d}, 73);
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t j = tokens - 16; j < tokens; ++j)
        for (int64_t c = 0; c < d; ++c) q(b, 0, h, c) += 0.5f * k(b, j, h / group, c);
  KVCache without(int4_config(d, 32)), with(int4_config(d, 32, 32)),
      exact({.batch = kBatch, .capacity = kCapacity, .kv_heads = kKvHeads, .head_dim = d});
  for (KVCache* cache : {&without, &with, &exact}) append_range(*cache, k, v, 0, tokens);
  const Result truth = attend(exact, q, Backend::reference, 1);
  const auto error = [&](const KVCache& cache) { return test::l2_distance(attend(cache, q, Backend::cpu, 1).out, truth.out); };
  EXPECT_LT(3.0 * error(with), error(without));
}

// BatchPlan over the cache itself (int4 paged, a float window of 8): the decoding
// sequence's row as cache.attend's, bit for bit; a prefill chunk of 20 (tiled, over keys
// gathered from the storage and the window) within the kernel bound of the reference.
TEST(KVCacheInt4, BatchPlanRunsOverTheCache) {
  const int64_t d = 64, tokens = 60;
  const auto k = outlier_keys(tokens, d, 101);
  const auto v = test::random_tensor<float, 4>({kBatch, tokens, kKvHeads, d}, 102);
  KVCache cache(int4_config(d, 16, 8, true, 32));
  append_range(cache, k, v, 0, tokens);
  const std::vector<int64_t> cu_q{0, 1, 1 + 20}, lengths{tokens, tokens};
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  const auto table = TensorView<const int32_t, 2>::contiguous(cache.block_table().data(),
                                                              {kBatch, cache.blocks_per_sequence()});
  const BatchPlan plan({.cu_seqlens_q = std::span<const int64_t>(cu_q), .cache_lengths = std::span<const int64_t>(lengths),
                        .block_table = table, .block_size = 32, .num_heads = 8, .num_kv_heads = kKvHeads, .head_dim = d,
                        .storage = StorageType::int4},
                       options);
  const auto q = test::random_tensor<float, 3>({21, 8, d}, 103);
  Tensor<float, 3> out({21, 8, d});
  plan.run(q.cview(), cache, out.view());
  Tensor<float, 4> q0({kBatch, 1, 8, d}), q1({kBatch, 20, 8, d});
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t h = 0; h < 8; ++h)
      for (int64_t c = 0; c < d; ++c) {
        q0(b, 0, h, c) = q(0, h, c);
        for (int64_t i = 0; i < 20; ++i) q1(b, i, h, c) = q(1 + i, h, c);
      }
  const Result alone = attend(cache, q0, Backend::cpu, 1);
  EXPECT_EQ(std::memcmp(&out(0, 0, 0), &alone.out(0, 0, 0, 0), 8 * d * sizeof(float)), 0);
  const Result ref = attend(cache, q1, Backend::reference, 1);
  double worst = 0.0;
  for (int64_t i = 0; i < 20; ++i)
    for (int64_t h = 0; h < 8; ++h)
      for (int64_t c = 0; c < d; ++c) worst = std::max(worst, double(std::abs(out(1 + i, h, c) - ref.out(1, i, h, c))));
  EXPECT_LE(worst, kernel_bound(cache, q1));

  // A cache that is not what was planned: named, nothing written.
  Tensor<float, 3> untouched({21, 8, d});
  KVCache other(int4_config(d, 16, 8, true, 32));
  append_range(other, k, v, 0, tokens - 1);
  test::expect_error([&] { plan.run(q.cview(), other, untouched.view()); },
                     "qkv::BatchPlan::run: cache.lengths()[0]: expected 60 (the plan's cache_lengths), got 59");
  KVCacheConfig int8 = int4_config(d, 16, 8, true, 32);
  int8.dtype = StorageType::int8;
  KVCache wrong_type(int8);
  test::expect_error([&] { plan.run(q.cview(), wrong_type, untouched.view()); },
                     "qkv::BatchPlan::run: cache: expected a cache of int4 (the plan's layout.storage), got int8");
  for (std::size_t x = 0; x < untouched.size(); ++x) ASSERT_EQ(untouched[x], 0.0f);
}

using test::expect_error;

// Unset, scale_dtype is float16 for int4 and float32 for the rest (config() says which).
TEST(KVCacheInt4, ScalesAreFloat16UnlessAsked) {
  KVCacheConfig c = int4_config(16, 16);
  c.scale_dtype.reset();
  EXPECT_EQ(KVCache(c).config().scale_dtype, StorageType::float16);
  EXPECT_EQ(KVCache(c).k_channel_scales<float16>().size(), static_cast<std::size_t>(kBatch * 7 * kKvHeads * 16));
  c.dtype = StorageType::int8;
  EXPECT_EQ(KVCache(c).config().scale_dtype, StorageType::float32);
  c.scale_dtype = StorageType::float32;
  c.dtype = StorageType::int4;
  EXPECT_EQ(KVCache(c).config().scale_dtype, StorageType::float32);
}

// Unset, the float window is kInt4FloatWindow for int4 (capped at the capacity) and none
// for the other storages; an explicit 0 is kept. The default changes what is attended:
// the newest 32 tokens are read exact, so the cache's output differs from a windowless one.
TEST(KVCacheInt4, KeepsAFloatWindowUnlessAsked) {
  KVCacheConfig c = int4_config(16, 16);
  c.float_window.reset();
  EXPECT_EQ(KVCache(c).config().float_window, kInt4FloatWindow);
  c.capacity = 20;
  EXPECT_EQ(KVCache(c).config().float_window, 20);
  c.capacity = kCapacity;
  c.dtype = StorageType::int8;
  EXPECT_EQ(KVCache(c).config().float_window, 0);
  c.dtype = StorageType::int4;
  c.float_window = 0;
  EXPECT_EQ(KVCache(c).config().float_window, 0);

  KVCacheConfig unset = int4_config(16, 16), none = int4_config(16, 16);
  unset.float_window.reset();
  KVCache with(unset), without(none);
  const Tensor<float, 4> k = outlier_keys(24, 16, 5), v = outlier_keys(24, 16, 6);
  with.append(k.cview(), v.cview());
  without.append(k.cview(), v.cview());
  EXPECT_EQ(with.quantized_lengths()[0], 0);  // all 24 tokens within the window of 32
  EXPECT_TRUE(without.quantized_lengths().empty());  // no window
  const auto [exact, exact_v] = with.stored(0);
  const auto [rounded, rounded_v] = without.stored(0);
  // Sequence 0's keys are the first 24·Hkv·d floats of k [B, T, Hkv, d].
  const std::vector<float> appended(k.data(), k.data() + exact.size());
  EXPECT_EQ(exact, appended);
  EXPECT_NE(rounded, appended);
}

TEST(KVCacheInt4, BadConfigsAndArgumentsAreNamed) {
  KVCacheConfig c = int4_config(16, 16);
  c.scale_dtype = StorageType::bfloat16;
  expect_error([&] { KVCache{c}; }, "qkv::KVCache: config.scale_dtype: expected float32 or float16, got bfloat16");
  c = int4_config(16, 16, 0, false, 32, StorageType::float16);
  c.dtype = StorageType::int8;
  expect_error([&] { KVCache{c}; }, "config.scale_dtype: float16 scales are for int4 caches");
  c = int4_config(16, 16);
  c.key_scales = KeyScales::row;
  expect_error([&] { KVCache{c}; }, "config.key_scales: int4 keys are scaled per channel (KeyScales::channel)");
  c = int4_config(16, 16, 8);
  c.key_scales = KeyScales::row;
  c.dtype = StorageType::int8;
  expect_error([&] { KVCache{c}; }, "config.float_window: a float window is for caches with channel-scaled keys");
  c = int4_config(16, 16, kCapacity + 1);
  expect_error([&] { KVCache{c}; }, "config.float_window: expected 0..112");
  c = int4_config(16, 16, -1);
  expect_error([&] { KVCache{c}; }, "config.float_window: expected 0..112");

  KVCacheConfig windowed = int4_config(16, 16, 8);
  windowed.dtype = StorageType::int8;
  expect_error([&] { (void)KVCache(windowed).views<std::int8_t>(); }, "qkv::KVCache::views: the cache has a float window");
  expect_error([&] { (void)KVCache(int4_config(16, 16)).views<std::int8_t>(); },
               "qkv::KVCache::views: the cache stores int4, asked for int8");
  const std::vector<int64_t> cu{0, 1}, lengths{1};
  // An int4 plan runs over a KVCache only: BatchArgs cannot describe int4 rows.
  const BatchPlan int4_plan({.cu_seqlens_q = std::span<const int64_t>(cu), .cache_lengths = std::span<const int64_t>(lengths),
                             .num_heads = 2, .num_kv_heads = 2, .head_dim = 16, .storage = StorageType::int4},
                            AttentionOptions{});
  Tensor<float, 4> plain({1, 4, 2, 16});
  Tensor<float, 3> q1({1, 2, 16}), out1({1, 2, 16});
  expect_error([&] {
    int4_plan.run(BatchArgs<float>{.q = q1.cview(), .k_cache = plain.cview(), .v_cache = plain.cview(), .out = out1.view()});
  }, "qkv::BatchPlan::run: k_cache: expected int4 elements (the plan's layout.storage), got float32");

  // attend's arguments, named as qkv::decode names them; nothing written on a failure.
  KVCache cache(int4_config(16, 8, 4));
  const auto k = test::random_tensor<float, 4>({kBatch, 10, kKvHeads, 16}, 81);
  cache.append(k.cview(), k.cview());
  Tensor<float, 4> q({kBatch, 1, 4, 16}), out({kBatch, 1, 4, 16}), narrow_q({kBatch, 1, 4, 8}), bad_out({kBatch, 1, 4, 8});
  Tensor<float, 4> odd_heads({kBatch, 1, 3, 16}), one_seq({1, 1, 4, 16});
  expect_error([&] { cache.attend(narrow_q.cview(), out.view(), {}, AttentionOptions{}); },
               "qkv::decode: q.shape[3] (head_dim): expected 16 (the cache's head_dim), got 8");
  expect_error([&] { cache.attend(odd_heads.cview(), out.view(), {}, AttentionOptions{}); },
               "qkv::decode: q.shape[2] (heads): expected a multiple of the cache's kv_heads = 2");
  expect_error([&] { cache.attend(one_seq.cview(), out.view(), {}, AttentionOptions{}); },
               "qkv::decode: q.shape[0] (batch): expected 2 (the cache's batch), got 1");
  expect_error([&] { cache.attend(q.cview(), bad_out.view(), {}, AttentionOptions{}); },
               "qkv::decode: out.shape[3] (head_dim): expected 16 (the cache's v_dim), got 8");
  AttentionOptions dropout;
  dropout.dropout.p = 0.5f;
  expect_error([&] { cache.attend(q.cview(), out.view(), {}, dropout); }, "options.dropout: not supported for caches");
  for (std::size_t x = 0; x < out.size(); ++x) ASSERT_EQ(out[x], 0.0f);
  expect_error([&] { (void)cache.stored(2); }, "qkv::KVCache::stored: seq: expected 0..1, got 2");
}

}  // namespace
}  // namespace qkv
