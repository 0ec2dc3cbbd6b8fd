// bfloat16 and float16 storage through the public API: the cpu kernels against the fp64
// reference on the same inputs (the contract in half_check.hpp) over masks, causal modes,
// GQA, key_lengths, layouts, schedules and SIMD targets; every variant as the fp32 kernel
// rounded once; bitwise determinism across thread counts; non-finite values behind
// masks; varlen; the reference backend's own half path; validation.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "half_check.hpp"
#include "hwy/targets.h"
#include "simd_targets.hpp"
#include "cpu/dot_products.hpp"

namespace qkv {
namespace {

using test::CaseSpec;

struct HalfCase {
  CaseSpec spec;
  bool bhsd = false;
  int threads = 2;
};

std::ostream& operator<<(std::ostream& out, const HalfCase& c) { return out << c.spec.name; }

std::vector<HalfCase> half_cases() {
  std::vector<HalfCase> cases;
  for (const CaseSpec& spec : test::small_cases()) cases.push_back({spec});
  auto add = [&](CaseSpec spec, bool bhsd = false, int threads = 2) {
    cases.push_back({spec, bhsd, threads});
  };
  add({.name = "n7_d3_causal", .q_len = 7, .k_len = 7, .head_dim = 3, .v_dim = 3,
       .causal = Causal::top_left});
  add({.name = "n63_d59_bhsd", .q_len = 63, .k_len = 63, .head_dim = 59, .v_dim = 59}, true);
  add({.name = "n64_d64_gqa_causal", .batch = 2, .q_len = 64, .k_len = 64, .q_heads = 4,
       .kv_heads = 2, .head_dim = 64, .v_dim = 64, .causal = Causal::top_left});
  add({.name = "n65_d111_mask", .q_len = 65, .k_len = 65, .head_dim = 111, .v_dim = 111,
       .keep_mask = true});
  add({.name = "n65x130_d128_bottom_right", .q_len = 65, .k_len = 130, .head_dim = 128,
       .v_dim = 128, .causal = Causal::bottom_right}, true);
  add({.name = "n130x63_d256_bias", .q_len = 130, .k_len = 63, .q_heads = 2, .kv_heads = 1,
       .head_dim = 256, .v_dim = 256, .bias_mask = true});
  add({.name = "n100_d96_padding", .batch = 3, .q_len = 100, .k_len = 100, .head_dim = 96,
       .v_dim = 32, .causal = Causal::top_left, .key_padding = true}, false, 3);
  add({.name = "n70_everything", .batch = 2, .q_len = 70, .k_len = 90, .q_heads = 4,
       .kv_heads = 2, .head_dim = 33, .v_dim = 17, .causal = Causal::bottom_right,
       .keep_mask = true, .bias_mask = true, .key_padding = true, .scale = 0.2});
  // Decode-shaped calls (1..16 queries, no elementwise mask): with Precision::fast the
  // split-K schedule (cpu/forward_schedule.cpp) — GQA 9/3 as SmolLM2's step, odd dims
  // with padding and top-left causality, and one kv head with 16 query heads (the latent
  // step on vdpbf16ps where the CPU has it).
  add({.name = "decode_n1x540_gqa3", .q_len = 1, .k_len = 540, .q_heads = 9, .kv_heads = 3, .head_dim = 64,
       .v_dim = 64, .causal = Causal::bottom_right}, true);
  add({.name = "decode_n5x300_odd_padding", .batch = 2, .q_len = 5, .k_len = 300, .q_heads = 4, .kv_heads = 2,
       .head_dim = 33, .v_dim = 17, .causal = Causal::bottom_right, .key_padding = true});
  add({.name = "decode_n16x200_top_left", .q_len = 16, .k_len = 200, .q_heads = 2, .kv_heads = 1, .head_dim = 48,
       .v_dim = 48, .causal = Causal::top_left});
  add({.name = "decode_n2x300_16_heads_one_kv", .q_len = 2, .k_len = 300, .q_heads = 16, .kv_heads = 1,
       .head_dim = 80, .v_dim = 64, .causal = Causal::bottom_right});
  // Enough heads for the backward's single-pass schedule on this machine.
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  add({.name = "single_pass_gqa_causal", .batch = 2 * cores, .q_len = 70, .k_len = 70,
       .q_heads = 4, .kv_heads = 2, .head_dim = 64, .v_dim = 64, .causal = Causal::top_left,
       .bias_mask = true});
  add({.name = "single_pass_odd_dims", .batch = 4 * cores, .q_len = 20, .k_len = 75,
       .head_dim = 33, .v_dim = 17, .causal = Causal::bottom_right, .keep_mask = true,
       .key_padding = true}, true);
#ifndef QKV_TEST_SMALL
  add({.name = "n1000_d64_causal", .q_len = 1000, .k_len = 1000, .head_dim = 64, .v_dim = 64,
       .causal = Causal::top_left});
  add({.name = "n200_d128_backward", .q_len = 200, .k_len = 200, .q_heads = 2, .kv_heads = 1,
       .head_dim = 128, .v_dim = 128, .keep_mask = true}, true);
#endif
  return cases;
}

class HalfAgainstReference : public ::testing::TestWithParam<HalfCase> {};

TEST_P(HalfAgainstReference, Bfloat16WithinTheContract) {
  const HalfCase& c = GetParam();
  test::check_half_case<bfloat16>(c.spec, c.threads, c.bhsd);
}

TEST_P(HalfAgainstReference, Float16WithinTheContract) {
  const HalfCase& c = GetParam();
  test::check_half_case<float16>(c.spec, c.threads, c.bhsd);
}

INSTANTIATE_TEST_SUITE_P(Cases, HalfAgainstReference, ::testing::ValuesIn(half_cases()),
                         [](const auto& param_info) { return param_info.param.spec.name; });

// The bound is not vacuous: a kernel that accumulated P·V in bfloat16 (the running sum
// rounded after every key, instead of fp32 accumulation rounded once) breaks it.
TEST(HalfContract, CatchesAccumulationInTheStorageType) {
  const CaseSpec spec{.name = "bf16_sum", .q_len = 64, .k_len = 256, .head_dim = 32, .v_dim = 32};
  Tensor<float, 4> dout;
  const test::Case<float> c = test::half_case<bfloat16>(spec, 3, dout);
  const test::Reference ref = test::run_reference(c, nullptr);
  const test::PlainResult plain = test::plain_fp32(c, nullptr);
  Tensor<float, 4> summed_in_bf16(ref.out.shape());
  const double scale = 1.0 / std::sqrt(32.0);
  for (int64_t i = 0; i < spec.q_len; ++i) {
    std::vector<double> p(static_cast<std::size_t>(spec.k_len));
    double max = -INFINITY, sum = 0.0;
    for (int64_t j = 0; j < spec.k_len; ++j) {
      double dot = 0.0;
      for (int64_t x = 0; x < 32; ++x) dot += double{c.q(0, i, 0, x)} * c.k(0, j, 0, x);
      p[j] = scale * dot;
      max = std::max(max, p[j]);
    }
    for (double& w : p) sum += (w = std::exp(w - max));
    for (int64_t x = 0; x < 32; ++x) {
      bfloat16 acc(0.0f);
      for (int64_t j = 0; j < spec.k_len; ++j)
        acc = bfloat16(static_cast<float>(acc) + static_cast<float>(p[j] / sum) * c.v(0, j, 0, x));
      summed_in_bf16(0, i, 0, x) = static_cast<float>(acc);
    }
  }
  const double bound = test::storage_rounding_error<bfloat16>(ref.out) +
                       test::unit_roundoff<bfloat16>() * test::max_abs(ref.out) +
                       2.0 * test::error(plain.out, ref.out) +
                       8.0 * std::numeric_limits<float>::epsilon() * test::max_abs(ref.out);
  EXPECT_GT(test::error(summed_in_bf16, ref.out), bound);
}

TEST(HalfSimdTargets, EveryCompiledTargetWithinTheContract) {
  const std::vector<CaseSpec> cases{
      {.name = "t_causal", .batch = 2, .q_len = 70, .k_len = 70, .q_heads = 2, .kv_heads = 1,
       .head_dim = 64, .v_dim = 64, .causal = Causal::top_left},
      {.name = "t_odd", .q_len = 33, .k_len = 47, .head_dim = 59, .v_dim = 13, .bias_mask = true,
       .key_padding = true},
  };
  test::for_each_simd_target([&](int64_t target) {
    EXPECT_STREQ(cpu::simd_target_name(), hwy::TargetName(target));
    for (const CaseSpec& spec : cases) {
      test::check_half_case<bfloat16>(spec);
      test::check_half_case<float16>(spec);
    }
  });
}

// Outputs and gradients in T are bitwise identical for any thread count, with either
// backward schedule.
template <class T>
void expect_bitwise_for_any_thread_count(int64_t batch) {
  const CaseSpec spec{.name = "det", .batch = batch, .q_len = 150, .k_len = 170, .q_heads = 4,
                      .kv_heads = 2, .head_dim = 64, .v_dim = 48, .causal = Causal::bottom_right,
                      .bias_mask = true, .key_padding = true};
  Tensor<float, 4> dout;
  const test::Case<float> c = test::half_case<T>(spec, 5, dout);
  const test::Results first = test::run_cpu_half<T>(c, &dout, 1);
  auto same = [](const auto& a, const auto& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  for (int threads : {2, 3, 8}) {
    const test::Results again = test::run_cpu_half<T>(c, &dout, threads);
    EXPECT_TRUE(same(first.out, again.out)) << threads << " threads";
    EXPECT_TRUE(same(first.lse, again.lse)) << threads << " threads";
    EXPECT_TRUE(same(first.dq, again.dq)) << threads << " threads";
    EXPECT_TRUE(same(first.dk, again.dk)) << threads << " threads";
    EXPECT_TRUE(same(first.dv, again.dv)) << threads << " threads";
  }
}

class HalfDeterminism : public ::testing::TestWithParam<int64_t> {};

TEST_P(HalfDeterminism, Bfloat16BitwiseIdenticalForAnyThreadCount) {
  expect_bitwise_for_any_thread_count<bfloat16>(GetParam());
}
TEST_P(HalfDeterminism, Float16BitwiseIdenticalForAnyThreadCount) {
  expect_bitwise_for_any_thread_count<float16>(GetParam());
}

// Batch 1 (two-pass backward) and enough batches for the single pass on this machine.
INSTANTIATE_TEST_SUITE_P(Schedules, HalfDeterminism,
                         ::testing::Values(int64_t{1},
                                           int64_t{2} *
                                               std::max(1u, std::thread::hardware_concurrency())));

// A NaN/Inf behind a removed key reaches no output (the scan reads half bits).
template <class T>
void expect_non_finite_stays_behind_mask(Precision precision = Precision::exact) {
  const CaseSpec spec{.name = "nan", .q_len = 80, .k_len = 80, .head_dim = 16, .v_dim = 16,
                      .causal = Causal::top_left};
  Tensor<float, 4> dout;
  test::Case<float> c = test::half_case<T>(spec, 8, dout);
  const int64_t poisoned = 70;
  c.v(0, poisoned, 0, 3) = INFINITY;
  c.k(0, poisoned, 0, 5) = std::nanf("");
  const test::Results r = test::run_cpu_half<T>(c, &dout, 2, false, precision);
  for (int64_t i = 0; i < 80; ++i) {
    bool any_nan = false;
    for (int64_t x = 0; x < 16; ++x) any_nan = any_nan || std::isnan(r.out(0, i, 0, x));
    EXPECT_EQ(any_nan, i >= poisoned) << "query " << i;
    if (i < poisoned) {
      for (int64_t x = 0; x < 16; ++x) EXPECT_TRUE(std::isfinite(r.dq(0, i, 0, x))) << "dq " << i;
    }
  }
}

// On every compiled SIMD target: widening must keep ±inf and NaN (Highway's software
// float16 conversion would not; storage-inl.h).
template <class T>
void expect_non_finite_stays_behind_mask_on_every_target() {
  test::for_each_simd_target([](int64_t) { expect_non_finite_stays_behind_mask<T>(); });
}

TEST(HalfNumerics, Bfloat16NonFiniteBehindMaskStaysThere) {
  expect_non_finite_stays_behind_mask_on_every_target<bfloat16>();
}
TEST(HalfNumerics, Float16NonFiniteBehindMaskStaysThere) {
  expect_non_finite_stays_behind_mask_on_every_target<float16>();
}
// The same through the bf16 dot products (a partial tile with a non-finite V takes the
// float32 path that skips the zero weights; cpu/forward.cpp).
TEST(HalfNumerics, Bfloat16DotProductsNonFiniteBehindMaskStaysThere) {
  if (!cpu::cpu_has_bf16_dot()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const test::ForcedDotProducts on(true);
  expect_non_finite_stays_behind_mask<bfloat16>(Precision::fast);
}

// float16 overflows at 65504: an output that fits is stored, one that does not is inf
// (the IEEE answer), and the fp32 arithmetic inside never overflows for float16 inputs.
TEST(HalfNumerics, Float16LargeValuesComputedInFloat) {
  const CaseSpec spec{.name = "big", .q_len = 9, .k_len = 9, .head_dim = 8, .v_dim = 8};
  Tensor<float, 4> dout;
  test::Case<float> c = test::half_case<float16>(spec, 4, dout);
  for (std::size_t i = 0; i < c.q.size(); ++i) c.q[i] = c.k[i] = 60000.0f;  // logits ~1e9
  for (std::size_t i = 0; i < c.v.size(); ++i) c.v[i] = 60000.0f;
  const test::Results r = test::run_cpu_half<float16>(c, nullptr, 2);
  for (std::size_t i = 0; i < r.out.size(); ++i) EXPECT_EQ(r.out[i], 60000.0f);
  EXPECT_TRUE(test::all_finite(r.lse));
}

// Varlen in half precision: the contract, sequence by sequence, against the fp64
// reference's varlen path on the same widened inputs.
template <class T>
void expect_varlen_contract() {
  const std::vector<int64_t> lengths{5, 130, 0, 67};
  std::vector<int64_t> cu{0};
  for (int64_t n : lengths) cu.push_back(cu.back() + n);
  const int64_t total = cu.back(), hq = 4, hkv = 2, d = 40, dv = 24;
  auto rounded = [](std::array<int64_t, 3> shape, std::uint64_t seed) {
    Tensor<float, 3> t = test::random_tensor<float, 3>(shape, seed);
    test::round_to<T>(t);
    return t;
  };
  const Tensor<float, 3> q = rounded({total, hq, d}, 1), k = rounded({total, hkv, d}, 2),
                         v = rounded({total, hkv, dv}, 3), g = rounded({total, hq, dv}, 4);
  auto as = [](const Tensor<float, 3>& t) {
    Tensor<T, 3> out(t.shape());
    for (std::size_t i = 0; i < t.size(); ++i) out[i] = T(t[i]);
    return out;
  };
  auto to_double = [](const Tensor<float, 3>& t) {
    Tensor<double, 3> out(t.shape());
    for (std::size_t i = 0; i < t.size(); ++i) out[i] = t[i];
    return out;
  };
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  options.execution.threads = 2;
  options.precision = Precision::exact;  // this bound; Precision::fast: test_bf16_dot.cpp
  const std::span<const int64_t> offsets(cu);

  // The storage type on the cpu backend.
  const Tensor<T, 3> qh = as(q), kh = as(k), vh = as(v), gh = as(g);
  Tensor<T, 3> out({total, hq, dv}), dq(qh.shape()), dk(kh.shape()), dvv(vh.shape());
  Tensor<float, 2> lse({hq, total});
  options.execution.backend = Backend::cpu;
  varlen_attention_forward({.q = qh.cview(), .k = kh.cview(), .v = vh.cview(), .out = out.view(),
                            .lse = lse.view(), .cu_seqlens_q = offsets, .cu_seqlens_k = offsets},
                           options);
  varlen_attention_backward({.q = qh.cview(), .k = kh.cview(), .v = vh.cview(),
                             .out = out.cview(), .lse = lse.cview(), .dout = gh.cview(),
                             .dq = dq.view(), .dk = dk.view(), .dv = dvv.view(),
                             .cu_seqlens_q = offsets, .cu_seqlens_k = offsets},
                            options);
  // The exact reference on the same values.
  const Tensor<double, 3> q64 = to_double(q), k64 = to_double(k), v64 = to_double(v),
                          g64 = to_double(g);
  Tensor<double, 3> out64({total, hq, dv}), dq64(q64.shape()), dk64(k64.shape()),
      dv64(v64.shape());
  Tensor<double, 2> lse64({hq, total});
  options.execution.backend = Backend::reference;
  varlen_attention_forward({.q = q64.cview(), .k = k64.cview(), .v = v64.cview(),
                            .out = out64.view(), .lse = lse64.view(), .cu_seqlens_q = offsets,
                            .cu_seqlens_k = offsets},
                           options);
  varlen_attention_backward({.q = q64.cview(), .k = k64.cview(), .v = v64.cview(),
                             .out = out64.cview(), .lse = lse64.cview(), .dout = g64.cview(),
                             .dq = dq64.view(), .dk = dk64.view(), .dv = dv64.view(),
                             .cu_seqlens_q = offsets, .cu_seqlens_k = offsets},
                            options);
  // fp32 allowance: the fp32 kernels' own rule has the plain loop as yardstick; here a
  // fixed 1e-5 relative (an fp32 error this size at N = 130 would be a bug in any case).
  auto check = [](const char* name, const Tensor<T, 3>& got, const Tensor<double, 3>& ref) {
    double worst = 0.0, scale = 0.0, storing = 0.0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(static_cast<float>(got[i])) - ref[i]));
      scale = std::max(scale, std::abs(ref[i]));
      storing = std::max(storing, std::abs(static_cast<float>(T(static_cast<float>(ref[i]))) - ref[i]));
    }
    EXPECT_LE(worst, storing + test::unit_roundoff<T>() * scale + 1e-5 * std::max(1.0, scale))
        << test::storage_label<T>() << " varlen " << name;
  };
  check("out", out, out64);
  check("dq", dq, dq64);
  check("dk", dk, dk64);
  check("dv", dvv, dv64);
  for (std::size_t i = 0; i < lse.size(); ++i)
    EXPECT_NEAR(lse[i], lse64[i], 1e-5 * std::max(1.0, std::abs(lse64[i])));
}

TEST(HalfVarlen, Bfloat16WithinTheContract) { expect_varlen_contract<bfloat16>(); }
TEST(HalfVarlen, Float16WithinTheContract) { expect_varlen_contract<float16>(); }

// The reference backend takes half inputs too: exact in double, rounded once to T.
TEST(HalfReference, WidensExactlyAndRoundsTheExactResult) {
  const CaseSpec spec{.name = "ref", .batch = 2, .q_len = 6, .k_len = 7, .q_heads = 2,
                      .kv_heads = 1, .head_dim = 5, .v_dim = 3, .causal = Causal::bottom_right,
                      .bias_mask = true};
  Tensor<float, 4> dout;
  const test::Case<float> c = test::half_case<bfloat16>(spec, 12, dout);
  const test::Reference exact = test::run_reference(c, &dout);
  const Tensor<bfloat16, 4> q = test::narrow<bfloat16>(c.q), k = test::narrow<bfloat16>(c.k),
                            v = test::narrow<bfloat16>(c.v), g = test::narrow<bfloat16>(dout);
  Tensor<bfloat16, 4> out(exact.out.shape()), dq(q.shape()), dk(k.shape()), dv(v.shape());
  Tensor<float, 3> lse(exact.lse.shape());
  AttentionOptions options = c.options;
  options.execution.backend = Backend::reference;
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                     .lse = lse.view()},
                    options);
  attention_backward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.cview(),
                      .lse = lse.cview(), .dout = g.cview(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view()},
                     options);
  // The reference backward recomputes P from q and k (it reads neither out nor lse), so
  // its gradients are the exact ones, rounded.
  auto rounded = [](double x) { return bfloat16(static_cast<float>(x)).bits; };
  for (std::size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i].bits, rounded(exact.out[i]));
  for (std::size_t i = 0; i < dq.size(); ++i) EXPECT_EQ(dq[i].bits, rounded(exact.dq[i]));
  for (std::size_t i = 0; i < dk.size(); ++i) EXPECT_EQ(dk[i].bits, rounded(exact.dk[i]));
  for (std::size_t i = 0; i < dv.size(); ++i) EXPECT_EQ(dv[i].bits, rounded(exact.dv[i]));
  for (std::size_t i = 0; i < lse.size(); ++i)
    EXPECT_EQ(lse[i], static_cast<float>(exact.lse[i]));
}

// Validation is the same for every storage type, and names the arguments as for float.
TEST(HalfValidation, MessagesNameTheArguments) {
  Tensor<bfloat16, 4> q({1, 4, 2, 8}), k({1, 5, 1, 8}), v({1, 5, 1, 8}), out({1, 4, 2, 8});
  Tensor<float, 3> lse({1, 2, 3});  // seq should be 4
  try {
    attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                       .lse = lse.view()});
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lse.shape[2] (seq): expected 4 (as q.shape[1]), got 3"),
              std::string::npos)
        << e.what();
  }
  // check_finite reads half values and prints them widened.
  Tensor<float16, 4> qh({1, 4, 2, 8}), kh({1, 5, 1, 8}), vh({1, 5, 1, 8}), oh({1, 4, 2, 8});
  vh(0, 2, 0, 3) = float16(-INFINITY);
  AttentionOptions options;
  options.execution.check_finite = true;
  try {
    attention_forward({.q = qh.cview(), .k = kh.cview(), .v = vh.cview(), .out = oh.view()},
                      options);
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("check_finite: v[0, 2, 0, 3] is -inf"),
              std::string::npos)
        << e.what();
  }
  // Outputs must not alias inputs, whatever the storage type.
  try {
    attention_forward({.q = qh.cview(), .k = kh.cview(), .v = vh.cview(),
                       .out = View4<float16>(const_cast<float16*>(qh.data()), {1, 4, 2, 8},
                                             {64, 16, 8, 1})});
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out: must not share memory with q"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace qkv

namespace qkv {
namespace {

// Every variant (window, ALiBi, soft-cap, sinks, dropout, with masks, GQA, key_lengths)
// in half precision: the storage type changes only the loads and the stores, so on the
// same widened values the half kernels give the float32 kernels' results rounded once,
// bit for bit — the forward on q, k, v; the backward on q, k, v, out, lse, dout (the
// float32 kernels fed the stored half out). The float32 kernels themselves are checked
// against the reference for every variant in test_variants.cpp.
struct HalfVariant {
  std::string name;
  CaseSpec spec;
  Window window;
  bool alibi = false, sinks = false;
  float softcap = 0.0f, dropout = 0.0f;
};

std::ostream& operator<<(std::ostream& out, const HalfVariant& v) { return out << v.name; }

std::vector<HalfVariant> half_variants() {
  const CaseSpec base{.name = "", .batch = 2, .q_len = 90, .k_len = 130, .q_heads = 4,
                      .kv_heads = 2, .head_dim = 32, .v_dim = 24};
  CaseSpec masked = base;
  masked.keep_mask = masked.bias_mask = masked.key_padding = true;
  masked.causal = Causal::bottom_right;
  CaseSpec odd = base;
  odd.head_dim = 33;
  odd.v_dim = 17;
  odd.causal = Causal::top_left;
  return {
      {"plain", base},
      {"masked", masked},
      {"odd_dims", odd},
      {"window", base, {40, 20}},
      {"alibi", masked, {}, true},
      {"softcap", base, {}, false, false, 2.5f},
      {"sinks", odd, {16, 16}, false, true},
      {"dropout", masked, {}, false, false, 0.0f, 0.2f},
      {"everything", masked, {50, 10}, true, true, 3.0f, 0.2f},
  };
}

template <class T>
void expect_half_is_fp32_rounded_once(const HalfVariant& v, Precision precision = Precision::exact,
                                      bool gradients = true) {
  const CaseSpec& s = v.spec;
  Tensor<float, 4> dout;
  test::Case<float> c = test::half_case<T>(s, 31, dout);
  std::vector<float> slopes, sinks;
  for (int64_t h = 0; h < s.q_heads; ++h) {
    slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(s.q_heads)));
    sinks.push_back(0.5f * static_cast<float>(h) - 0.3f);
  }
  AttentionOptions options = c.options;
  options.window = v.window;
  options.softcap = v.softcap;
  options.dropout = {.p = v.dropout, .seed = 77, .offset = 3};
  if (v.alibi) options.alibi_slopes = slopes;
  if (v.sinks) options.sinks = sinks;
  options.execution.backend = Backend::cpu;
  options.execution.threads = 2;
  options.precision = precision;  // exact: the claim of the exact arithmetic (bf16 dots round P)

  // Half storage.
  const Tensor<T, 4> q = test::narrow<T>(c.q), k = test::narrow<T>(c.k), vv = test::narrow<T>(c.v),
                     g = test::narrow<T>(dout);
  Tensor<T, 4> out({s.batch, s.q_len, s.q_heads, s.v_dim}), dq(q.shape()), dk(k.shape()),
      dv(vv.shape());
  Tensor<float, 3> lse({s.batch, s.q_heads, s.q_len});
  std::vector<float> dsinks(static_cast<std::size_t>(s.q_heads));
  const std::span<float> dsinks_view = v.sinks ? std::span<float>(dsinks) : std::span<float>();
  attention_forward({.q = q.cview(), .k = k.cview(), .v = vv.cview(), .out = out.view(),
                     .lse = lse.view()},
                    options);
  attention_backward({.q = q.cview(), .k = k.cview(), .v = vv.cview(), .out = out.cview(),
                      .lse = lse.cview(), .dout = g.cview(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view(), .dsinks = dsinks_view},
                     options);
  // float32 on the same values; its backward gets the stored half out.
  Tensor<float, 4> out32(out.shape()), dq32(c.q.shape()), dk32(c.k.shape()), dv32(c.v.shape());
  Tensor<float, 3> lse32(lse.shape());
  std::vector<float> dsinks32(dsinks.size());
  const std::span<float> dsinks32_view =
      v.sinks ? std::span<float>(dsinks32) : std::span<float>();
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out32.view(),
                     .lse = lse32.view()},
                    options);
  const Tensor<float, 4> stored_out = test::widened(out);
  attention_backward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(),
                      .out = stored_out.cview(), .lse = lse.cview(), .dout = dout.cview(),
                      .dq = dq32.view(), .dk = dk32.view(), .dv = dv32.view(),
                      .dsinks = dsinks32_view},
                     options);
  auto expect_rounded = [](const char* name, const Tensor<T, 4>& half, const Tensor<float, 4>& fp32) {
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < half.size(); ++i)
      mismatches += half[i].bits != T(fp32[i]).bits && !(std::isnan(fp32[i]) && std::isnan(static_cast<float>(half[i])));
    EXPECT_EQ(mismatches, 0u) << test::storage_label<T>() << " " << name;
  };
  expect_rounded("out", out, out32);
  EXPECT_EQ(std::memcmp(lse.data(), lse32.data(), lse.size() * sizeof(float)), 0) << "lse";
  if (!gradients) return;
  expect_rounded("dq", dq, dq32);
  expect_rounded("dk", dk, dk32);
  expect_rounded("dv", dv, dv32);
  EXPECT_EQ(dsinks, dsinks32) << "dsinks";
}

class HalfVariants : public ::testing::TestWithParam<HalfVariant> {};

TEST_P(HalfVariants, Bfloat16IsTheFp32KernelRoundedOnce) {
  expect_half_is_fp32_rounded_once<bfloat16>(GetParam());
}
TEST_P(HalfVariants, Float16IsTheFp32KernelRoundedOnce) {
  expect_half_is_fp32_rounded_once<float16>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(All, HalfVariants, ::testing::ValuesIn(half_variants()),
                         [](const auto& param_info) { return param_info.param.name; });

// Decode-shaped calls (≤ 16 queries, no elementwise mask) with Precision::fast take the
// split-K schedule as the float32 kernel does (cpu/forward_schedule.cpp): with the dot
// products off, the half result is the float32 kernel's rounded once, bit for bit, with
// every variant that schedule runs (dropout is the tiled schedule's, for both).
std::vector<HalfVariant> decode_variants() {
  const CaseSpec base{.name = "", .batch = 2, .q_len = 3, .k_len = 300, .q_heads = 6, .kv_heads = 2,
                      .head_dim = 32, .v_dim = 24, .causal = Causal::bottom_right};
  CaseSpec padded = base;
  padded.key_padding = true;
  CaseSpec smollm = base;  // SmolLM2's decode step: one query, 9 heads on 3
  smollm.batch = 1;
  smollm.q_len = 1;
  smollm.q_heads = 9;
  smollm.kv_heads = 3;
  smollm.head_dim = smollm.v_dim = 64;
  CaseSpec odd = base;
  odd.q_len = 16;
  odd.head_dim = 33;
  odd.v_dim = 17;
  odd.causal = Causal::top_left;
  return {
      {"plain", base},
      {"padded", padded},
      {"smollm_step", smollm},
      {"odd_top_left", odd},
      {"window", base, {40, 0}},
      {"alibi", padded, {}, true},
      {"softcap", base, {}, false, false, 2.5f},
      {"sinks", odd, {16, 16}, false, true},
      {"dropout", base, {}, false, false, 0.0f, 0.2f},
  };
}

class HalfDecodeVariants : public ::testing::TestWithParam<HalfVariant> {};

// The forward only (out and lse): on these shapes the half backward is not the float32
// backward's bits (a few dq/dk/dv elements, with Precision::exact as well: the backward
// schedules of the two storages differ there, which this change does not touch; the half
// backward is held to the contract by HalfAgainstReference and test_bf16_dot.cpp).
TEST_P(HalfDecodeVariants, Bfloat16FastIsTheFp32KernelRoundedOnce) {
  cpu::set_dot_products_for_test(false);
  expect_half_is_fp32_rounded_once<bfloat16>(GetParam(), Precision::fast, /*gradients=*/false);
  cpu::set_dot_products_for_test(std::nullopt);
}
TEST_P(HalfDecodeVariants, Float16FastIsTheFp32KernelRoundedOnce) {
  expect_half_is_fp32_rounded_once<float16>(GetParam(), Precision::fast, /*gradients=*/false);
}

INSTANTIATE_TEST_SUITE_P(All, HalfDecodeVariants, ::testing::ValuesIn(decode_variants()),
                         [](const auto& param_info) { return param_info.param.name; });

// The same shapes with Precision::fast as this CPU runs it (the bf16 dot products where
// they pay: the latent step for one kv head of 16 query heads), against the contract, on
// every compiled SIMD target.
TEST(HalfDecodeShape, FastWithinTheContractOnEveryTarget) {
  const CaseSpec latent{.name = "latent", .q_len = 2, .k_len = 300, .q_heads = 16, .kv_heads = 1,
                        .head_dim = 80, .v_dim = 64, .causal = Causal::bottom_right};
  test::for_each_simd_target([&](int64_t) {
    for (const HalfVariant& v : decode_variants()) {
      if (v.window.active() || v.alibi || v.sinks || v.softcap > 0 || v.dropout > 0) continue;  // plain shapes
      SCOPED_TRACE(v.name);
      test::check_half_case<bfloat16>(v.spec, 2, false, 1234, Precision::fast);
      test::check_half_case<float16>(v.spec, 2, true, 1234, Precision::fast);
    }
    SCOPED_TRACE("latent");
    test::check_half_case<bfloat16>(latent, 2, false, 1234, Precision::fast);
  });
}

}  // namespace
}  // namespace qkv
