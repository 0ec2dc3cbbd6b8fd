// qkv::KVCache: appends round once to the storage type and never move memory; attend()
// equals the fp64 reference on the stored values (bottom-right aligned); paged and
// contiguous caches give the same bits; bad calls throw and change nothing.
#include <gtest/gtest.h>

#include <qkv/kv_cache.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include "test_support.hpp"

namespace qkv {
namespace {

KVCacheConfig config(StorageType type, bool paged, int64_t block_size = 16) {
  return {.batch = 3, .capacity = 100, .kv_heads = 2, .head_dim = 32, .v_dim = 24, .dtype = type,
          .paged = paged, .block_size = block_size};
}

template <class T>
float rounded(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return static_cast<float>(T(x));
}

float round_to(StorageType type, float x) {
  switch (type) {
    case StorageType::bfloat16: return rounded<bfloat16>(x);
    case StorageType::float16: return rounded<float16>(x);
    default: return x;
  }
}

// The cache's contents, kept on the side in double as the reference sees them.
struct Mirror {
  Tensor<double, 4> k{{3, 100, 2, 32}}, v{{3, 100, 2, 24}};
  std::vector<int64_t> lengths = std::vector<int64_t>(3, 0);

  void append(StorageType type, const Tensor<float, 4>& k_new, const Tensor<float, 4>& v_new,
              const std::vector<int64_t>& seqs) {
    for (std::size_t n = 0; n < seqs.size(); ++n) {
      const int64_t b = seqs[n];
      for (int64_t t = 0; t < k_new.shape()[1]; ++t, ++lengths[static_cast<std::size_t>(b)]) {
        const int64_t j = lengths[static_cast<std::size_t>(b)];
        for (int64_t h = 0; h < 2; ++h) {
          store(type, &k_new(static_cast<int64_t>(n), t, h, 0), 32, &k(b, j, h, 0));
          store(type, &v_new(static_cast<int64_t>(n), t, h, 0), 24, &v(b, j, h, 0));
        }
      }
    }
  }

  // One row as the cache holds it: rounded once, or (int8) quantized with the row's
  // scale max|x|/127 to the nearest integer, exactly q·scale in double.
  static void store(StorageType type, const float* x, int64_t count, double* out) {
    if (type != StorageType::int8) {
      for (int64_t c = 0; c < count; ++c) out[c] = round_to(type, x[c]);
      return;
    }
    float largest = 0.0f;
    for (int64_t c = 0; c < count; ++c) largest = std::max(largest, std::abs(x[c]));
    const float scale = largest / 127.0f;
    for (int64_t c = 0; c < count; ++c)
      out[c] = scale == 0.0f ? 0.0 : static_cast<double>(std::nearbyint(x[c] / scale)) * scale;
  }
};

struct Step {
  Tensor<float, 4> out;
  Tensor<float, 3> lse;
};

Step attend(const KVCache& cache, const Tensor<float, 4>& q) {
  const auto& s = q.shape();
  Step r{Tensor<float, 4>({s[0], s[1], s[2], 24}), Tensor<float, 3>({s[0], s[2], s[1]})};
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  options.execution.threads = 2;
  cache.attend(q.cview(), r.out.view(), r.lse.view(), options);
  return r;
}

double worst_error(const Tensor<float, 4>& got, const Tensor<double, 4>& ref) {
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - ref[i]));
  return worst;
}

void run_generation(StorageType type) {
  SCOPED_TRACE(storage_name(type));
  KVCache contiguous(config(type, false)), paged(config(type, true, 16)), paged_odd(config(type, true, 7));
  const void* k_memory = contiguous.k_data();
  Mirror mirror;
  std::uint64_t seed = 100;
  auto append_all = [&](const std::vector<int64_t>& seqs, int64_t tokens) {
    const auto n = static_cast<int64_t>(seqs.size());
    const auto k = test::random_tensor<float, 4>({n, tokens, 2, 32}, ++seed);
    const auto v = test::random_tensor<float, 4>({n, tokens, 2, 24}, ++seed);
    for (KVCache* cache : {&contiguous, &paged, &paged_odd}) cache->append(k.cview(), v.cview(), seqs);
    mirror.append(type, k, v, seqs);
  };
  // Prompts of different lengths (sequence 2 starts later), then decode steps.
  append_all({0, 1}, 20);
  append_all({1}, 13);
  append_all({2}, 1);
  for (int step = 0; step < 6; ++step) {
    append_all({0, 1, 2}, step == 3 ? 3 : 1);  // step 3: three tokens at once (speculative)
    const int64_t tokens = step == 3 ? 3 : 1;
    const auto q = test::random_tensor<float, 4>({3, tokens, 8, 32}, ++seed);
    const Step a = attend(contiguous, q), b = attend(paged, q), c = attend(paged_odd, q);
    EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)), 0) << step;
    EXPECT_EQ(std::memcmp(a.out.data(), c.out.data(), a.out.size() * sizeof(float)), 0) << step;
    EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)), 0) << step;

    Tensor<double, 4> qd(q.shape()), ref({3, tokens, 8, 24});
    for (std::size_t i = 0; i < q.size(); ++i) qd[i] = q[i];
    AttentionOptions options;
    options.causal = Causal::bottom_right;
    options.key_lengths = mirror.lengths;
    attention_forward({.q = qd.cview(), .k = mirror.k.cview(), .v = mirror.v.cview(), .out = ref.view()}, options);
    // O(1) outputs, ≤ 50 keys, d = 32: fp32 accumulation stays within ~1e-6.
    EXPECT_LE(worst_error(a.out, ref), 2e-6) << step;
  }
  EXPECT_EQ(contiguous.k_data(), k_memory);  // appends never reallocate
  EXPECT_EQ(contiguous.lengths()[0], 20 + 8);
  EXPECT_EQ(contiguous.lengths()[2], 1 + 8);
}

TEST(KVCache, GenerationMatchesTheReferenceForEveryStorage) {
  run_generation(StorageType::float32);
  run_generation(StorageType::bfloat16);
  run_generation(StorageType::float16);
  run_generation(StorageType::int8);
}

// int8: each stored value within half its row's scale of the appended one, the row's
// largest magnitude exactly ±127·scale; an all-zero row has scale 0, a row with NaN or
// inf scale NaN (attention over it gives NaN, as other storage types do).
TEST(KVCache, Int8RowsAreWithinHalfTheirScale) {
  KVCache cache({.batch = 1, .capacity = 8, .kv_heads = 2, .head_dim = 64, .dtype = StorageType::int8});
  auto k = test::random_tensor<float, 4>({1, 3, 2, 64}, 5);
  const auto v = test::random_tensor<float, 4>({1, 3, 2, 64}, 6);
  for (int64_t x = 0; x < 64; ++x) {
    k(0, 1, 0, x) = 0.0f;              // an all-zero row
    k(0, 0, 1, x) *= 1000.0f;          // a large row
  }
  cache.append(k.cview(), v.cview());
  const auto* q = static_cast<const std::int8_t*>(cache.k_data());
  const std::span<const float> scales = cache.k_scales();
  ASSERT_EQ(scales.size(), 8u * 2u);
  for (int64_t j = 0; j < 3; ++j)
    for (int64_t h = 0; h < 2; ++h) {
      const float scale = scales[static_cast<std::size_t>(j * 2 + h)];
      int largest = 0;
      for (int64_t x = 0; x < 64; ++x) {
        const int stored = q[(j * 2 + h) * 64 + x];
        largest = std::max(largest, std::abs(stored));
        EXPECT_LE(std::abs(k(0, j, h, x) - static_cast<float>(stored) * scale), 0.5f * scale * (1.0f + 1e-6f))
            << j << " " << h << " " << x;
      }
      if (j == 1 && h == 0) {
        EXPECT_EQ(scale, 0.0f);
        EXPECT_EQ(largest, 0);
      } else {
        EXPECT_EQ(largest, 127);
      }
    }

  // A row too small for a representable scale (largest/127 rounds to 0): zeros, scale 0.
  Tensor<float, 4> tiny({1, 1, 2, 64});
  for (std::size_t i = 0; i < tiny.size(); ++i) tiny[i] = (i % 2 == 0 ? 1 : -1) * 3e-44f;
  KVCache small({.batch = 1, .capacity = 2, .kv_heads = 2, .head_dim = 64, .dtype = StorageType::int8});
  small.append(tiny.cview(), tiny.cview());
  EXPECT_EQ(small.k_scales()[0], 0.0f);
  for (int64_t x = 0; x < 64; ++x) EXPECT_EQ(static_cast<const std::int8_t*>(small.k_data())[x], 0);

  Tensor<float, 4> bad({1, 1, 2, 64}), q_new({1, 1, 2, 64});
  bad(0, 0, 0, 5) = std::nanf("");
  cache.append(bad.cview(), bad.cview());
  EXPECT_TRUE(std::isnan(cache.k_scales()[3 * 2 + 0]));
  EXPECT_EQ(cache.k_scales()[3 * 2 + 1], 0.0f);  // head 1's row is finite (zeros)
  Tensor<float, 4> out({1, 1, 2, 64});
  cache.attend(q_new.cview(), out.view());
  EXPECT_TRUE(std::isnan(out(0, 0, 0, 0)));  // head 0 sees the NaN row
  EXPECT_FALSE(std::isnan(out(0, 0, 1, 0)));
}

// int8 caches need their scales, other caches take none; the shapes are checked.
TEST(KVCache, Int8DecodeArgumentsAreChecked) {
  KVCache cache({.batch = 1, .capacity = 8, .kv_heads = 2, .head_dim = 16, .dtype = StorageType::int8});
  const auto k = test::random_tensor<float, 4>({1, 4, 2, 16}, 9);
  cache.append(k.cview(), k.cview());
  Tensor<float, 4> q({1, 1, 4, 16}), out({1, 1, 4, 16});
  auto expect_error = [&](DecodeArgs<std::int8_t> args, const std::string& needle) {
    args.q = q.cview();
    args.out = out.view();
    try {
      decode(args);
      ADD_FAILURE() << "no error; expected " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  DecodeArgs<std::int8_t> args = cache.views<std::int8_t>();
  args.k_scale = {};
  expect_error(args, "k_scale: expected one float32 scale per cached row");
  args = cache.views<std::int8_t>();
  args.v_scale.shape[2] = 1;
  expect_error(args, "v_scale.shape[2] (kv heads): expected 2");

  KVCache floats({.batch = 1, .capacity = 8, .kv_heads = 2, .head_dim = 16});
  DecodeArgs<float> fargs = floats.views<float>();
  const std::vector<float> scale(16, 1.0f);
  fargs.k_scale = View3<const float>::contiguous(scale.data(), {1, 8, 2});
  fargs.q = q.cview();
  fargs.out = out.view();
  EXPECT_THROW(
      {
        try {
          decode(fargs);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("k_scale: only int8 and float8 caches take scales"), std::string::npos);
          throw;
        }
      },
      Error);
}

TEST(KVCache, StoresValuesRoundedOnce) {
  KVCache cache({.batch = 1, .capacity = 4, .kv_heads = 1, .head_dim = 2, .dtype = StorageType::bfloat16});
  Tensor<float, 4> k({1, 1, 1, 2}), v({1, 1, 1, 2});
  k[0] = 1.0f + 0x1p-8f;  // tie: rounds to even (1.0)
  k[1] = 1.0f + 3 * 0x1p-8f;
  cache.append(k.cview(), v.cview());
  const auto* bits = static_cast<const bfloat16*>(cache.k_data());
  EXPECT_EQ(bits[0].bits, 0x3F80);
  EXPECT_EQ(bits[1].bits, 0x3F82);
}

TEST(KVCache, PagedBlocksComeFromThePoolAndGoBack) {
  KVCache cache({.batch = 2, .capacity = 64, .kv_heads = 1, .head_dim = 4, .paged = true, .block_size = 16,
                 .num_blocks = 5});
  EXPECT_EQ(cache.free_blocks(), 5);
  const auto k = test::random_tensor<float, 4>({1, 33, 1, 4}, 1);
  const std::vector<int64_t> first{0}, second{1};
  cache.append(k.cview(), k.cview(), first);  // 3 blocks
  EXPECT_EQ(cache.free_blocks(), 2);
  EXPECT_EQ(cache.block_table()[0], 0);
  EXPECT_EQ(cache.block_table()[3], -1);
  try {
    cache.append(k.cview(), k.cview(), second);  // needs 3, 2 free
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the pool has 2 free blocks, 3 are needed"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.lengths()[1], 0);  // nothing changed
  EXPECT_EQ(cache.free_blocks(), 2);
  cache.reset(0);
  EXPECT_EQ(cache.free_blocks(), 5);
  cache.append(k.cview(), k.cview(), second);
  EXPECT_EQ(cache.lengths()[1], 33);
}

using test::expect_error;

TEST(KVCache, BadCallsNameTheArgumentAndChangeNothing) {
  expect_error([] { KVCache({.batch = 0, .capacity = 4, .head_dim = 2}); }, "config.batch: expected >= 1, got 0");
  expect_error([] { KVCache({.capacity = 4, .head_dim = 0}); }, "config.head_dim");
  expect_error([] { KVCache({.capacity = 4, .head_dim = 2, .paged = true, .block_size = 0}); },
               "config.block_size: expected 1..4096");
  KVCache cache({.batch = 2, .capacity = 4, .kv_heads = 1, .head_dim = 2});
  const auto k3 = test::random_tensor<float, 4>({2, 3, 1, 2}, 1);
  const auto k2 = test::random_tensor<float, 4>({2, 2, 1, 2}, 2);
  const auto bad_dim = test::random_tensor<float, 4>({2, 1, 1, 3}, 3);
  cache.append(k3.cview(), k3.cview());
  expect_error([&] { cache.append(k2.cview(), k2.cview()); }, "sequence 0 holds 3 of 4 keys; 2 more do not fit");
  expect_error([&] { cache.append(bad_dim.cview(), bad_dim.cview()); }, "k.shape[3] (head_dim): expected 2");
  expect_error([&] { cache.append(k3.cview(), k2.cview()); }, "v.shape[1] (tokens): expected 3");
  const std::vector<int64_t> twice{1, 1}, unknown{0, 5};
  const auto k1 = test::random_tensor<float, 4>({2, 1, 1, 2}, 5);
  expect_error([&] { cache.append(k1.cview(), k1.cview(), twice); }, "seqs[1]: sequence 1 appears twice");
  expect_error([&] { cache.append(k1.cview(), k1.cview(), unknown); }, "seqs[1]: expected a sequence 0..1, got 5");
  EXPECT_EQ(cache.lengths()[0], 3);
  EXPECT_EQ(cache.lengths()[1], 3);
  expect_error([&] { (void)cache.views<bfloat16>(); }, "the cache stores float32, asked for bfloat16");
  const auto q = test::random_tensor<float, 4>({2, 1, 3, 5}, 4);
  Tensor<float, 4> out({2, 1, 3, 2});
  expect_error([&] { cache.attend(q.cview(), out.view()); }, "qkv::decode: k_cache.shape[3] (head_dim): expected 5");
}

}  // namespace
}  // namespace qkv
