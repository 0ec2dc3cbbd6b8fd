// qkv::BatchPlan: a serving step (prefill chunks and decode tokens over one set of
// caches) planned once, run per layer.
//   - Every sequence's rows equal that sequence computed alone, bit for bit (batch
//     invariance): qkv::decode for ≤ 32 queries, attention_forward over the chunk's keys
//     for prefill chunks (their accuracy against the fp64 oracle is test_decode.cpp's and
//     test_cpu_attention.cpp's), for
//     query counts 0, 1, 3, 17, 40, 200, GQA, every storage type, contiguous and shuffled
//     paged caches, the variants, every compiled SIMD target; thread counts and cache
//     layouts give the same bits.
//   - Backend::reference of the plan equals decode's reference per sequence (bitwise:
//     the same fp64 loop), and the cpu plan is within 64 float ulps of it: a gross-error
//     check at these magnitudes (unit-normal inputs, logits O(1)), where decode's stated
//     bound (2× plain fp32 + 8 ulps, test_decode.cpp) has never needed more than ~16.
//   - execution.fixed_key_split: a token decoded alone gets the bits of the same row of a
//     prefill chunk, across the 1024-key chunk grid.
//   - Bad layouts and views: qkv::Error naming the argument and index, nothing written.
#include <gtest/gtest.h>

#include <qkv/attention.hpp>
#include <qkv/batch_plan.hpp>
#include <qkv/decode.hpp>
#include <qkv/error.hpp>
#include <qkv/kv_cache.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "simd_targets.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

// The sanitizer build (QKV_TEST_SMALL) checks the fp64 reference for float32 caches
// only: its unoptimized fp64 loops dominate the run there.
#ifdef QKV_TEST_SMALL
constexpr bool kSmall = true;
#else
constexpr bool kSmall = false;
#endif

struct StepSpec {
  std::vector<int64_t> queries;  // per sequence
  std::vector<int64_t> lengths;  // keys per sequence (its queries' included)
  int64_t q_heads = 8, kv_heads = 2, head_dim = 64, v_dim = 64;
  int64_t block_size = 0;        // 0: contiguous caches
  std::uint64_t seed = 11;
};

template <class T>
T stored(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return T(x);
}

// A step's inputs: packed q, and the caches holding each sequence's keys (rows past its
// length poisoned with NaN, int8 scales too), contiguous or as a shuffled pool.
template <class T>
struct Step {
  // int8 and float8: scaled per row (float8 usually takes a per-head scale, which is a
  // per-row view with strides 0; here every row has its own, which the API takes too).
  static constexpr bool kInt8 = std::is_same_v<T, std::int8_t> || is_float8(storage_type_of<T>);
  StepSpec spec;
  std::vector<int64_t> cu{0};
  int64_t capacity = 0, max_blocks = 0;
  Tensor<float, 3> q;
  Tensor<T, 4> k, v;
  Tensor<float, 3> k_scale, v_scale;
  Tensor<int32_t, 2> table;

  explicit Step(const StepSpec& s) : spec(s) {
    const auto batch = static_cast<int64_t>(s.queries.size());
    for (int64_t n : s.queries) cu.push_back(cu.back() + n);
    capacity = std::max<int64_t>(1, *std::max_element(s.lengths.begin(), s.lengths.end()));
    std::mt19937 rng(static_cast<unsigned>(s.seed));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    q = Tensor<float, 3>({cu.back(), s.q_heads, s.head_dim});
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = normal(rng);
    // Logical keys [B, capacity, Hkv, d], drawn in one order whatever the layout.
    Tensor<float, 4> lk({batch, capacity, s.kv_heads, s.head_dim}), lv({batch, capacity, s.kv_heads, s.v_dim});
    for (std::size_t i = 0; i < lk.size(); ++i) lk[i] = normal(rng);
    for (std::size_t i = 0; i < lv.size(); ++i) lv[i] = normal(rng);
    int64_t rows0 = batch, rows1 = capacity;
    std::vector<int32_t> order;
    if (s.block_size > 0) {
      max_blocks = (capacity + s.block_size - 1) / s.block_size;
      rows0 = batch * max_blocks + 2;  // blocks nobody uses
      rows1 = s.block_size;
      order.resize(static_cast<std::size_t>(rows0));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(s.seed) + 3));
      table = Tensor<int32_t, 2>({batch, max_blocks});
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t n = 0; n < max_blocks; ++n) table(b, n) = order[static_cast<std::size_t>(b * max_blocks + n)];
    }
    k = Tensor<T, 4>({rows0, rows1, s.kv_heads, s.head_dim});
    v = Tensor<T, 4>({rows0, rows1, s.kv_heads, s.v_dim});
    const T poison = std::is_same_v<T, std::int8_t> ? T{} : stored<T>(std::nanf(""));
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = poison;
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = poison;
    if constexpr (kInt8) {
      k_scale = Tensor<float, 3>({rows0, rows1, s.kv_heads});
      v_scale = Tensor<float, 3>({rows0, rows1, s.kv_heads});
      for (std::size_t i = 0; i < k_scale.size(); ++i) k_scale[i] = v_scale[i] = std::nanf("");
    }
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < s.lengths[static_cast<std::size_t>(b)]; ++j) {
        const int64_t r0 = s.block_size > 0 ? table(b, j / s.block_size) : b;
        const int64_t r1 = s.block_size > 0 ? j % s.block_size : j;
        for (int64_t h = 0; h < s.kv_heads; ++h) {
          store_row(&lk(b, j, h, 0), s.head_dim, &k(r0, r1, h, 0), kInt8 ? &k_scale(r0, r1, h) : nullptr);
          store_row(&lv(b, j, h, 0), s.v_dim, &v(r0, r1, h, 0), kInt8 ? &v_scale(r0, r1, h) : nullptr);
        }
      }
  }

  // int8: one scale per row, max|x|/127 (as KVCache quantizes).
  static void store_row(const float* x, int64_t n, T* dst, float* scale) {
    if constexpr (is_float8(storage_type_of<T>)) {
      float largest = 0.0f;
      for (int64_t c = 0; c < n; ++c) largest = std::max(largest, std::abs(x[c]));
      *scale = largest > 0.0f ? largest / T::kMax : 1.0f;
      for (int64_t c = 0; c < n; ++c) dst[c] = T(x[c] / *scale);
    } else if constexpr (kInt8) {
      float largest = 0.0f;
      for (int64_t c = 0; c < n; ++c) largest = std::max(largest, std::abs(x[c]));
      *scale = largest / 127.0f;
      for (int64_t c = 0; c < n; ++c)
        dst[c] = static_cast<std::int8_t>(*scale == 0.0f ? 0.0f : std::clamp(std::nearbyint(x[c] / *scale), -127.0f, 127.0f));
    } else {
      (void)scale;
      for (int64_t c = 0; c < n; ++c) dst[c] = stored<T>(x[c]);
    }
  }

  BatchLayout layout() const {
    BatchLayout l;
    l.cu_seqlens_q = std::span<const int64_t>(cu);
    l.cache_lengths = std::span<const int64_t>(spec.lengths);
    if (spec.block_size > 0) {
      l.block_table = table.cview();
      l.block_size = spec.block_size;
    }
    l.num_heads = spec.q_heads;
    l.num_kv_heads = spec.kv_heads;
    l.head_dim = spec.head_dim;
    l.v_dim = spec.v_dim;
    l.storage = storage_type_of<T>;
    return l;
  }

  BatchArgs<T> args(Tensor<float, 3>& out, Tensor<float, 2>& lse) const {
    BatchArgs<T> a;
    a.q = q.cview();
    a.k_cache = k.cview();
    a.v_cache = v.cview();
    a.out = out.view();
    a.lse = lse.view();
    if constexpr (kInt8) {
      a.k_scale = k_scale.cview();
      a.v_scale = v_scale.cview();
    }
    return a;
  }

  // Sequence b's stored keys (or values) as float [1, L, Hkv, dim] (int8: value · scale).
  Tensor<float, 4> stored_rows(int64_t b, bool keys) const {
    const int64_t length = spec.lengths[static_cast<std::size_t>(b)], dim = keys ? spec.head_dim : spec.v_dim;
    Tensor<float, 4> rows({1, length, spec.kv_heads, dim});
    const Tensor<T, 4>& from = keys ? k : v;
    for (int64_t j = 0; j < length; ++j)
      for (int64_t h = 0; h < spec.kv_heads; ++h) {
        const int64_t r0 = spec.block_size > 0 ? table(b, j / spec.block_size) : b;
        const int64_t r1 = spec.block_size > 0 ? j % spec.block_size : j;
        for (int64_t c = 0; c < dim; ++c) {
          if constexpr (kInt8) rows(0, j, h, c) = static_cast<float>(from(r0, r1, h, c)) * (keys ? k_scale : v_scale)(r0, r1, h);
          else rows(0, j, h, c) = static_cast<float>(from(r0, r1, h, c));
        }
      }
    return rows;
  }

  // Sequence b alone through qkv::decode: its q rows [1, n, Hq, d], its cache (one row
  // of the table, or its batch entry), its length.
  DecodeArgs<T> alone(int64_t b, Tensor<float, 4>& out, Tensor<float, 3>& lse, const std::vector<int64_t>& length) const {
    const int64_t n = cu[b + 1] - cu[b], H = spec.q_heads, d = spec.head_dim;
    DecodeArgs<T> a;
    a.q = View4<const float>(q.data() + cu[b] * H * d, {1, n, H, d}, {n * H * d, H * d, d, 1});
    const auto entry = [&](const auto& t) {
      using E = std::remove_cvref_t<decltype(t.data()[0])>;
      const auto view = t.cview();
      auto shape = view.shape;
      auto strides = view.strides;
      const int64_t skip = spec.block_size > 0 ? 0 : b * strides[0];
      if (spec.block_size == 0) shape[0] = 1;
      return TensorView<const E, std::tuple_size_v<decltype(shape)>>(t.data() + skip, shape, strides);
    };
    a.k_cache = entry(k);
    a.v_cache = entry(v);
    if constexpr (kInt8) {
      a.k_scale = entry(k_scale);
      a.v_scale = entry(v_scale);
    }
    if (spec.block_size > 0)
      a.block_table = TensorView<const int32_t, 2>(table.data() + b * max_blocks, {1, max_blocks}, {max_blocks, 1});
    a.cache_lengths = length;
    a.out = out.view();
    a.lse = lse.view();
    return a;
  }
};

struct Results {
  Tensor<float, 3> out;
  Tensor<float, 2> lse;
};

template <class T>
Results run_plan(const Step<T>& step, const AttentionOptions& options) {
  Results r{Tensor<float, 3>({step.cu.back(), step.spec.q_heads, step.spec.v_dim}),
            Tensor<float, 2>({step.spec.q_heads, step.cu.back()})};
  const BatchPlan plan(step.layout(), options);
  plan.run(step.args(r.out, r.lse));
  return r;
}

bool same_bits(const float* a, const float* b, std::size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

// Sequence b's rows of the plan's results equal b computed alone, bit for bit: by
// qkv::decode (the split-K schedule) for ≤ 32 queries or with fixed_key_split, else (a
// prefill chunk) by attention_forward over its stored keys as float rows (the tiled
// schedule, which the plan runs chunks on).
template <class T>
void expect_rows_of_alone(const Step<T>& step, const Results& got, const AttentionOptions& options) {
  const StepSpec& s = step.spec;
  for (std::size_t b = 0; b + 1 < step.cu.size(); ++b) {
    const int64_t n = step.cu[b + 1] - step.cu[b];
    if (n == 0) continue;
    SCOPED_TRACE("sequence " + std::to_string(b) + " (" + std::to_string(n) + " queries)");
    Tensor<float, 4> out({1, n, s.q_heads, s.v_dim});
    Tensor<float, 3> lse({1, s.q_heads, n});
    const std::vector<int64_t> length{s.lengths[b]};
    const bool chunk = n > 32 && !options.execution.fixed_key_split && options.execution.backend != Backend::reference;
    if (chunk) {
      const Tensor<float, 4> keys = step.stored_rows(static_cast<int64_t>(b), true);
      const Tensor<float, 4> values = step.stored_rows(static_cast<int64_t>(b), false);
      const int64_t H = s.q_heads, d = s.head_dim;
      const View4<const float> q(step.q.data() + step.cu[b] * H * d, {1, n, H, d}, {n * H * d, H * d, d, 1});
      attention_forward({.q = q, .k = keys.cview(), .v = values.cview(), .out = out.view(), .lse = lse.view()}, options);
    } else {
      decode(step.alone(static_cast<int64_t>(b), out, lse, length), options);
    }
    EXPECT_TRUE(same_bits(out.data(), &got.out(step.cu[b], 0, 0), out.size()));
    for (int64_t h = 0; h < s.q_heads; ++h)
      EXPECT_TRUE(same_bits(&lse(0, h, 0), &got.lse(h, step.cu[b]), static_cast<std::size_t>(n))) << "head " << h;
  }
}

double max_abs_difference(const Tensor<float, 3>& a, const Tensor<float, 3>& b, double& largest) {
  double worst = 0.0;
  largest = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
    largest = std::max(largest, std::abs(static_cast<double>(b[i])));
  }
  return worst;
}

// `reference`: also against the fp64 reference backend (once per case, not per SIMD
// target: the oracle does not depend on it).
template <class T>
void check_step(const StepSpec& s, const AttentionOptions& options, bool reference = true) {
  SCOPED_TRACE(std::string("storage ") + storage_name(storage_type_of<T>) + ", block_size " + std::to_string(s.block_size));
  const Step<T> step(s);
  const Results got = run_plan(step, options);
  expect_rows_of_alone(step, got, options);

  AttentionOptions one = options, many = options, exact = options;
  one.execution.threads = 1;
  many.execution.threads = 3;
  const Results by_one = run_plan(step, one), by_many = run_plan(step, many);
  EXPECT_TRUE(same_bits(by_one.out.data(), by_many.out.data(), by_one.out.size()));
  EXPECT_TRUE(same_bits(by_one.out.data(), got.out.data(), got.out.size()));

  if (!reference || (kSmall && !std::is_same_v<T, float>)) return;
  exact.execution.backend = Backend::reference;
  const Results ref = run_plan(step, exact);
  expect_rows_of_alone(step, ref, exact);
  double largest = 0.0;
  const double worst = max_abs_difference(got.out, ref.out, largest);
  EXPECT_LE(worst, 64.0 * std::numeric_limits<float>::epsilon() * std::max(1.0, largest));
  for (std::size_t i = 0; i < got.out.size(); ++i) ASSERT_TRUE(std::isfinite(got.out[i])) << "out[" << i << "]";
}

AttentionOptions serving() {
  AttentionOptions o;
  o.causal = Causal::bottom_right;
  o.execution.threads = 2;
  return o;
}

// Prefill chunks (with and without a cached prefix), decode tokens, empty sequences.
StepSpec mixed_step(int64_t block_size) {
  return StepSpec{.queries = {0, 1, 3, 17, 200, 1, 40, 0},
                  .lengths = {0, 301, 5, 17, 240, 700, 1100, 9},
                  .block_size = block_size};
}

void check_every_storage(bool reference) {
  for (int64_t block : {0, 16, 5}) {
    check_step<float>(mixed_step(block), serving(), reference);
    check_step<bfloat16>(mixed_step(block), serving(), reference);
    check_step<float16>(mixed_step(block), serving(), reference);
    check_step<std::int8_t>(mixed_step(block), serving(), reference);
    check_step<float8_e4m3fn>(mixed_step(block), serving(), reference);
    check_step<float8_e5m2>(mixed_step(block), serving(), reference);
  }
}

TEST(BatchPlan, EverySequenceIsItselfAloneForEveryStorageAndLayout) {
  test::for_each_simd_target([](int64_t) { check_every_storage(/*reference=*/false); });
  check_every_storage(/*reference=*/true);  // on this CPU's own target
}

TEST(BatchPlan, VariantsAndOddHeadSizes) {
  std::vector<float> slopes(8), sinks(8);
  for (int h = 0; h < 8; ++h) {
    slopes[h] = std::exp2(-static_cast<float>(h + 1));
    sinks[h] = 0.25f * static_cast<float>(h) - 1.0f;
  }
  StepSpec odd = mixed_step(16);
  odd.head_dim = 33;
  odd.v_dim = 20;
  AttentionOptions windowed = serving();
  windowed.window = {.left = 100, .right = 0};
  windowed.softcap = 30.0f;
  AttentionOptions alibi = serving();
  alibi.alibi_slopes = slopes;
  alibi.sinks = sinks;
  alibi.scale = 0.3;
  AttentionOptions full;  // causal none: every query sees every cached key
  full.execution.threads = 2;
  const auto check_all = [&](bool reference) {
    check_step<float>(odd, serving(), reference);
    check_step<bfloat16>(mixed_step(0), windowed, reference);
    check_step<std::int8_t>(mixed_step(5), alibi, reference);
    check_step<float>(mixed_step(16), full, reference);
  };
  test::for_each_simd_target([&](int64_t) { check_all(false); });
  check_all(true);
}

// A plan made for this CPU's vector length and run on another target is planned again
// there, still leaving the chunks to the tiled schedule: the same bits as a plan made there.
TEST(BatchPlan, APlanMadeOnOneTargetRunsOnEvery) {
  const Step<float> step(mixed_step(16));
  const BatchPlan native(step.layout(), serving());
  test::for_each_simd_target([&](int64_t) {
    Results r{Tensor<float, 3>({step.cu.back(), 8, 64}), Tensor<float, 2>({8, step.cu.back()})};
    native.run(step.args(r.out, r.lse));
    const Results here = run_plan(step, serving());
    EXPECT_TRUE(same_bits(here.out.data(), r.out.data(), r.out.size()));
    EXPECT_TRUE(same_bits(here.lse.data(), r.lse.data(), r.lse.size()));
  });
}

TEST(BatchPlan, ContiguousAndPagedCachesGiveTheSameBits) {
  const Results contiguous = run_plan(Step<bfloat16>(mixed_step(0)), serving());
  for (int64_t block : {16, 5, 64}) {
    const Results paged = run_plan(Step<bfloat16>(mixed_step(block)), serving());
    EXPECT_TRUE(same_bits(contiguous.out.data(), paged.out.data(), paged.out.size())) << "block " << block;
    EXPECT_TRUE(same_bits(contiguous.lse.data(), paged.lse.data(), paged.lse.size())) << "block " << block;
  }
}

// With fixed_key_split, token i of a prefill chunk and the same token decoded alone (its
// own cache length, the same keys) have the same bits: the rows of a 50-query chunk over
// 1550 keys (the 1024-key chunk boundary inside) against 1-query plans.
TEST(BatchPlan, FixedKeySplitDecodeStepsReproducePrefillRows) {
  test::for_each_simd_target([](int64_t) {
    for (int64_t block : {0, 16}) {
      const int64_t n = 50, length = 1550;
      const Step<float> chunk(StepSpec{.queries = {n}, .lengths = {length}, .block_size = block});
      AttentionOptions options = serving();
      options.execution.fixed_key_split = true;
      const Results prefill = run_plan(chunk, options);
      for (int64_t i : {0, 13, 16, 31, 49}) {
        SCOPED_TRACE("query " + std::to_string(i) + ", block_size " + std::to_string(block));
        // The token alone: q row i, a cache of the keys it saw.
        Step<float> token = chunk;
        const int64_t H = token.spec.q_heads, d = token.spec.head_dim;
        Tensor<float, 3> q({1, H, d});
        std::copy_n(&chunk.q(i, 0, 0), H * d, q.data());
        token.q = std::move(q);
        token.cu = {0, 1};
        token.spec.queries = {1};
        token.spec.lengths = {length - n + i + 1};
        const Results alone = run_plan(token, options);
        EXPECT_TRUE(same_bits(alone.out.data(), &prefill.out(i, 0, 0), alone.out.size()));
        for (int64_t h = 0; h < H; ++h) EXPECT_TRUE(same_bits(&alone.lse(h, 0), &prefill.lse(h, i), 1)) << "head " << h;
      }
    }
  });
}

TEST(BatchPlan, ReportsItsWork) {
  const Step<float> step(mixed_step(16));
  const BatchPlan plan(step.layout(), serving());
  EXPECT_EQ(plan.sequences(), 8);
  EXPECT_EQ(plan.total_queries(), 262);
  const std::vector<double> costs = plan.task_costs();
  EXPECT_EQ(static_cast<int64_t>(costs.size()), plan.tasks());
  EXPECT_TRUE(std::is_sorted(costs.rbegin(), costs.rend()));  // costliest first
  EXPECT_GT(costs.back(), 0.0);
}

TEST(BatchPlan, AStepWithoutQueriesWritesNothing) {
  const Step<float> step(StepSpec{.queries = {0, 0}, .lengths = {0, 7}});
  Results r{Tensor<float, 3>({0, 8, 64}), Tensor<float, 2>({8, 0})};
  const BatchPlan plan(step.layout(), serving());
  EXPECT_NO_THROW(plan.run(step.args(r.out, r.lse)));
  EXPECT_EQ(plan.tasks(), 0);
}

using test::expect_error;

// KVCache::append_varlen stores what per-sequence appends store (same rows, same blocks),
// and refuses bad offsets with nothing appended.
TEST(BatchPlan, KVCacheAppendVarlenIsPerSequenceAppends) {
  const KVCacheConfig config{.batch = 3, .capacity = 128, .kv_heads = 2, .head_dim = 64, .dtype = StorageType::bfloat16,
                             .paged = true, .block_size = 16};
  KVCache varlen(config), separate(config);
  const std::vector<int64_t> cu{0, 30, 30, 37};
  Tensor<float, 3> k({37, 2, 64}), v({37, 2, 64});
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = normal(rng), v[i] = normal(rng);
  varlen.append_varlen(k.cview(), v.cview(), std::span<const int64_t>(cu));
  for (int64_t b : {0, 2}) {
    const int64_t n = cu[b + 1] - cu[b];
    const View4<const float> kb(k.data() + cu[b] * 128, {1, n, 2, 64}, {n * 128, 128, 64, 1});
    const View4<const float> vb(v.data() + cu[b] * 128, {1, n, 2, 64}, {n * 128, 128, 64, 1});
    const std::vector<int64_t> seq{b};
    separate.append(kb, vb, seq);
  }
  EXPECT_EQ(std::vector<int64_t>(varlen.lengths().begin(), varlen.lengths().end()), (std::vector<int64_t>{30, 0, 7}));
  EXPECT_TRUE(std::equal(varlen.block_table().begin(), varlen.block_table().end(), separate.block_table().begin()));
  // The rows that hold keys (the pool's other rows are uninitialized).
  const std::size_t row_bytes = 2 * 64 * sizeof(bfloat16);
  for (int64_t b : {0, 2})
    for (int64_t j = 0; j < varlen.lengths()[static_cast<std::size_t>(b)]; ++j) {
      const int64_t block = varlen.block_table()[static_cast<std::size_t>(b * varlen.blocks_per_sequence() + j / 16)];
      const std::size_t at = static_cast<std::size_t>(block * 16 + j % 16) * row_bytes;
      EXPECT_EQ(std::memcmp(static_cast<const std::byte*>(varlen.k_data()) + at,
                            static_cast<const std::byte*>(separate.k_data()) + at, row_bytes), 0) << b << ", " << j;
      EXPECT_EQ(std::memcmp(static_cast<const std::byte*>(varlen.v_data()) + at,
                            static_cast<const std::byte*>(separate.v_data()) + at, row_bytes), 0) << b << ", " << j;
    }
  const std::vector<int64_t> decreasing{0, 10, 5, 37};
  expect_error([&] { varlen.append_varlen(k.cview(), v.cview(), std::span<const int64_t>(decreasing)); }, "cu_seqlens[2]");
  const std::vector<int64_t> too_few{0, 37};
  expect_error([&] { varlen.append_varlen(k.cview(), v.cview(), std::span<const int64_t>(too_few)); }, "cu_seqlens: expected 4 entries");
  EXPECT_EQ(varlen.lengths()[0], 30);  // nothing appended by the failed calls
}

// ---------------------------------------------------------------------------------
// Errors: the message names the argument (and index); outputs stay untouched.

TEST(BatchPlanErrors, BadLayoutsNameTheArgument) {
  const Step<float> step(mixed_step(16));
  const auto plan_with = [&](auto change) {
    return [&step, change] {
      std::vector<int64_t> cu = step.cu, lengths = step.spec.lengths;
      BatchLayout l = step.layout();
      change(l, cu, lengths);
      l.cu_seqlens_q = std::span<const int64_t>(cu);
      l.cache_lengths = std::span<const int64_t>(lengths);
      BatchPlan plan(l, serving());
    };
  };
  expect_error(plan_with([](BatchLayout&, auto& cu, auto&) { cu[3] = cu[2] - 1; }), "cu_seqlens_q[3]: expected >= cu_seqlens_q[2]");
  expect_error(plan_with([](BatchLayout&, auto& cu, auto&) { cu[0] = 1; }), "cu_seqlens_q[0]");
  expect_error(plan_with([](BatchLayout&, auto&, auto& lengths) { lengths[4] = 199; }), "cache_lengths[4]");
  expect_error(plan_with([](BatchLayout&, auto&, auto& lengths) { lengths.pop_back(); }), "cache_lengths: expected one length per sequence (8");
  expect_error(plan_with([](BatchLayout&, auto&, auto& lengths) { lengths[6] = 5000; }), "cache_lengths[6]: expected at most");
  expect_error(plan_with([](BatchLayout& l, auto&, auto&) { l.num_heads = 7; }), "layout.num_heads");
  expect_error(plan_with([](BatchLayout& l, auto&, auto&) { l.head_dim = 0; }), "layout.head_dim");
  expect_error(plan_with([](BatchLayout& l, auto&, auto&) { l.block_size = 0; }), "block_size");
  Tensor<int32_t, 2> negative = step.table;
  negative(5, 2) = -3;
  expect_error(plan_with([&negative](BatchLayout& l, auto&, auto&) { l.block_table = negative.cview(); }), "block_table[5, 2]");
  AttentionOptions dropout = serving();
  dropout.dropout.p = 0.1f;
  expect_error([&] { BatchPlan plan(step.layout(), dropout); }, "options.dropout");
  AttentionOptions bad_scale = serving();
  bad_scale.scale = 1e39;
  expect_error([&] { BatchPlan plan(step.layout(), bad_scale); }, "scale");
}

TEST(BatchPlanErrors, BadViewsNameTheArgumentAndWriteNothing) {
  const Step<float> step(mixed_step(16));
  const BatchPlan plan(step.layout(), serving());
  Results r{Tensor<float, 3>({step.cu.back(), 8, 64}), Tensor<float, 2>({8, step.cu.back()})};
  for (std::size_t i = 0; i < r.out.size(); ++i) r.out[i] = 7.0f;
  const auto expect_untouched = [&] {
    for (std::size_t i = 0; i < r.out.size(); ++i) ASSERT_EQ(r.out[i], 7.0f);
  };
  // A pool smaller than the table says.
  BatchArgs<float> small = step.args(r.out, r.lse);
  small.k_cache = View4<const float>(step.k.data(), {3, 16, 2, 64}, step.k.cview().strides);
  small.v_cache = View4<const float>(step.v.data(), {3, 16, 2, 64}, step.v.cview().strides);
  expect_error([&] { plan.run(small); }, "block_table[");
  expect_untouched();
  BatchArgs<float> heads = step.args(r.out, r.lse);
  heads.q = View3<const float>(step.q.data(), {step.cu.back(), 4, 64}, {8 * 64, 64, 1});
  expect_error([&] { plan.run(heads); }, "q.shape[1]");
  expect_untouched();
  // Another storage type than planned.
  const Step<bfloat16> other(mixed_step(16));
  expect_error([&] { plan.run(other.args(r.out, r.lse)); }, "k_cache: expected float32");
  expect_untouched();
  // Contiguous caches shorter than the longest cache length.
  const Step<float> contiguous(mixed_step(0));
  const BatchPlan contiguous_plan(contiguous.layout(), serving());
  BatchArgs<float> short_cache = contiguous.args(r.out, r.lse);
  short_cache.k_cache = View4<const float>(contiguous.k.data(), {8, 1000, 2, 64}, contiguous.k.cview().strides);
  short_cache.v_cache = View4<const float>(contiguous.v.data(), {8, 1000, 2, 64}, contiguous.v.cview().strides);
  expect_error([&] { contiguous_plan.run(short_cache); }, "k_cache.shape[1] (capacity): expected at least cache_lengths[6]");
  expect_untouched();
}

}  // namespace
}  // namespace qkv
