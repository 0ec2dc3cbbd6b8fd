// Programmable modifiers (qkv/modifiers.hpp): score_mod and mask_mod on the cpu kernels
// against the fp64 reference, forward and backward; mods that restate a built-in against
// the built-in; determinism; every compiled SIMD target. The tile plan built from
// mask_mod: test_modifier_plan.cpp; the reference's gradients and non-finite mods:
// test_modifier_numerics.cpp; errors: test_modifier_errors.cpp; tolerance:
// modifier_check.hpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "half_check.hpp"
#include "modifier_check.hpp"
#include "simd_targets.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;
using namespace test::modifiers;

// ---------------------------------------------------------------------------------------
// Mods that restate a built-in.

// Soft-cap as a score_mod: c·tanh(s/c), derivative 1 − tanh². The built-in evaluates tanh
// with Highway's vector Tanh, the mod with std::tanh (both within a few ULP), so the
// logits differ by a few float roundings of |s| ≤ c: results agree to ~1e-6 of O(1)
// values, and a misplaced cap (before or after ALiBi, or no derivative) is off by O(0.1).
// Both reference runs agree to fp64 rounding (the mod is evaluated in double there).
TEST(ScoreMod, SoftcapMatchesTheBuiltIn) {
  const float cap = 1.5f;
  const auto softcap = score_mod(
      [cap](auto s, int64_t, int64_t, int64_t, int64_t) { return cap * std::tanh(s / cap); },
      [cap](auto s, int64_t, int64_t, int64_t, int64_t) {
        const auto t = std::tanh(s / cap);
        return 1 - t * t;
      });
  CaseSpec spec = kShape;
  spec.causal = Causal::bottom_right;
  spec.key_padding = true;
  Case<float> builtin(spec, 11), programmable(spec, 11);
  builtin.options.softcap = cap;
  programmable.options.modifiers.score = softcap;
  const test::Results a = run(builtin), b = run(programmable);
  EXPECT_LE(test::max_abs_diff(a.out, b.out), 2e-6);
  EXPECT_LE(test::max_abs_diff(a.lse, b.lse), 2e-6);
  EXPECT_LE(test::max_abs_diff(a.dq, b.dq), 1e-5);
  EXPECT_LE(test::max_abs_diff(a.dk, b.dk), 1e-5);
  EXPECT_LE(test::max_abs_diff(a.dv, b.dv), 1e-5);
  const auto dout = test::random_tensor<float, 4>({spec.batch, spec.q_len, spec.q_heads, spec.v_dim}, 4);
  const test::Reference ra = test::run_reference(builtin, &dout), rb = test::run_reference(programmable, &dout);
  EXPECT_LE(test::max_abs_diff(ra.out, rb.out), 1e-12);
  EXPECT_LE(test::max_abs_diff(ra.dq, rb.dq), 1e-12);
  EXPECT_LE(test::max_abs_diff(ra.dk, rb.dk), 1e-12);
  expect_near_reference(programmable);
}

// ALiBi as a score_mod: s − slope_h·|i + Nk_b − Nq − j|, written with std::fma as the
// built-in's tile (one rounding; the distance is exact in float), derivative 1. On SIMD
// targets with FMA (AVX2, AVX-512) it is the built-in bit for bit; elsewhere within one
// rounding of each logit.
TEST(ScoreMod, AlibiMatchesTheBuiltInBits) {
  CaseSpec spec = kShape;
  spec.causal = Causal::top_left;
  spec.key_padding = true;
  Case<float> builtin(spec, 12), programmable(spec, 12);
  std::vector<float> slopes{0.5f, 0.25f, 0.125f, 0.0625f};
  const std::vector<int64_t>& lengths = builtin.key_lengths;
  builtin.options.alibi_slopes = slopes;
  const int64_t q_len = spec.q_len;
  const auto alibi = score_mod(
      [&slopes, &lengths, q_len](float s, int64_t b, int64_t h, int64_t i, int64_t j) {
        const float distance = std::abs(static_cast<float>(i + lengths[b] - q_len - j));
        return std::fma(-slopes[h], distance, s);
      },
      [](float, int64_t, int64_t, int64_t, int64_t) { return 1.0f; });
  programmable.options.modifiers.score = alibi;
  const test::Results a = run(builtin), b = run(programmable);
  const std::string target = cpu::simd_target_name();
  if (target.rfind("AVX", 0) == 0) {
    EXPECT_TRUE(same_results(a, b)) << target;
  } else {
    EXPECT_LE(test::max_abs_diff(a.out, b.out), 2e-6) << target;
    EXPECT_LE(test::max_abs_diff(a.dq, b.dq), 1e-5) << target;
  }
  expect_near_reference(programmable);
}

// Causal and window masks as mask_mods give the built-in's bits: the plan classes the
// tiles alike (mask_mod is exact on the pairs: empty above the diagonal, full below, the
// diagonal partial), and a partial tile's removed scores are −inf either way.
TEST(MaskMod, CausalAndWindowMatchTheBuiltInBits) {
  {
    CaseSpec spec = kShape;
    Case<float> builtin(spec, 13), programmable(spec, 13);
    builtin.options.causal = Causal::top_left;
    const auto causal = mask_mod([](int64_t, int64_t, int64_t i, int64_t j) { return j <= i; },
                                 {.varies_with_head = false});
    programmable.options.modifiers.mask = causal;
    EXPECT_TRUE(same_results(run(builtin), run(programmable))) << "causal top-left";
  }
  {
    // FlashAttention's window with no causal mode aligns bottom-right: offset Nk − Nq.
    CaseSpec spec = kShape;
    Case<float> builtin(spec, 14), programmable(spec, 14);
    builtin.options.window = {40, 10};
    const int64_t offset = spec.k_len - spec.q_len;
    const auto window = mask_mod(
        [offset](int64_t, int64_t, int64_t i, int64_t j) {
          return j >= i + offset - 40 && j <= i + offset + 10;
        },
        {.varies_with_head = false});
    programmable.options.modifiers.mask = window;
    EXPECT_TRUE(same_results(run(builtin), run(programmable))) << "window (40, 10)";
  }
}

// ---------------------------------------------------------------------------------------
// Nontrivial mods, cpu against the reference.

// A learned relative-position bias per head, captured by pointer, with a per-head
// temperature (derivative: the temperature), plus GQA, causality and key padding.
TEST(Modifiers, RelativePositionBiasMatchesReference) {
  CaseSpec spec = kShape;
  spec.causal = Causal::bottom_right;
  spec.key_padding = true;
  Case<float> c(spec, 16);
  const int64_t span = spec.q_len + spec.k_len;  // i − j + k_len ∈ [0, span)
  std::vector<float> table(static_cast<std::size_t>(spec.q_heads * span)),
      temperature{0.7f, 1.3f, 1.0f, 2.0f};
  for (std::size_t x = 0; x < table.size(); ++x) table[x] = std::sin(0.37f * static_cast<float>(x));
  const float* bias = table.data();
  const float* temp = temperature.data();
  const int64_t k_len = spec.k_len;
  const auto relative = score_mod(
      [bias, temp, span, k_len](auto s, int64_t, int64_t h, int64_t i, int64_t j) {
        return s * temp[h] + bias[h * span + (i - j + k_len)];
      },
      [temp](auto, int64_t, int64_t h, int64_t, int64_t) { return temp[h]; });
  c.options.modifiers.score = relative;
  for (int threads : {1, 3}) expect_near_reference(c, threads);
}

// A document mask (mask_mod, the same for every head) with causality, a soft-capping
// score_mod, the built-in ALiBi and sinks on top (everything composes), and dropout.
TEST(Modifiers, DocumentMaskWithEverythingMatchesReference) {
  CaseSpec spec = kShape;
  spec.causal = Causal::top_left;
  spec.keep_mask = true;  // mask.keep combines with mask_mod
  Case<float> c(spec, 17);
  std::vector<int32_t> document(static_cast<std::size_t>(std::max(spec.q_len, spec.k_len)));
  for (std::size_t x = 0; x < document.size(); ++x)
    document[x] = static_cast<int32_t>(x < 37 ? 0 : x < 100 ? 1 : x < 101 ? 2 : 3);
  const int32_t* doc = document.data();
  const auto documents = mask_mod(
      [doc](int64_t, int64_t, int64_t i, int64_t j) { return doc[i] == doc[j]; },
      {.varies_with_head = false});
  const float cap = 2.0f;
  const auto softcap = score_mod(
      [cap](auto s, int64_t, int64_t, int64_t, int64_t) { return cap * std::tanh(s / cap); },
      [cap](auto s, int64_t, int64_t, int64_t, int64_t) {
        const auto t = std::tanh(s / cap);
        return 1 - t * t;
      });
  std::vector<float> slopes{0.5f, 0.25f, 0.125f, 0.0625f}, sinks{0.1f, -0.4f, 0.9f, 0.0f};
  c.options.modifiers = {.score = softcap, .mask = documents};
  c.options.alibi_slopes = slopes;
  c.options.sinks = sinks;
  c.options.dropout = {.p = 0.2f, .seed = 5, .offset = 1};
  expect_near_reference(c, 3);
}

// A per-entry, per-head mask_mod (prefix-LM: the first prefix[b] keys are seen by every
// query, the rest causally; head 3 also drops odd keys) on a varlen batch, where b is
// the sequence and i, j positions within it.
TEST(Modifiers, VarlenPerSequenceMaskMatchesReference) {
  const std::vector<int64_t> lengths{70, 0, 130, 5}, cu{0, 70, 70, 200, 205};
  const std::vector<int64_t> prefix{10, 0, 80, 2};
  const int64_t total = cu.back(), heads = 4, dim = 16;
  const auto q = test::random_tensor<float, 3>({total, heads, dim}, 21);
  const auto k = test::random_tensor<float, 3>({total, 2, dim}, 22);
  const auto v = test::random_tensor<float, 3>({total, 2, dim}, 23);
  const auto dout = test::random_tensor<float, 3>({total, heads, dim}, 24);
  const int64_t* pre = prefix.data();
  const auto prefix_lm = mask_mod([pre](int64_t b, int64_t h, int64_t i, int64_t j) {
    return (j < pre[b] || j <= i) && (h != 3 || j % 2 == 0);
  });
  const auto scaled = score_mod([](auto s, int64_t b, int64_t, int64_t, int64_t) { return s * (1 + 0.5f * static_cast<float>(b)); },
                                [](auto, int64_t b, int64_t, int64_t, int64_t) { return 1 + 0.5f * static_cast<float>(b); });
  auto run_on = [&](Backend backend, auto zero) {
    using T = decltype(zero);
    auto widen = [](const Tensor<float, 3>& t) {
      Tensor<T, 3> w(t.shape());
      for (std::size_t x = 0; x < t.size(); ++x) w[x] = static_cast<T>(t[x]);
      return w;
    };
    const auto qw = widen(q), kw = widen(k), vw = widen(v), gw = widen(dout);
    Tensor<T, 3> out({total, heads, dim}), dq(q.shape()), dk(k.shape()), dv(v.shape());
    Tensor<T, 2> lse({heads, total});
    AttentionOptions options;
    options.execution.backend = backend;
    options.modifiers = {.score = scaled, .mask = prefix_lm};
    const std::span<const int64_t> offsets(cu);
    varlen_attention_forward({.q = qw.cview(), .k = kw.cview(), .v = vw.cview(), .out = out.view(),
                              .lse = lse.view(), .cu_seqlens_q = offsets, .cu_seqlens_k = offsets},
                             options);
    varlen_attention_backward({.q = qw.cview(), .k = kw.cview(), .v = vw.cview(), .out = out.cview(),
                               .lse = lse.cview(), .dout = gw.cview(), .dq = dq.view(),
                               .dk = dk.view(), .dv = dv.view(), .cu_seqlens_q = offsets,
                               .cu_seqlens_k = offsets},
                              options);
    return std::vector<Tensor<T, 3>>{out, dq, dk, dv};
  };
  const auto cpu = run_on(Backend::cpu, 0.0f);
  const auto ref = run_on(Backend::reference, 0.0);
  const char* names[] = {"out", "dq", "dk", "dv"};
  for (std::size_t t = 0; t < 4; ++t) {
    double scale = 1.0;
    for (std::size_t x = 0; x < ref[t].size(); ++x) scale = std::max(scale, std::abs(ref[t][x]));
    EXPECT_LE(test::error(cpu[t], ref[t]), (t == 0 ? 4e-6 : 2e-5) * scale) << names[t];
  }
}

// On every SIMD target this build compiled (the hooks are plain calls; the chain rule
// and masking around them are per-target code): cpu against the reference.
TEST(Modifiers, EveryCompiledTargetMatchesReference) {
  const auto relative = score_mod(
      [](auto s, int64_t, int64_t h, int64_t i, int64_t j) {
        return 0.8f * s - 0.03f * static_cast<float>(h + 1) * static_cast<float>(i > j ? i - j : j - i);
      },
      [](auto, int64_t, int64_t, int64_t, int64_t) { return 0.8f; });
  const auto documents = mask_mod([](int64_t, int64_t, int64_t i, int64_t j) { return i / 50 == j / 50; },
                                  {.varies_with_head = false});
  CaseSpec spec = kShape;
  spec.causal = Causal::top_left;
  Case<float> c(spec, 27);
  c.options.modifiers = {.score = relative, .mask = documents};
  test::for_each_simd_target([&](int64_t) { expect_near_reference(c); });
}

// Few queries against many keys (the decode kernel's shapes, which it cannot modify):
// calls with modifiers take the tiled kernels and agree with the reference.
TEST(Modifiers, DecodeShapesRunTheModifiers) {
  const CaseSpec spec{.name = "decode", .batch = 2, .q_len = 3, .k_len = 300, .q_heads = 4,
                      .kv_heads = 1, .head_dim = 32, .v_dim = 32, .causal = Causal::bottom_right};
  Case<float> c(spec, 28);
  const auto recent = mask_mod([](int64_t, int64_t h, int64_t, int64_t j) { return j % (h + 2) != 0; });
  const auto scaled = score_mod([](auto s, int64_t, int64_t, int64_t, int64_t) { return 2 * s; },
                                [](auto, int64_t, int64_t, int64_t, int64_t) { return 2.0f; });
  c.options.modifiers = {.score = scaled, .mask = recent};
  expect_near_reference(c);
}

// Bitwise identical results for 1 and 3 threads (the mods are pure; each tile has one
// writer), with both modifiers and a per-head mask.
TEST(Modifiers, BitwiseIdenticalForAnyThreadCount) {
  Case<float> c(kShape, 18);
  const auto relative = score_mod(
      [](auto s, int64_t, int64_t h, int64_t i, int64_t j) {
        return s - 0.01f * static_cast<float>(h + 1) * static_cast<float>(i > j ? i - j : j - i);
      },
      [](auto, int64_t, int64_t, int64_t, int64_t) { return 1.0f; });
  const auto stripes = mask_mod([](int64_t, int64_t h, int64_t i, int64_t j) { return (i + j + h) % 5 != 0; });
  c.options.modifiers = {.score = relative, .mask = stripes};
  EXPECT_TRUE(same_results(run(c, 1), run(c, 3)));
  expect_near_reference(c, 3);
}

// bfloat16 storage runs the same mods: on inputs exact in bfloat16, the kernels compute in
// float as for float storage and round each output once, so every output is within one
// bfloat16 rounding (2⁻⁸ relative) of the float run's, plus float noise (1e-6); the
// backward gets the same out (the bfloat16 one, widened) and lse on both sides. A mod
// skipped or misapplied on the 16-bit path is off by O(0.1).
TEST(Modifiers, Bfloat16StorageRunsTheSameMods) {
  CaseSpec spec = kShape;
  spec.causal = Causal::bottom_right;
  Case<float> c(spec, 25);
  test::round_to<bfloat16>(c.q);
  test::round_to<bfloat16>(c.k);
  test::round_to<bfloat16>(c.v);
  auto dout = test::random_tensor<float, 4>({spec.batch, spec.q_len, spec.q_heads, spec.v_dim}, 26);
  test::round_to<bfloat16>(dout);
  const auto relative = score_mod(
      [](auto s, int64_t, int64_t h, int64_t i, int64_t j) {
        return 1.5f * s - 0.02f * static_cast<float>(h + 1) * static_cast<float>(i > j ? i - j : j - i);
      },
      [](auto, int64_t, int64_t, int64_t, int64_t) { return 1.5f; });
  const auto stripes = mask_mod([](int64_t, int64_t h, int64_t i, int64_t j) { return (i + 2 * j + h) % 7 != 0; });
  AttentionOptions options;
  options.causal = spec.causal;
  options.execution.backend = Backend::cpu;
  options.modifiers = {.score = relative, .mask = stripes};
  options.precision = Precision::exact;  // one rounding of the float run (bf16 dots round P too)

  const auto q16 = test::narrow<bfloat16>(c.q), k16 = test::narrow<bfloat16>(c.k),
             v16 = test::narrow<bfloat16>(c.v), g16 = test::narrow<bfloat16>(dout);
  Tensor<bfloat16, 4> out16({spec.batch, spec.q_len, spec.q_heads, spec.v_dim}), dq16(q16.shape()),
      dk16(k16.shape()), dv16(v16.shape());
  Tensor<float, 3> lse16({spec.batch, spec.q_heads, spec.q_len}), lse32(lse16.shape());
  attention_forward({.q = q16.cview(), .k = k16.cview(), .v = v16.cview(), .out = out16.view(),
                     .lse = lse16.view()}, options);
  attention_backward({.q = q16.cview(), .k = k16.cview(), .v = v16.cview(), .out = out16.cview(),
                      .lse = lse16.cview(), .dout = g16.cview(), .dq = dq16.view(),
                      .dk = dk16.view(), .dv = dv16.view()}, options);
  Tensor<float, 4> out32(out16.shape()), dq32(c.q.shape()), dk32(c.k.shape()), dv32(c.v.shape());
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out32.view(),
                     .lse = lse32.view()}, options);
  const Tensor<float, 4> out_stored = test::widened(out16);
  attention_backward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out_stored.cview(),
                      .lse = lse16.cview(), .dout = dout.cview(), .dq = dq32.view(),
                      .dk = dk32.view(), .dv = dv32.view()}, options);
  auto expect_one_rounding = [](const Tensor<bfloat16, 4>& half, const Tensor<float, 4>& full, const char* name) {
    double worst = 0.0;
    for (std::size_t x = 0; x < full.size(); ++x) {
      const double wide = static_cast<float>(half[x]);
      worst = std::max(worst, std::abs(wide - full[x]) - (0x1p-8 * std::abs(full[x]) + 1e-6));
    }
    EXPECT_LE(worst, 0.0) << name;
  };
  expect_one_rounding(out16, out32, "out");
  expect_one_rounding(dq16, dq32, "dq");
  expect_one_rounding(dk16, dk32, "dk");
  expect_one_rounding(dv16, dv32, "dv");
  EXPECT_LE(test::max_abs_diff(lse16, lse32), 1e-6);
}

}  // namespace
}  // namespace qkv
