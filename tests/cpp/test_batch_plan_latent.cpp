// qkv::BatchPlan over MLA's latent cache kept as two pools (FlashInfer's ckv / kpe layout):
// BatchArgs::k_rope_cache holds every key's last dr channels, k_cache its first dc, and
// the values are the k_cache rows themselves (v_cache the same view, v_dim dc).
//   - Bitwise the same step over one combined [c_kv | k_pe] pool holding the same values
//     (the combined pool's accuracy is test_batch_plan.cpp's and test_mla_decode.cpp's):
//     decode tokens, speculative steps and a prefill chunk of 40 queries (the tiled
//     schedule over gathered rows) in one step; float32, bfloat16 and float16, contiguous
//     and shuffled paged pools, one and two kv heads, every compiled SIMD target; key
//     lists; shared prefixes; the AVX512-BF16 latent step (forced on, shown to run);
//     1, 2 and 3 threads.
//   - Backend::reference over the two pools against an fp64 oracle written here from the
//     formula (both compute in double: within 1e-9 relative), and the cpu step within 64
//     float ulps of it — a gross-error check, as test_batch_plan.cpp's.
//   - Rows past each sequence's length hold NaN in both pools: never read.
//   - Bad calls: a qkv::Error naming k_rope_cache (or k_cache), nothing written.
#include <gtest/gtest.h>

#include <qkv/batch_plan.hpp>
#include <qkv/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "batch_layout.hpp"
#include "cpu/dot_products.hpp"
#include "forced_vdpbf16ps.hpp"
#include "simd_targets.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

struct LatentSpec {
  std::vector<int64_t> queries{1, 3, 40, 0, 2};     // decode, speculative, a prefill chunk, idle
  std::vector<int64_t> lengths{77, 300, 120, 50, 33};
  int64_t heads = 8, kv_heads = 1, dc = 32, dr = 16;
  int64_t block_size = 0;  // 0: contiguous
  std::uint64_t seed = 5;
};

// A step's packed queries [total, H, dc + dr] and its keys stored twice: one combined pool
// [.., Hkv, dc + dr] and the two pools [.., Hkv, dc] and [.., Hkv, dr], the same values;
// rows past a sequence's length NaN in all of them.
template <class T>
struct LatentStep {
  LatentSpec spec;
  std::vector<int64_t> cu{0};
  int64_t d = 0, capacity = 0, max_blocks = 0;
  Tensor<float, 3> q;
  Tensor<T, 4> combined, ckv, kpe;
  Tensor<int32_t, 2> table;
  Tensor<double, 4> keys;  // logical [B, capacity, Hkv, d], the stored values widened

  explicit LatentStep(const LatentSpec& s) : spec(s), d(s.dc + s.dr) {
    const auto batch = static_cast<int64_t>(s.queries.size());
    for (int64_t n : s.queries) cu.push_back(cu.back() + n);
    capacity = *std::max_element(s.lengths.begin(), s.lengths.end());
    q = test::random_tensor<float, 3>({cu.back(), s.heads, d}, s.seed);
    int64_t rows0 = batch, rows1 = capacity;
    if (s.block_size > 0) {
      max_blocks = (capacity + s.block_size - 1) / s.block_size;
      rows0 = batch * max_blocks + 3;  // blocks nobody uses
      rows1 = s.block_size;
      std::vector<int32_t> order(static_cast<std::size_t>(rows0));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(s.seed) + 1));
      table = Tensor<int32_t, 2>({batch, max_blocks});
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t n = 0; n < max_blocks; ++n) table(b, n) = order[static_cast<std::size_t>(b * max_blocks + n)];
    }
    combined = Tensor<T, 4>({rows0, rows1, s.kv_heads, d});
    ckv = Tensor<T, 4>({rows0, rows1, s.kv_heads, s.dc});
    kpe = Tensor<T, 4>({rows0, rows1, s.kv_heads, s.dr});
    for (auto* pool : {&combined, &ckv, &kpe}) test::fill(*pool, T(std::nanf("")));
    keys = Tensor<double, 4>({batch, capacity, s.kv_heads, d});
    std::mt19937_64 rng(s.seed + 2);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < s.lengths[static_cast<std::size_t>(b)]; ++j) {
        const int64_t r0 = s.block_size > 0 ? table(b, j / s.block_size) : b;
        const int64_t r1 = s.block_size > 0 ? j % s.block_size : j;
        for (int64_t h = 0; h < s.kv_heads; ++h)
          for (int64_t c = 0; c < d; ++c) {
            const T x = T(normal(rng));
            combined(r0, r1, h, c) = x;
            (c < s.dc ? ckv(r0, r1, h, c) : kpe(r0, r1, h, c - s.dc)) = x;
            keys(b, j, h, c) = static_cast<double>(static_cast<float>(x));
          }
      }
  }

  BatchLayout layout(bool share_prefixes = false) const {
    BatchLayout l = test::batch_layout(cu, spec.lengths, table, spec.block_size,
                                       {.heads = spec.heads, .kv_heads = spec.kv_heads, .head_dim = d, .v_dim = spec.dc},
                                       storage_type_of<T>);
    l.share_prefixes = share_prefixes;
    return l;
  }

  // The values: the first dc channels of the combined pool's rows (in place).
  View4<const T> combined_values() const {
    const auto view = combined.cview();
    return View4<const T>(view.data, {view.shape[0], view.shape[1], view.shape[2], spec.dc}, view.strides);
  }

  BatchArgs<T> args(bool split, Tensor<float, 3>& out, Tensor<float, 2>& lse) const {
    BatchArgs<T> a;
    a.q = q.cview();
    if (split) {
      a.k_cache = a.v_cache = ckv.cview();
      a.k_rope_cache = kpe.cview();
    } else {
      a.k_cache = combined.cview();
      a.v_cache = combined_values();
    }
    a.out = out.view();
    a.lse = lse.view();
    return a;
  }
};

struct StepResult {
  Tensor<float, 3> out;
  Tensor<float, 2> lse;
};

AttentionOptions options(int threads = 2, Precision precision = Precision::exact, Backend backend = Backend::automatic) {
  AttentionOptions o;
  o.scale = 0.2;
  o.causal = Causal::bottom_right;
  o.precision = precision;
  o.execution.threads = threads;
  o.execution.backend = backend;
  return o;
}

template <class T>
StepResult run(const LatentStep<T>& step, bool split, const AttentionOptions& o, const KeyIndices& lists = {},
               bool share_prefixes = false) {
  StepResult r{Tensor<float, 3>({step.cu.back(), step.spec.heads, step.spec.dc}),
               Tensor<float, 2>({step.spec.heads, step.cu.back()})};
  BatchArgs<T> a = step.args(split, r.out, r.lse);
  a.indices = lists;
  BatchPlan(step.layout(share_prefixes), o).run(a);
  return r;
}

bool same_bits(const StepResult& a, const StepResult& b) {
  return std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

template <class T>
void expect_split_equals_combined(const LatentSpec& spec, Precision precision, const std::string& what) {
  SCOPED_TRACE(what);
  const LatentStep<T> step(spec);
  const StepResult split = run(step, true, options(2, precision));
  EXPECT_TRUE(same_bits(split, run(step, false, options(2, precision))));
  for (std::size_t n = 0; n < split.out.size(); ++n) ASSERT_TRUE(std::isfinite(split.out[n])) << "out " << n;
}

TEST(BatchPlanLatent, TwoPoolsGiveTheCombinedPoolsBitsOnEveryTarget) {
  test::for_each_simd_target([&](int64_t) {
    for (int64_t block : {0, 16})
      for (int64_t kv_heads : {1, 2}) {
        LatentSpec s;
        s.block_size = block;
        s.kv_heads = kv_heads;
        const std::string what = std::string(block > 0 ? "paged" : "contiguous") + " kv heads " + std::to_string(kv_heads);
        expect_split_equals_combined<float>(s, Precision::exact, "float32 " + what);
        expect_split_equals_combined<bfloat16>(s, Precision::exact, "bfloat16 exact " + what);
        expect_split_equals_combined<bfloat16>(s, Precision::fast, "bfloat16 fast " + what);
        expect_split_equals_combined<float16>(s, Precision::exact, "float16 " + what);
      }
    LatentSpec wide;  // widths that are no multiple of the vectors: widened, not read in place
    wide.dc = 12;
    wide.dr = 4;
    wide.block_size = 8;
    expect_split_equals_combined<float>(wide, Precision::exact, "float32 dc 12 dr 4");
  });
}

// The float step reads latent values from the keys it has widened (the same values, d_pad
// apart, instead of the cache rows' power-of-two stride); values held apart — a copy of the
// c_kv pool — are read in place. Both give the same bits: 16 and 128 query heads (rows
// below and above the float step's own value packing), contiguous and paged, every target.
TEST(BatchPlanLatent, ValuesApartGiveTheBitsOfValuesInTheKeys) {
  test::for_each_simd_target([&](int64_t) {
    for (int64_t heads : {16, 128})
      for (int64_t block : {0, 16}) {
        SCOPED_TRACE(testing::Message() << heads << " heads, block " << block);
        LatentSpec s;
        s.heads = heads;
        s.dc = 64;
        s.block_size = block;
        s.queries = {1, 2, 0, 1};
        s.lengths = {300, 140, 50, 77};
        const LatentStep<float> step(s);
        const Tensor<float, 4> values_apart = step.ckv;  // a copy: v_rows no longer the keys' rows
        StepResult apart{Tensor<float, 3>({step.cu.back(), heads, s.dc}), Tensor<float, 2>({heads, step.cu.back()})};
        BatchArgs<float> a = step.args(true, apart.out, apart.lse);
        a.v_cache = values_apart.cview();
        BatchPlan(step.layout(), options()).run(a);
        const StepResult in_keys = run(step, true, options());
        EXPECT_TRUE(same_bits(in_keys, apart));
        EXPECT_TRUE(same_bits(in_keys, run(step, false, options())));
      }
  });
}

// AVX512-BF16 forced on, one kv head of 16 query heads, Precision::fast: the latent step
// runs on the two pools (its bits differ from exact's) and gives the combined pool's bits.
TEST(BatchPlanLatent, TwoPoolsTakeTheBf16LatentStep) {
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const test::ForcedVdpbf16ps forced;
  test::for_each_simd_target([&](int64_t) {
    for (int64_t block : {0, 16}) {
      LatentSpec s;
      s.heads = 16;
      s.dc = 64;
      s.block_size = block;
      const LatentStep<bfloat16> step(s);
      const StepResult fast = run(step, true, options(2, Precision::fast));
      EXPECT_TRUE(same_bits(fast, run(step, false, options(2, Precision::fast))));
      EXPECT_FALSE(same_bits(fast, run(step, true, options(2, Precision::exact)))) << "the dot products did not run";
    }
  });
}

// The fp64 formula over the stored values: out [total, H, dc], lse [H, total].
template <class T>
void oracle(const LatentStep<T>& step, double scale, std::vector<double>& out, std::vector<double>& lse) {
  const LatentSpec& s = step.spec;
  const int64_t total = step.cu.back(), group = s.heads / s.kv_heads;
  out.assign(static_cast<std::size_t>(total * s.heads * s.dc), 0.0);
  lse.assign(static_cast<std::size_t>(s.heads * total), -std::numeric_limits<double>::infinity());
  for (std::size_t b = 0; b < s.queries.size(); ++b) {
    const int64_t n = s.queries[b], length = s.lengths[b];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = step.cu[b] + i, visible = length - n + i + 1;
      for (int64_t h = 0; h < s.heads; ++h) {
        std::vector<double> logit(static_cast<std::size_t>(visible));
        double top = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < visible; ++j) {
          double dot = 0.0;
          for (int64_t c = 0; c < step.d; ++c)
            dot += static_cast<double>(step.q(row, h, c)) * step.keys(static_cast<int64_t>(b), j, h / group, c);
          logit[static_cast<std::size_t>(j)] = scale * dot;
          top = std::max(top, scale * dot);
        }
        double sum = 0.0;
        for (double& x : logit) sum += (x = std::exp(x - top));
        lse[static_cast<std::size_t>(h * total + row)] = top + std::log(sum);
        for (int64_t j = 0; j < visible; ++j)
          for (int64_t c = 0; c < s.dc; ++c)
            out[static_cast<std::size_t>((row * s.heads + h) * s.dc + c)] +=
                logit[static_cast<std::size_t>(j)] / sum * step.keys(static_cast<int64_t>(b), j, h / group, c);
      }
    }
  }
}

TEST(BatchPlanLatent, TwoPoolsMatchTheFormula) {
  LatentSpec s;
  s.block_size = 16;
  s.kv_heads = 2;
  const LatentStep<float> step(s);
  std::vector<double> want_out, want_lse;
  oracle(step, 0.2, want_out, want_lse);
  const auto expect_within = [&](const StepResult& got, double relative, const char* what) {
    SCOPED_TRACE(what);
    double largest = 1.0;
    for (double x : want_out) largest = std::max(largest, std::abs(x));
    for (std::size_t n = 0; n < want_out.size(); ++n)
      ASSERT_NEAR(got.out[n], want_out[n], relative * largest) << "out " << n;
    for (std::size_t n = 0; n < want_lse.size(); ++n) {
      ASSERT_NEAR(got.lse[n], want_lse[n], relative * std::max(1.0, std::abs(want_lse[n]))) << "lse " << n;
    }
  };
  // The reference computes in double and rounds each result to float once.
  expect_within(run(step, true, options(2, Precision::exact, Backend::reference)), std::numeric_limits<float>::epsilon(),
                "reference");
  expect_within(run(step, true, options(2, Precision::exact)), 64 * std::numeric_limits<float>::epsilon(), "cpu");
}

TEST(BatchPlanLatent, KeyListsAndSharedPrefixesOverTwoPools) {
  LatentSpec s;
  s.block_size = 16;
  s.queries = {1, 2, 1, 3};
  s.lengths = {130, 90, 70, 200};
  const LatentStep<bfloat16> step(s);
  // Key lists: [total_q, 9], −1 and repeats among them, positions within each sequence.
  std::vector<int64_t> lists;
  std::mt19937_64 rng(9);
  for (std::size_t b = 0; b < s.queries.size(); ++b)
    for (int64_t i = 0; i < s.queries[b] * 9; ++i)
      lists.push_back(rng() % 5 == 0 ? -1 : static_cast<int64_t>(rng() % static_cast<uint64_t>(s.lengths[b])));
  const KeyIndices indices(TensorView<const int64_t, 2>::contiguous(lists.data(), {step.cu.back(), 9}));
  EXPECT_TRUE(same_bits(run(step, true, options(), indices), run(step, false, options(), indices)));
  EXPECT_FALSE(same_bits(run(step, true, options(), indices), run(step, true, options()))) << "the lists were ignored";

  // Shared prefixes: sequences 0, 1 and 3 start with the same four pool blocks.
  LatentStep<bfloat16> shared(s);
  for (const int64_t b : {1, 3})
    for (int64_t n = 0; n < 4; ++n) {
      const int32_t from = shared.table(0, n), to = shared.table(b, n);
      for (int64_t r = 0; r < s.block_size; ++r)
        for (int64_t c = 0; c < shared.d; ++c) {
          shared.combined(to, r, 0, c) = shared.combined(from, r, 0, c);
          (c < s.dc ? shared.ckv(to, r, 0, c) : shared.kpe(to, r, 0, c - s.dc)) =
              c < s.dc ? shared.ckv(from, r, 0, c) : shared.kpe(from, r, 0, c - s.dc);
        }
      shared.table(b, n) = from;
    }
  ASSERT_FALSE(BatchPlan(shared.layout(true), options()).prefix_groups().empty());
  EXPECT_TRUE(same_bits(run(shared, true, options(), {}, true), run(shared, false, options(), {}, true)));
}

TEST(BatchPlanLatent, BitwiseEqualForAnyThreadCount) {
  LatentSpec s;
  s.block_size = 16;
  const LatentStep<float> step(s);
  const StepResult one = run(step, true, options(1));
  for (int threads : {2, 3}) EXPECT_TRUE(same_bits(one, run(step, true, options(threads)))) << threads << " threads";
}

template <class T>
void expect_refused(const std::function<void(BatchArgs<T>&)>& spoil, const std::string& needle) {
  SCOPED_TRACE(needle);
  LatentSpec s;
  s.block_size = 16;
  const LatentStep<T> step(s);
  StepResult r{Tensor<float, 3>({step.cu.back(), s.heads, s.dc}), Tensor<float, 2>({s.heads, step.cu.back()})};
  test::fill(r.out, 7.0f);
  test::fill(r.lse, 7.0f);
  BatchArgs<T> a = step.args(true, r.out, r.lse);
  spoil(a);
  const BatchPlan plan(step.layout(), options());
  test::expect_error([&] { plan.run(a); }, needle);
  for (std::size_t n = 0; n < r.out.size(); ++n) ASSERT_EQ(r.out[n], 7.0f) << "out written by a failed call";
  for (std::size_t n = 0; n < r.lse.size(); ++n) ASSERT_EQ(r.lse[n], 7.0f) << "lse written by a failed call";
}

TEST(BatchPlanLatent, BadCallsNameTheArgumentAndWriteNothing) {
  // A k_rope_cache as wide as the whole key: nothing left for k_cache.
  Tensor<float, 4> too_wide({40, 16, 1, 48});
  expect_refused<float>([&](BatchArgs<float>& a) { a.k_rope_cache = too_wide.cview(); }, "k_rope_cache.shape[3] (dr)");
  // k_cache wider than head_dim − dr.
  Tensor<float, 4> narrow_rope({40, 16, 1, 8});
  expect_refused<float>([&](BatchArgs<float>& a) { a.k_rope_cache = narrow_rope.cview(); }, "k_cache");
  // Another block size, other kv heads.
  Tensor<float, 4> blocks8({40, 8, 1, 16}), heads2({40, 16, 2, 16});
  expect_refused<float>([&](BatchArgs<float>& a) { a.k_rope_cache = blocks8.cview(); }, "k_rope_cache");
  expect_refused<float>([&](BatchArgs<float>& a) { a.k_rope_cache = heads2.cview(); }, "k_rope_cache");
  // Too few pool blocks for the table.
  Tensor<float, 4> few({2, 16, 1, 16});
  expect_refused<float>([&](BatchArgs<float>& a) { a.k_rope_cache = few.cview(); }, "k_rope_cache");
  // Quantized pools: refused by name.
  LatentSpec s;
  const LatentStep<float> step(s);
  BatchLayout layout = step.layout();
  layout.storage = StorageType::int8;
  Tensor<std::int8_t, 4> k8({5, step.capacity, 1, s.dc}), r8({5, step.capacity, 1, s.dr});
  Tensor<float, 3> scales({5, step.capacity, 1});
  test::fill(scales, 1.0f);
  Tensor<float, 3> out({step.cu.back(), s.heads, s.dc});
  BatchArgs<std::int8_t> a8{.q = step.q.cview(), .k_cache = k8.cview(), .v_cache = k8.cview(), .out = out.view(),
                            .lse = {}, .k_scale = scales.cview(), .v_scale = scales.cview(), .k_channel_scale = {},
                            .k_channel_zero = {}, .key_group = 0, .indices = {}, .k_rope_cache = r8.cview()};
  test::expect_error([&] { BatchPlan(layout, options()).run(a8); }, "k_rope_cache: not with int8");
}

}  // namespace
}  // namespace qkv
