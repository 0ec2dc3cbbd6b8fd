// qkv::mla_decode over FlashMLA's FP8 records (MlaRecordArgs: per token, c_kv as e4m3
// with a float32 scale per 128 values, then k_pe as bfloat16):
// - against mla_case.hpp's fp64 oracle of the stored values (e4m3 · scale rounded once to
//   float32, k_pe's bfloat16 values), on every SIMD target, contiguous and paged
//   (shuffled blocks), Nq 1..4 (bottom-right causal), cache lengths 0..1300 (several
//   chunks), key lists with −1 and repeats; scales of any value and powers of two;
//   tolerance as test_mla_decode.cpp states it (float32 arithmetic: twice a plain float32
//   evaluation's error, plus 8 ulps of the output's size);
// - with power-of-two scales on vdpbf16ps (Precision::fast, 16 heads, forced on where
//   the CPU has it) against the oracle of the bf16-rounded queries with what P rounded
//   once to bfloat16 adds (the bf16 contract), and with other scales the float kernel:
//   fast gives exact's bits;
// - backend reference, sinks; 1/2/3 threads bitwise equal; bad calls named, nothing written.
#include <gtest/gtest.h>

#include <qkv/error.hpp>
#include <qkv/float8.hpp>
#include <qkv/mla.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/dot_products.hpp"
#include "forced_vdpbf16ps.hpp"
#include "mla_case.hpp"
#include "simd_targets.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

using test::Case;
using test::Shape;
using test::step_options;

// mostly_powers_of_two: every 300th record's scales are not (its block of 64 takes the
// float step between the unit's blocks), and the queries are bfloat16 values, so that the
// float step's unrounded queries are the unit's rounded ones and one oracle serves both.
enum class Scales { any, powers_of_two, mostly_powers_of_two };

// A float case whose caches are re-expressed as FP8 records: each stored row quantized
// (scale per 128 values: max|x| / 448, or the power of two at or above it), the case's
// float copies replaced by the stored values, so that the oracle reads exactly them.
struct RecordCase {
  Case<float> c;
  std::vector<std::uint8_t> records;
  int64_t record_bytes;

  RecordCase(const Shape& s, std::uint64_t seed, int64_t list_len, Scales scales)
      : c(s, seed, list_len), record_bytes(mla_record_bytes(s.dc, s.dr)) {
    const int64_t rows = static_cast<int64_t>(c.ckv_f.size()) / s.dc;
    records.assign(static_cast<std::size_t>(rows * record_bytes), 0);
    std::mt19937_64 rng(seed + 7);
    // Groups of different sizes (a scale each), logits of the size the other MLA cases
    // have: a sequential float32 sum (SCALAR) of 320 products of 4× values misses the
    // "twice a plain float32 evaluation" rule by chance, not by a defect.
    std::uniform_real_distribution<float> spread(0.25f, 2.0f);
    for (int64_t r = 0; r < rows; ++r) {
      std::uint8_t* record = records.data() + r * record_bytes;
      for (int64_t g = 0; g < s.dc / 128; ++g) {
        float* x = c.ckv_f.data() + r * s.dc + g * 128;
        const float size = spread(rng);  // groups of different sizes
        float amax = 0.0f;
        for (int64_t n = 0; n < 128; ++n) amax = std::max(amax, std::abs(x[n] *= size));
        float scale = std::max(amax, 1e-4f) / 448.0f;
        if (scales == Scales::powers_of_two || (scales == Scales::mostly_powers_of_two && r % 300 != 7))
          scale = std::exp2(std::ceil(std::log2(scale)));
        std::memcpy(record + s.dc + 4 * g, &scale, 4);
        for (int64_t n = 0; n < 128; ++n) {
          const float8_e4m3fn v(x[n] / scale);
          std::memcpy(record + g * 128 + n, &v, 1);
          x[n] = static_cast<float>(v) * scale;  // the stored value
        }
      }
      for (int64_t n = 0; n < s.dr; ++n) {
        float& k = c.kpe_f[static_cast<std::size_t>(r * s.dr + n)];
        const bfloat16 v(k);
        std::memcpy(record + s.dc + 4 * (s.dc / 128) + 2 * n, &v, 2);
        k = static_cast<float>(v);
      }
    }
    if (scales == Scales::mostly_powers_of_two)
      for (Tensor<float, 4>* q : {&c.q_nope, &c.q_pe})
        for (std::size_t n = 0; n < q->size(); ++n) q->data()[n] = static_cast<float>(bfloat16(q->data()[n]));
  }

  MlaRecordArgs args(Tensor<float, 4>& out, Tensor<float, 3>& lse) const {
    const Shape& s = c.s;
    MlaRecordArgs a;
    a.q_nope = c.q_nope.cview();
    a.q_pe = c.q_pe.cview();
    const int64_t outer = s.block_size > 0 ? c.blocks : s.batch, inner = s.block_size > 0 ? s.block_size : s.capacity;
    a.ckv_cache = View3<const std::uint8_t>::contiguous(records.data(), {outer, inner, record_bytes});
    a.cache_lengths = s.lengths;
    if (s.block_size > 0)
      a.block_table = TensorView<const int32_t, 2>::contiguous(c.table.data(), {s.batch, c.blocks / s.batch});
    a.out = out.view();
    a.lse = lse.view();
    if (!c.lists.empty())
      a.indices = TensorView<const int64_t, 3>::contiguous(c.lists.data(), {s.batch, s.q_len, c.topk});
    return a;
  }
};

struct Result {
  Tensor<float, 4> out;
  Tensor<float, 3> lse;
};

Result run(const RecordCase& rc, const AttentionOptions& options) {
  const Shape& s = rc.c.s;
  Result r{Tensor<float, 4>({s.batch, s.q_len, s.heads, s.dc}), Tensor<float, 3>({s.batch, s.heads, s.q_len})};
  mla_decode(rc.args(r.out, r.lse), options);
  return r;
}

// dots: the call ran on vdpbf16ps (q rounded to bfloat16 once, P once).
void expect_matches(const RecordCase& rc, const AttentionOptions& options, bool dots, const std::string& what) {
  SCOPED_TRACE(what);
  const Result r = run(rc, options);
  test::expect_near_oracle(test::oracle(rc.c, *options.scale, dots), r.out.data(), r.lse.data(), dots);
}

// Nq 1..4, 5 heads, lengths 0, below Nq, a few blocks, contiguous and paged; one sequence
// of 1300 keys (three chunks) with DeepSeek's dr and 16 heads.
std::vector<Shape> shapes() {
  std::vector<Shape> all;
  for (int64_t q_len : {1, 2, 4})
    for (int64_t block : {0, 8}) all.push_back({3, q_len, 5, 128, 8, {0, 2, 77}, 80, block});
  all.push_back({1, 1, 16, 256, 64, {1300}, 1300, 16});
  all.push_back({2, 2, 16, 128, 64, {700, 90}, 704, 0});
  return all;
}

std::string name(const Shape& s) {
  return "Nq " + std::to_string(s.q_len) + " heads " + std::to_string(s.heads) + " dc " + std::to_string(s.dc) +
         (s.block_size > 0 ? " paged" : " contiguous");
}

TEST(MlaDecodeRecords, MatchesTheFormulaOnEveryTarget) {
  test::for_each_simd_target([&](int64_t) {
    std::uint64_t seed = 501;
    for (const Shape& s : shapes())
      for (Scales scales : {Scales::any, Scales::powers_of_two}) {
        const std::string what = name(s) + (scales == Scales::any ? " any scales" : " power-of-two scales");
        const AttentionOptions exact = step_options(0.3, 2, Backend::automatic, Precision::exact);
        expect_matches(RecordCase(s, seed++, 0, scales), exact, false, what);
        expect_matches(RecordCase(s, seed++, 9, scales), exact, false, what + " indices");
        expect_matches(RecordCase(s, seed++, 600, scales), exact, false, what + " long indices");
      }
  });
}

TEST(MlaDecodeRecords, ReferenceBackendMatchesTheFormula) {
  std::uint64_t seed = 601;
  for (const Shape& s : shapes()) {
    const AttentionOptions reference = step_options(0.3, 2, Backend::reference, Precision::exact);
    expect_matches(RecordCase(s, seed++, 0, Scales::any), reference, false, "reference " + name(s));
    expect_matches(RecordCase(s, seed++, 9, Scales::any), reference, false, "reference indices " + name(s));
  }
}

// Power-of-two scales: every block's stored values are bfloat16 values, so 16 heads in
// fast take the bf16 unit forced on; other scales keep the float kernel, fast giving
// exact's bits.
void expect_power_of_two_scales_take_the_unit() {
  test::for_each_simd_target([&](int64_t) {
    std::uint64_t seed = 701;
    for (const Shape& s : {Shape{1, 1, 16, 256, 64, {1300}, 1300, 16}, Shape{2, 2, 32, 128, 64, {700, 90}, 704, 0}}) {
      const AttentionOptions fast = step_options(0.3, 2, Backend::automatic, Precision::fast);
      const AttentionOptions exact = step_options(0.3, 2, Backend::automatic, Precision::exact);
      const RecordCase pow2(s, seed++, 0, Scales::powers_of_two), listed(s, seed++, 300, Scales::powers_of_two);
      expect_matches(pow2, fast, true, "dot unit " + name(s));
      expect_matches(listed, fast, true, "dot unit indices " + name(s));
      // The unit changes the bits (q and P rounded): the path was taken.
      const Result on = run(pow2, fast), off = run(pow2, exact);
      EXPECT_NE(0, std::memcmp(on.out.data(), off.out.data(), on.out.size() * sizeof(float))) << name(s);
      const RecordCase any(s, seed++, 0, Scales::any);
      const Result any_fast = run(any, fast), any_exact = run(any, exact);
      EXPECT_EQ(0, std::memcmp(any_fast.out.data(), any_exact.out.data(), any_fast.out.size() * sizeof(float)))
          << "scales that are not powers of two: the float kernel " << name(s);
      EXPECT_EQ(0, std::memcmp(any_fast.lse.data(), any_exact.lse.data(), any_fast.lse.size() * sizeof(float)));
    }
  });
}

TEST(MlaDecodeRecords, PowerOfTwoScalesTakeTheDotUnit) {
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const test::ForcedVdpbf16ps forced;
  expect_power_of_two_scales_take_the_unit();
}

TEST(MlaDecodeRecords, PowerOfTwoScalesTakeTheAmxTiles) {
  if (!cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 tiles on this CPU";
  const test::ForcedAmx forced;
  expect_power_of_two_scales_take_the_unit();
}

// 128 heads on the tiles take the spans (decode_latent-inl.h: 512 records a span, the
// heads its rows, chunks of ≥ 2048 keys): whole and partial spans, two chunks merged,
// paged and listed, and records whose scales are not powers of two among the others
// (their blocks take the float step between spans), against the bf16 contract's oracle.
// The span counter shows that spans ran; with the switch off (QKV_AMX_ROWS's test hook)
// none does and the column step meets the same oracle.
TEST(MlaDecodeRecords, OneHundredTwentyEightHeadsTakeTheAmxSpans) {
  if (!cpu::cpu_has_amx_bf16()) GTEST_SKIP() << "no AMX-BF16 tiles on this CPU";
  const test::ForcedAmx forced;
  const AttentionOptions fast = step_options(0.3, 2, Backend::automatic, Precision::fast);
  std::uint64_t seed = 801;
  for (const Shape& s : {Shape{1, 1, 128, 128, 64, {1300}, 1300, 16}, Shape{2, 1, 128, 256, 64, {2200, 90}, 2200, 0}})
    for (Scales scales : {Scales::powers_of_two, Scales::mostly_powers_of_two})
      for (int64_t list_len : {0, 700}) {
        const std::string what = name(s) + (scales == Scales::powers_of_two ? " powers of two" : " mostly") +
                                 (list_len > 0 ? " indices" : "");
        const RecordCase rc(s, seed++, list_len, scales);
        const std::size_t before = cpu::amx_latent_spans();
        expect_matches(rc, fast, true, what);
        EXPECT_GT(cpu::amx_latent_spans(), before) << what;
        cpu::set_amx_row_forward_for_test(false);
        const std::size_t off_before = cpu::amx_latent_spans();
        expect_matches(rc, fast, true, what + " column step");
        EXPECT_EQ(cpu::amx_latent_spans(), off_before) << what;
        cpu::set_amx_row_forward_for_test(std::nullopt);
      }
}

TEST(MlaDecodeRecords, BitwiseEqualForAnyThreadCount) {
  for (Precision precision : {Precision::exact, Precision::fast})
    for (Scales scales : {Scales::any, Scales::powers_of_two})
      for (int64_t list_len : {0, 300}) {
        const RecordCase rc({2, 3, 16, 128, 64, {700, 1500}, 1504, 16}, 17 + list_len, list_len, scales);
        std::vector<float> first_out, first_lse;
        for (int threads : {1, 2, 3}) {
          const Result r = run(rc, step_options(0.3, threads, Backend::automatic, precision));
          if (threads == 1) {
            first_out.assign(r.out.data(), r.out.data() + r.out.size());
            first_lse.assign(r.lse.data(), r.lse.data() + r.lse.size());
            continue;
          }
          EXPECT_EQ(0, std::memcmp(first_out.data(), r.out.data(), r.out.size() * sizeof(float))) << threads;
          EXPECT_EQ(0, std::memcmp(first_lse.data(), r.lse.data(), r.lse.size() * sizeof(float))) << threads;
        }
      }
}

// Sinks: the kernel against backend reference (the oracle above has none): each row's
// weights with one more softmax entry; a row with no key gives out 0 and lse = its sink.
TEST(MlaDecodeRecords, SinksMatchTheReference) {
  const RecordCase rc({3, 2, 5, 128, 8, {0, 2, 1100}, 1104, 8}, 41, 0, Scales::any);
  const std::vector<float> sinks{0.5f, -1.0f, 2.0f, 0.0f, 3.0f};
  AttentionOptions kernel = step_options(0.3, 2, Backend::automatic, Precision::exact), reference = kernel;
  kernel.sinks = sinks;
  reference.sinks = sinks;
  reference.execution.backend = Backend::reference;
  const Result got = run(rc, kernel), want = run(rc, reference);
  double ref_max = 0.0;
  for (std::size_t n = 0; n < want.out.size(); ++n) ref_max = std::max(ref_max, std::abs(double(want.out[n])));
  for (std::size_t n = 0; n < want.out.size(); ++n) EXPECT_NEAR(got.out[n], want.out[n], 1e-5 * ref_max) << n;
  for (std::size_t n = 0; n < want.lse.size(); ++n) EXPECT_NEAR(got.lse[n], want.lse[n], 1e-5) << n;
  for (int64_t h = 0; h < 5; ++h)  // sequence 0 holds no key
    for (int64_t i = 0; i < 2; ++i) {
      EXPECT_EQ(got.lse(0, h, i), sinks[static_cast<std::size_t>(h)]);
      for (int64_t x = 0; x < 128; ++x) EXPECT_EQ(got.out(0, i, h, x), 0.0f);
    }
}

// A bad call: a qkv::Error naming the argument, and the outputs left as they were.
void expect_refused(const std::function<void(MlaRecordArgs&, AttentionOptions&)>& spoil, const std::string& needle,
                    int64_t dc = 128) {
  SCOPED_TRACE(needle);
  const RecordCase rc({2, 2, 4, 128, 8, {5, 9}, 16, 8}, 3, 4, Scales::any);
  Tensor<float, 4> out({2, 2, 4, 128});
  Tensor<float, 3> lse({2, 4, 2});
  test::fill(out, 7.0f);
  test::fill(lse, 7.0f);
  MlaRecordArgs a = rc.args(out, lse);
  AttentionOptions o = step_options(0.25);
  spoil(a, o);
  (void)dc;
  test::expect_error([&] { mla_decode(a, o); }, needle);
  for (std::size_t n = 0; n < out.size(); ++n) ASSERT_EQ(out[n], 7.0f) << "out written by a failed call";
  for (std::size_t n = 0; n < lse.size(); ++n) ASSERT_EQ(lse[n], 7.0f) << "lse written by a failed call";
}

TEST(MlaDecodeRecords, BadCallsAreNamedAndWriteNothing) {
  expect_refused([](MlaRecordArgs&, AttentionOptions& o) { o.scale.reset(); }, "options.scale: required");
  expect_refused([](MlaRecordArgs& a, AttentionOptions&) { a.ckv_cache.shape[2] -= 4; }, "record bytes");
  expect_refused([](MlaRecordArgs& a, AttentionOptions&) { a.q_nope.shape[3] = 64; a.out.shape[3] = 64; },
                 "multiple of 128");
  std::vector<int64_t> bad(2 * 2 * 4, 0);
  bad[5] = 9;  // sequence 1 holds 9 keys: 0..8
  bad[1] = 5;  // sequence 0 holds 5: index 5 is beyond it
  expect_refused([&](MlaRecordArgs& a, AttentionOptions&) {
    a.indices = TensorView<const int64_t, 3>::contiguous(bad.data(), {2, 2, 4});
  }, "indices[0, 0, 1]");
  expect_refused([](MlaRecordArgs&, AttentionOptions& o) { o.window = Window{4, 0}; }, "options.window");
  std::vector<int32_t> table{0, 1, 2, 99};
  expect_refused([&](MlaRecordArgs& a, AttentionOptions&) {
    a.block_table = TensorView<const int32_t, 2>::contiguous(table.data(), {2, 2});
  }, "block_table");
  expect_refused([](MlaRecordArgs& a, AttentionOptions&) { a.lse.shape[2] = 3; }, "lse");
}

// qkv::pack_mla_records: each stored value within e4m3's rounding of its input (half a
// step: 2⁻⁴ relative, or half the smallest subnormal step 2⁻¹⁰ times the scale), every
// input within 448 scales, power-of-two scales when asked, k_pe bfloat16 rounded to
// nearest even; bad calls named, nothing written.
TEST(MlaDecodeRecords, PackerWritesTheLayout) {
  const int64_t rows = 7, dc = 256, dr = 64, bytes = mla_record_bytes(dc, dr);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> latent(rows * dc), rope(rows * dr);
  for (int64_t i = 0; i < rows * dc; ++i) latent[i] = normal(rng) * ((i / 128) % 2 == 0 ? 0.01f : 30.0f);
  for (float& x : rope) x = normal(rng);
  const auto c_kv = TensorView<const float, 2>::contiguous(latent.data(), {rows, dc});
  const auto k_pe = TensorView<const float, 2>::contiguous(rope.data(), {rows, dr});
  for (RecordScales kind : {RecordScales::amax, RecordScales::power_of_two}) {
    std::vector<std::uint8_t> records(rows * bytes, 0xAB);
    pack_mla_records(c_kv, k_pe, TensorView<std::uint8_t, 2>::contiguous(records.data(), {rows, bytes}), kind);
    for (int64_t n = 0; n < rows; ++n) {
      const std::uint8_t* record = records.data() + n * bytes;
      for (int64_t g = 0; g < dc / 128; ++g) {
        float scale;
        std::memcpy(&scale, record + dc + 4 * g, 4);
        if (kind == RecordScales::power_of_two) {
          EXPECT_EQ(scale, std::exp2(std::round(std::log2(scale)))) << n;
        }
        for (int64_t c = g * 128; c < (g + 1) * 128; ++c) {
          const double x = latent[n * dc + c];
          const double stored = static_cast<double>(float8_e4m3fn::from_bits(record[c])) * scale;
          EXPECT_LE(std::abs(x), 448.0 * scale * (1 + 1e-6)) << n << ", " << c;
          EXPECT_LE(std::abs(stored - x), std::max(std::abs(x) / 16.0, scale / 1024.0) * (1 + 1e-6)) << n << ", " << c;
        }
      }
      for (int64_t c = 0; c < dr; ++c) {
        std::uint16_t bits;
        std::memcpy(&bits, record + dc + 4 * (dc / 128) + 2 * c, 2);
        EXPECT_EQ(bits, bfloat16(rope[n * dr + c]).bits) << n << ", " << c;
      }
    }
  }
  std::vector<std::uint8_t> records(rows * bytes, 0xAB);
  const auto expect_refused = [&](const std::function<void()>& call, const std::string& needle) {
    test::expect_error(call, needle);
    for (std::uint8_t b : records) ASSERT_EQ(b, 0xAB) << "written by a failed call: " << needle;
  };
  const auto out = TensorView<std::uint8_t, 2>::contiguous(records.data(), {rows, bytes});
  expect_refused([&] { pack_mla_records(c_kv, k_pe, TensorView<std::uint8_t, 2>(records.data(), {rows, bytes - 2}, {bytes, 1})); },
                 "records.shape[1] (record bytes): expected " + std::to_string(bytes));
  expect_refused([&] { pack_mla_records(TensorView<const float, 2>(latent.data(), {rows, 200}, {dc, 1}), k_pe, out); },
                 "c_kv.shape[-1] (dc): expected a positive multiple of 128");
  latent[3 * dc + 5] = std::numeric_limits<float>::infinity();
  expect_refused([&] { pack_mla_records(c_kv, k_pe, out); }, "c_kv[3, 5]: expected a finite value");
}

}  // namespace
}  // namespace qkv
