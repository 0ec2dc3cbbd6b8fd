// qkv::KVCache::index_topk — the indexer over a cache of index keys — against
// qkv::index_topk over the same cache's stored keys (KVCache::stored: the exact float
// values the cache form reads). Both compute every score the same way from the same float
// keys, so the results must be the same bits (not merely the same sets), on every storage
// type, contiguous and paged, every compiled SIMD target and any thread count; and the
// reference backend over the cache must equal the reference over the stored keys.
// qkv::index_topk itself is checked against the fp64 reference in test_index_topk.cpp.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "cache_test_support.hpp"
#include "cpu/dot_products.hpp"
#include "forced_vdpbf16ps.hpp"
#include "simd_targets.hpp"
#include "test_support.hpp"
#include "qkv/index_topk.hpp"
#include "qkv/kv_cache.hpp"

namespace qkv::test {
namespace {

struct Storage {
  const char* name;
  StorageType dtype;
  KeyScales key_scales = KeyScales::row;
  int64_t float_window = 0;
};

const std::vector<Storage>& storages() {
  static const std::vector<Storage> all{
      {"float32", StorageType::float32},           {"bfloat16", StorageType::bfloat16},
      {"float16", StorageType::float16},           {"int8 rows", StorageType::int8},
      {"int8 channels", StorageType::int8, KeyScales::channel},
      {"int8 channels + window", StorageType::int8, KeyScales::channel, 16},
      {"int4", StorageType::int4, KeyScales::channel},
      {"int4 + window", StorageType::int4, KeyScales::channel, 16}};
  return all;
}

// A cache of index keys (kv_heads 1, v_dim 1: the values are never read) holding
// lengths[b] keys in sequence b, appended in two steps of outlier-channel keys.
KVCache index_cache(const Storage& s, bool paged, int64_t di, const std::vector<int64_t>& lengths, uint64_t seed) {
  const int64_t batch = static_cast<int64_t>(lengths.size());
  int64_t capacity = 0;
  for (int64_t length : lengths) capacity = std::max(capacity, length + 3);
  KVCacheConfig config{.batch = batch, .capacity = capacity, .kv_heads = 1, .head_dim = di, .v_dim = 1,
                       .dtype = s.dtype, .paged = paged, .block_size = 32, .key_scales = s.key_scales,
                       .float_window = s.float_window};
  KVCache cache(config);
  const Tensor<float, 4> k = outlier_keys(batch, capacity, 1, di, seed);
  Tensor<float, 4> v({batch, capacity, 1, 1});
  fill(v, 0.0f);
  for (int64_t b = 0; b < batch; ++b) {
    append_sequence(cache, k, v, b, 0, lengths[b] / 3);
    append_sequence(cache, k, v, b, lengths[b] / 3, lengths[b]);
  }
  return cache;
}

// The cache's stored keys as a dense [B, max length, di] tensor (zero past each length).
Tensor<float, 3> stored_keys(const KVCache& cache) {
  const int64_t batch = cache.config().batch, di = cache.config().head_dim;
  int64_t longest = 1;
  for (int64_t length : cache.lengths()) longest = std::max(longest, length);
  Tensor<float, 3> k({batch, longest, di});
  fill(k, 0.0f);
  for (int64_t b = 0; b < batch; ++b) {
    const std::vector<float> rows = cache.stored(b).first;  // [length, 1, di]
    for (std::size_t x = 0; x < rows.size(); ++x) k(b, static_cast<int64_t>(x) / di, static_cast<int64_t>(x) % di) = rows[x];
  }
  return k;
}

AttentionOptions options(Backend backend, int threads) {
  AttentionOptions o;
  o.causal = Causal::bottom_right;
  o.execution.backend = backend;
  o.execution.threads = threads;
  return o;
}

struct Query {
  Tensor<float, 4> q;
  Tensor<float, 3> weights;
  Query(int64_t batch, int64_t q_len, int64_t heads, int64_t di, uint64_t seed)
      : q(random_tensor<float, 4>({batch, q_len, heads, di}, seed)),
        weights(random_tensor<float, 3>({batch, q_len, heads}, seed + 1)) {}
};

Tensor<int32_t, 3> from_cache(const KVCache& cache, const Query& in, int64_t topk, Backend backend, int threads) {
  const auto& s = in.q.shape();
  Tensor<int32_t, 3> out({s[0], s[1], topk});
  fill(out, int32_t{-7});
  cache.index_topk(in.q.cview(), in.weights.cview(), out.view(), options(backend, threads));
  return out;
}

Tensor<int32_t, 3> from_stored(const KVCache& cache, const Query& in, int64_t topk, Backend backend, int threads) {
  const auto& s = in.q.shape();
  const Tensor<float, 3> k = stored_keys(cache);
  Tensor<int32_t, 3> out({s[0], s[1], topk});
  fill(out, int32_t{-7});
  AttentionOptions o = options(backend, threads);
  const std::vector<int64_t> lengths(cache.lengths().begin(), cache.lengths().end());
  o.key_lengths = lengths;
  index_topk(IndexTopkArgs<float>{in.q.cview(), k.cview(), in.weights.cview(), out.view()}, o);
  return out;
}

void expect_same(const Tensor<int32_t, 3>& a, const Tensor<int32_t, 3>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t x = 0; x < a.size(); ++x) ASSERT_EQ(a[x], b[x]) << what << " at flat index " << x;
}

TEST(IndexTopkCache, EqualsIndexTopkOverTheStoredKeysEveryStorageAndLayout) {
  const int64_t di = 32, heads = 8;
  for (const Storage& s : storages())
    for (bool paged : {false, true})
      for (int64_t q_len : {1, 5}) {
        SCOPED_TRACE(testing::Message() << s.name << (paged ? " paged" : " contiguous") << " q_len " << q_len);
        const KVCache cache = index_cache(s, paged, di, {700, 333}, 11);
        const Query in(2, q_len, heads, di, 21);
        const int64_t topk = 96;
        const Tensor<int32_t, 3> ref_stored = from_stored(cache, in, topk, Backend::reference, 1);
        expect_same(from_cache(cache, in, topk, Backend::reference, 1), ref_stored, "reference");
        const Tensor<int32_t, 3> cpu_stored = from_stored(cache, in, topk, Backend::cpu, 2);
        for_each_simd_target([&](int64_t) {
          expect_same(from_cache(cache, in, topk, Backend::cpu, 2), from_stored(cache, in, topk, Backend::cpu, 2),
                      "cpu");
        });
        // Far apart scores rank the same in float as in double: the fast path's first key
        // is the reference's on these random rows.
        const Tensor<int32_t, 3> cpu = from_cache(cache, in, topk, Backend::cpu, 2);
        for (int64_t b = 0; b < 2; ++b)
          for (int64_t i = 0; i < q_len; ++i) EXPECT_EQ(cpu(b, i, 0), ref_stored(b, i, 0));
      }
}

// bfloat16 queries (a bf16 model's) over every storage: the same bits as qkv::index_topk
// over the stored keys — with the float32 FMAs (the queries widened exactly; the unit
// forced off, or Precision::exact), and for a bfloat16 cache with the unit forced on,
// the dense bfloat16 call on that unit (vdpbf16ps, the AMX tiles) over the same bf16 rows (each key's logit summed
// in the same order whether its rows come a page or a block at a time).
TEST(IndexTopkCache, Bfloat16QueriesEqualTheDenseCallEveryStorage) {
  const int64_t di = 32, heads = 8, topk = 96;
  const auto check = [&](bool dots, Precision precision) {
    for (const Storage& s : storages())
      for (bool paged : {false, true}) {
        SCOPED_TRACE(testing::Message() << s.name << (paged ? " paged" : " contiguous") << (dots ? " dots" : "")
                                        << (precision == Precision::exact ? " exact" : ""));
        const KVCache cache = index_cache(s, paged, di, {700, 333}, 13);
        const Query in(2, 3, heads, di, 23);
        Tensor<bfloat16, 4> q16(in.q.shape());
        Tensor<float, 4> q_wide(in.q.shape());
        for (std::size_t x = 0; x < q16.size(); ++x) q_wide[x] = static_cast<float>(q16[x] = bfloat16(in.q[x]));
        AttentionOptions o = options(Backend::cpu, 2);
        o.precision = precision;
        const Tensor<float, 3> k = stored_keys(cache);
        const std::vector<int64_t> lengths(cache.lengths().begin(), cache.lengths().end());
        AttentionOptions dense = o;
        dense.key_lengths = lengths;
        Tensor<int32_t, 3> want({2, 3, topk});
        if (dots && s.dtype == StorageType::bfloat16 && precision == Precision::fast) {
          Tensor<bfloat16, 3> k16(k.shape());
          for (std::size_t x = 0; x < k.size(); ++x) k16[x] = bfloat16(k[x]);  // exact: stored bf16 values
          index_topk(IndexTopkArgs<bfloat16>{q16.cview(), k16.cview(), in.weights.cview(), want.view()}, dense);
        } else {
          index_topk(IndexTopkArgs<float>{q_wide.cview(), k.cview(), in.weights.cview(), want.view()}, dense);
        }
        for_each_simd_target([&](int64_t) {
          Tensor<int32_t, 3> got({2, 3, topk});
          cache.index_topk(q16.cview(), in.weights.cview(), got.view(), o);
          expect_same(got, want, "bf16 q");
        });
      }
  };
  cpu::set_dot_products_for_test(false);
  check(false, Precision::fast);
  cpu::set_dot_products_for_test(std::nullopt);
  check(false, Precision::exact);
  if (cpu::cpu_has_bf16_dot()) {
    const ForcedVdpbf16ps forced;
    check(true, Precision::fast);
  }
  if (cpu::cpu_has_amx_bf16()) {  // the tiles likewise: a page's rows or a block's, the same sums
    const ForcedAmx forced;
    check(true, Precision::fast);
  }
}

TEST(IndexTopkCache, SameBitsForAnyThreadCountWithSplitKeys) {
  // One decode row against 3000 keys: the keys are split across threads and merged.
  for (const Storage& s : {storages()[1], storages()[3], storages()[6]})
    for (bool paged : {false, true}) {
      SCOPED_TRACE(testing::Message() << s.name << (paged ? " paged" : " contiguous"));
      const KVCache cache = index_cache(s, paged, 64, {3000}, 3);
      const Query in(1, 1, 16, 64, 4);
      const Tensor<int32_t, 3> one = from_cache(cache, in, 300, Backend::cpu, 1);
      expect_same(one, from_stored(cache, in, 300, Backend::cpu, 1), "stored");
      for (int threads : {2, 3, 8}) expect_same(one, from_cache(cache, in, 300, Backend::cpu, threads), "threads");
    }
}

TEST(IndexTopkCache, FewerKeysThanTopkPadWithMinusOne) {
  // Sequence 1 holds 5 keys, sequence 2 none: rows list what they may see, then −1.
  const KVCache cache = index_cache(storages()[0], true, 16, {40, 5, 0}, 8);
  const Query in(3, 3, 4, 16, 9);
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    const Tensor<int32_t, 3> out = from_cache(cache, in, 10, backend, 2);
    for (int64_t i = 0; i < 3; ++i) {
      const int64_t sees[3] = {std::min<int64_t>(10, 38 + i), 3 + i, 0};  // bottom-right: length − 3 + i + 1
      for (int64_t b = 0; b < 3; ++b)
        for (int64_t t = 0; t < 10; ++t) EXPECT_EQ(out(b, i, t) == -1, t >= sees[b]) << b << " " << i << " " << t;
    }
  }
}

TEST(IndexTopkCache, TiesGoToTheLowerIndex) {
  const KVCache cache = index_cache(storages()[3], false, 16, {200}, 2);
  Query in(1, 2, 4, 16, 5);
  fill(in.q, 0.0f);  // every score 0
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    const Tensor<int32_t, 3> out = from_cache(cache, in, 12, backend, 2);
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t t = 0; t < 12; ++t) EXPECT_EQ(out(0, i, t), t);
  }
}

TEST(IndexTopkCache, BadArgumentsThrowNamingThemAndWriteNothing) {
  const KVCache cache = index_cache(storages()[0], false, 16, {20, 10}, 1);
  const Query in(2, 3, 4, 16, 2);
  Tensor<int32_t, 3> out({2, 3, 4});
  fill(out, int32_t{-7});
  auto expect_error = [&](auto&& call, const std::string& words) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one naming " << words;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("qkv::KVCache::index_topk: " + words), std::string::npos) << e.what();
    }
    for (std::size_t x = 0; x < out.size(); ++x) ASSERT_EQ(out[x], -7);
  };
  const Query wrong_dim(2, 3, 4, 8, 2);
  expect_error([&] { cache.index_topk(wrong_dim.q.cview(), wrong_dim.weights.cview(), out.view()); },
               "q.shape[3] (head_dim)");
  const Query wrong_batch(3, 3, 4, 16, 2);
  expect_error([&] { cache.index_topk(wrong_batch.q.cview(), in.weights.cview(), out.view()); }, "q.shape[0] (batch)");
  Tensor<float, 3> weights({2, 3, 5});
  expect_error([&] { cache.index_topk(in.q.cview(), weights.cview(), out.view()); }, "weights.shape[2] (heads)");
  AttentionOptions o;
  const std::vector<int64_t> lengths{20, 10};
  o.key_lengths = lengths;
  expect_error([&] { cache.index_topk(in.q.cview(), in.weights.cview(), out.view(), o); }, "options.key_lengths");
  o = AttentionOptions{};
  o.softcap = 3.0f;
  expect_error([&] { cache.index_topk(in.q.cview(), in.weights.cview(), out.view(), o); }, "options.softcap");
  KVCache two_heads(KVCacheConfig{.batch = 2, .capacity = 8, .kv_heads = 2, .head_dim = 16});
  expect_error([&] { two_heads.index_topk(in.q.cview(), in.weights.cview(), out.view()); }, "the cache has config.kv_heads = 2");
}

}  // namespace
}  // namespace qkv::test
