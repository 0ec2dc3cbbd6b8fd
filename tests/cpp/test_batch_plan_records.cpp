// qkv::BatchPlan::run over FlashMLA's FP8 records (BatchRecordArgs): a step of decode
// tokens, speculative steps and a 40-query prefill chunk, each sequence with its own
// query count.
//   - Every sequence's rows are bitwise qkv::mla_decode's over the same records for that
//     sequence alone (whose accuracy against the fp64 formula over the stored values is
//     test_mla_decode_records.cpp's): contiguous and shuffled paged pools, records of
//     both kinds of scale, key lists, sinks, every compiled SIMD target, the bf16 latent
//     step forced on (shown to run), and the reference backend likewise.
//   - 1, 2 and 3 threads give the same bits; rows past each sequence's length hold 0xFF
//     bytes (NaN values and scales): never read.
//   - Bad plans and views: a qkv::Error naming the argument, nothing written.
#include <gtest/gtest.h>

#include <qkv/batch_plan.hpp>
#include <qkv/error.hpp>
#include <qkv/mla.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
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

struct RecordSpec {
  std::vector<int64_t> queries{1, 3, 40, 0, 2};
  std::vector<int64_t> lengths{77, 600, 120, 50, 33};  // 600: two chunks of the records kernel
  int64_t heads = 8, dc = 128, dr = 16;
  int64_t block_size = 0;  // 0: contiguous
  RecordScales scales = RecordScales::power_of_two;
  int64_t topk = 0;  // > 0: packed key lists
  std::uint64_t seed = 3;
};

struct RecordStep {
  RecordSpec spec;
  std::vector<int64_t> cu{0};
  int64_t d = 0, bytes = 0, capacity = 0, max_blocks = 0, rows0 = 0, rows1 = 0;
  Tensor<float, 3> q;
  std::vector<std::uint8_t> pool;  // [rows0, rows1, bytes]
  Tensor<int32_t, 2> table;
  std::vector<int64_t> lists;  // [total_q, topk]

  explicit RecordStep(const RecordSpec& s) : spec(s), d(s.dc + s.dr), bytes(mla_record_bytes(s.dc, s.dr)) {
    const auto batch = static_cast<int64_t>(s.queries.size());
    for (int64_t n : s.queries) cu.push_back(cu.back() + n);
    capacity = *std::max_element(s.lengths.begin(), s.lengths.end());
    q = test::random_tensor<float, 3>({cu.back(), s.heads, d}, s.seed);
    rows0 = batch;
    rows1 = capacity;
    if (s.block_size > 0) {
      max_blocks = (capacity + s.block_size - 1) / s.block_size;
      rows0 = batch * max_blocks + 2;
      rows1 = s.block_size;
      std::vector<int32_t> order(static_cast<std::size_t>(rows0));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(s.seed)));
      table = Tensor<int32_t, 2>({batch, max_blocks});
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t n = 0; n < max_blocks; ++n) table(b, n) = order[static_cast<std::size_t>(b * max_blocks + n)];
    }
    pool.assign(static_cast<std::size_t>(rows0 * rows1 * bytes), 0xFF);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t length = s.lengths[static_cast<std::size_t>(b)];
      const auto c_kv = test::random_tensor<float, 2>({length, s.dc}, s.seed + 10 + static_cast<std::uint64_t>(b));
      const auto k_pe = test::random_tensor<float, 2>({length, s.dr}, s.seed + 50 + static_cast<std::uint64_t>(b));
      std::vector<std::uint8_t> packed(static_cast<std::size_t>(length * bytes));
      pack_mla_records(c_kv.cview(), k_pe.cview(),
                       TensorView<std::uint8_t, 2>::contiguous(packed.data(), {length, bytes}), s.scales);
      for (int64_t j = 0; j < length; ++j) {
        const int64_t r0 = s.block_size > 0 ? table(b, j / s.block_size) : b;
        const int64_t r1 = s.block_size > 0 ? j % s.block_size : j;
        std::memcpy(pool.data() + (r0 * rows1 + r1) * bytes, packed.data() + j * bytes, static_cast<std::size_t>(bytes));
      }
    }
    if (s.topk > 0) {
      std::mt19937_64 rng(s.seed + 99);
      for (std::size_t b = 0; b < s.queries.size(); ++b)
        for (int64_t t = 0; t < s.queries[b] * s.topk; ++t)
          lists.push_back(rng() % 5 == 0 ? -1 : static_cast<int64_t>(rng() % static_cast<uint64_t>(s.lengths[b])));
    }
  }

  BatchLayout layout() const {
    return test::batch_layout(cu, spec.lengths, table, spec.block_size,
                              {.heads = spec.heads, .kv_heads = 1, .head_dim = d, .v_dim = spec.dc},
                              StorageType::float8_e4m3fn);
  }

  View3<const std::uint8_t> records() const {
    return View3<const std::uint8_t>::contiguous(pool.data(), {rows0, rows1, bytes});
  }
  KeyIndices packed_lists() const {
    if (lists.empty()) return {};
    return KeyIndices(TensorView<const int64_t, 2>::contiguous(lists.data(), {cu.back(), spec.topk}));
  }
};

struct Result {
  Tensor<float, 3> out;  // [total, H, dc]
  Tensor<float, 2> lse;  // [H, total]
};

AttentionOptions options(int threads = 2, Precision precision = Precision::fast, Backend backend = Backend::automatic) {
  AttentionOptions o;
  o.scale = 0.1;
  o.causal = Causal::bottom_right;
  o.precision = precision;
  o.execution.threads = threads;
  o.execution.backend = backend;
  return o;
}

Result run_plan(const RecordStep& step, const AttentionOptions& o) {
  Result r{Tensor<float, 3>({step.cu.back(), step.spec.heads, step.spec.dc}),
           Tensor<float, 2>({step.spec.heads, step.cu.back()})};
  BatchPlan(step.layout(), o)
      .run(BatchRecordArgs{.q = step.q.cview(), .records = step.records(), .out = r.out.view(), .lse = r.lse.view(),
                           .indices = step.packed_lists()});
  return r;
}

// Sequence b alone through mla_decode over the same records, compared with its rows of `got`.
void expect_rows_of_mla_decode(const RecordStep& step, const Result& got, const AttentionOptions& o) {
  const RecordSpec& s = step.spec;
  const int64_t H = s.heads, d = step.d, total = step.cu.back();
  for (int64_t b = 0; b < static_cast<int64_t>(s.queries.size()); ++b) {
    const int64_t n = s.queries[static_cast<std::size_t>(b)], first = step.cu[static_cast<std::size_t>(b)];
    if (n == 0) continue;
    SCOPED_TRACE("sequence " + std::to_string(b));
    const float* rows = step.q.data() + first * H * d;
    MlaRecordArgs a;
    a.q_nope = View4<const float>(rows, {1, n, H, s.dc}, {n * H * d, H * d, d, 1});
    a.q_pe = View4<const float>(rows + s.dc, {1, n, H, s.dr}, {n * H * d, H * d, d, 1});
    const auto pool = step.records();
    if (s.block_size > 0) {
      a.ckv_cache = pool;
      a.block_table = TensorView<const int32_t, 2>::contiguous(&step.table(b, 0), {1, step.max_blocks});
    } else {
      a.ckv_cache = View3<const std::uint8_t>(pool.data + b * pool.strides[0], {1, pool.shape[1], pool.shape[2]},
                                              pool.strides);
    }
    const int64_t length = s.lengths[static_cast<std::size_t>(b)];
    a.cache_lengths = std::span<const int64_t>(&length, 1);
    if (s.topk > 0)
      a.indices = TensorView<const int64_t, 3>::contiguous(step.lists.data() + first * s.topk, {1, n, s.topk});
    Tensor<float, 4> out({1, n, H, s.dc});
    Tensor<float, 3> lse({1, H, n});
    a.out = out.view();
    a.lse = lse.view();
    mla_decode(a, o);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < H; ++h) {
        ASSERT_EQ(0, std::memcmp(&out(0, i, h, 0), &got.out(first + i, h, 0), static_cast<std::size_t>(s.dc) * 4))
            << "row " << i << " head " << h;
        ASSERT_EQ(0, std::memcmp(&lse(0, h, i), &got.lse.data()[h * total + first + i], 4)) << "lse " << i << " " << h;
      }
  }
}

void expect_each_sequence_is_mla_decode(const RecordSpec& s, const AttentionOptions& o, const std::string& what) {
  SCOPED_TRACE(what);
  const RecordStep step(s);
  const Result got = run_plan(step, o);
  for (std::size_t n = 0; n < got.out.size(); ++n) ASSERT_TRUE(std::isfinite(got.out[n])) << "out " << n;
  expect_rows_of_mla_decode(step, got, o);
}

TEST(BatchPlanRecords, EverySequenceIsMlaDecodeAloneOnEveryTarget) {
  test::for_each_simd_target([&](int64_t) {
    for (int64_t block : {0, 16})
      for (RecordScales scales : {RecordScales::power_of_two, RecordScales::amax})
        for (int64_t topk : {0, 24}) {
          RecordSpec s;
          s.block_size = block;
          s.scales = scales;
          s.topk = topk;
          const std::string what = std::string(block > 0 ? "paged" : "contiguous") +
                                   (scales == RecordScales::amax ? " amax" : " powers of two") +
                                   (topk > 0 ? " lists" : "");
          expect_each_sequence_is_mla_decode(s, options(), what);
        }
  });
  RecordSpec s;
  s.block_size = 16;
  expect_each_sequence_is_mla_decode(s, options(2, Precision::fast, Backend::reference), "reference");
  AttentionOptions with_sinks = options();
  const std::vector<float> sinks{0.5f, -1.0f, 2.0f, 0.0f, 1.0f, -0.5f, 0.25f, 3.0f};
  with_sinks.sinks = sinks;
  with_sinks.softcap = 20.0f;
  expect_each_sequence_is_mla_decode(s, with_sinks, "sinks and softcap");
}

TEST(BatchPlanRecords, TheBf16LatentStepRunsInThePlan) {
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const test::ForcedVdpbf16ps forced;
  test::for_each_simd_target([&](int64_t) {
    RecordSpec s;
    s.heads = 16;
    s.block_size = 16;
    const RecordStep step(s);
    const Result fast = run_plan(step, options(2, Precision::fast));
    const Result exact = run_plan(step, options(2, Precision::exact));
    EXPECT_NE(0, std::memcmp(fast.out.data(), exact.out.data(), fast.out.size() * 4)) << "the dot products did not run";
    expect_rows_of_mla_decode(step, fast, options(2, Precision::fast));
  });
}

TEST(BatchPlanRecords, BitwiseEqualForAnyThreadCount) {
  RecordSpec s;
  s.block_size = 16;
  s.topk = 24;
  const RecordStep step(s);
  const Result one = run_plan(step, options(1));
  for (int threads : {2, 3}) {
    const Result more = run_plan(step, options(threads));
    EXPECT_EQ(0, std::memcmp(one.out.data(), more.out.data(), one.out.size() * 4)) << threads;
    EXPECT_EQ(0, std::memcmp(one.lse.data(), more.lse.data(), one.lse.size() * 4)) << threads;
  }
}

// A bad plan or view: a qkv::Error mentioning `needle`, out and lse untouched.
void expect_refused(const RecordStep& step, const BatchLayout& layout, const AttentionOptions& o,
                    const View3<const std::uint8_t>& records, const std::string& needle) {
  SCOPED_TRACE(needle);
  Tensor<float, 3> out({step.cu.back(), step.spec.heads, step.spec.dc});
  Tensor<float, 2> lse({step.spec.heads, step.cu.back()});
  test::fill(out, 7.0f);
  test::fill(lse, 7.0f);
  test::expect_error(
      [&] {
        BatchPlan(layout, o).run(BatchRecordArgs{.q = step.q.cview(), .records = records, .out = out.view(),
                                                 .lse = lse.view(), .indices = step.packed_lists()});
      },
      needle);
  for (std::size_t n = 0; n < out.size(); ++n) ASSERT_EQ(out[n], 7.0f) << "out written by a failed call";
  for (std::size_t n = 0; n < lse.size(); ++n) ASSERT_EQ(lse[n], 7.0f) << "lse written by a failed call";
}

TEST(BatchPlanRecords, BadPlansAndViewsNameTheArgumentAndWriteNothing) {
  RecordSpec s;
  s.block_size = 16;
  s.topk = 8;
  RecordStep step(s);
  const auto records = step.records();
  BatchLayout bf16 = step.layout();
  bf16.storage = StorageType::bfloat16;
  expect_refused(step, bf16, options(), records, "records: expected a plan of float8_e4m3fn storage");
  BatchLayout narrow = step.layout();
  narrow.v_dim = 64;
  expect_refused(step, narrow, options(), records, "layout.v_dim (dc) must be a multiple of 128");
  AttentionOptions windowed = options();
  windowed.window = {32, 0};
  expect_refused(step, step.layout(), windowed, records, "options.window");
  BatchLayout shared = step.layout();
  shared.share_prefixes = true;
  // Sequences 0 and 1 share their first block, so the plan has a group.
  step.table(1, 0) = step.table(0, 0);
  expect_refused(step, shared, options(), records, "records: not with a plan whose sequences share prefixes");
  const RecordStep fresh(s);
  const auto pool = fresh.records();
  const View3<const std::uint8_t> short_records(pool.data, {pool.shape[0], pool.shape[1], pool.shape[2] - 1},
                                                pool.strides);
  expect_refused(fresh, fresh.layout(), options(), short_records, "records.shape[2] (record bytes)");
  const View3<const std::uint8_t> half_blocks(pool.data, {pool.shape[0], 8, pool.shape[2]}, pool.strides);
  expect_refused(fresh, fresh.layout(), options(), half_blocks, "records.shape[1] (block_size)");
  const View3<const std::uint8_t> few(pool.data, {3, pool.shape[1], pool.shape[2]}, pool.strides);
  expect_refused(fresh, fresh.layout(), options(), few, "records.shape[0] - 1");
  // A listed key past its sequence's length names its sequence and row.
  RecordStep bad_list(s);
  bad_list.lists[3] = 10000;
  expect_refused(bad_list, bad_list.layout(), options(), bad_list.records(), "indices");
}

}  // namespace
}  // namespace qkv
