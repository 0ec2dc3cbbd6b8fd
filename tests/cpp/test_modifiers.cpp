// Programmable modifiers (qkv/modifiers.hpp): score_mod and mask_mod on the cpu kernels
// against the fp64 reference, forward and backward; mods that restate a built-in against
// the built-in; the tile plan built from mask_mod (empty tiles never scored); the
// reference's backward against finite differences; determinism; every error path.
//
// Tolerance, cpu vs reference (as test_variants.cpp): 4e-6·max(1, max|ref|) for out and
// LSE, 2e-5·max(1, max|ref|) for gradients: the fp32 kernels sum ≤ 200 terms blockwise
// (observed 1e-7 to 2e-6 on these O(1) values), while a modifier applied wrongly (a wrong
// index, a missing derivative) is off by O(0.1).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/tile_plan.hpp"
#include "cpu_check.hpp"
#include "finite_difference.hpp"
#include "half_check.hpp"
#include "simd_targets.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;

template <class T, int R>
bool same_bits(const Tensor<T, R>& a, const Tensor<T, R>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

bool same_results(const test::Results& a, const test::Results& b) {
  return same_bits(a.out, b.out) && same_bits(a.lse, b.lse) && same_bits(a.dq, b.dq) &&
         same_bits(a.dk, b.dk) && same_bits(a.dv, b.dv);
}

// cpu (fp32, `threads`) against the reference (fp64) on the case's options.
void expect_near_reference(const Case<float>& c, int threads = 2) {
  const CaseSpec& s = c.spec;
  const auto dout = test::random_tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}, 4);
  const test::Results cpu = test::run_cpu(c, {s, false, false, threads}, &dout);
  const test::Reference ref = test::run_reference(c, &dout);
  EXPECT_LE(test::error(cpu.out, ref.out), test::relative_tolerance(4e-6, ref.out)) << "out";
  EXPECT_LE(test::error(cpu.lse, ref.lse), test::relative_tolerance(4e-6, ref.lse)) << "lse";
  EXPECT_LE(test::error(cpu.dq, ref.dq), test::relative_tolerance(2e-5, ref.dq)) << "dq";
  EXPECT_LE(test::error(cpu.dk, ref.dk), test::relative_tolerance(2e-5, ref.dk)) << "dk";
  EXPECT_LE(test::error(cpu.dv, ref.dv), test::relative_tolerance(2e-5, ref.dv)) << "dv";
}

test::Results run(const Case<float>& c, int threads = 2) {
  const CaseSpec& s = c.spec;
  const auto dout = test::random_tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}, 4);
  return test::run_cpu(c, {s, false, false, threads}, &dout);
}

// A shape past the decode kernel's query count (which takes no modifiers) and not a
// multiple of the 64-wide tiles.
const CaseSpec kShape{.name = "mods", .batch = 2, .q_len = 150, .k_len = 170, .q_heads = 4,
                      .kv_heads = 2, .head_dim = 32, .v_dim = 24};

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
// The plan.

detail::MaskRule dense_rule(int64_t batch, int64_t q_len, int64_t k_len) {
  detail::MaskRule rule;
  rule.sequences = {.count = batch, .dense_q_len = q_len, .dense_k_len = k_len};
  return rule;
}

// A block-diagonal mask_mod: only the 64×64 tiles on the diagonal are non-empty, and full.
TEST(MaskModPlan, BlockDiagonalTilesAreFullAndTheRestEmpty) {
  const auto blocks = mask_mod(
      [](int64_t, int64_t, int64_t i, int64_t j) { return i / 64 == j / 64; });
  detail::MaskRule rule = dense_rule(1, 200, 200);
  rule.mask_mod = blocks;
  const detail::Extents e{.batch = 1, .q_len = 200, .k_len = 200, .q_heads = 2, .kv_heads = 1,
                          .head_dim = 8, .v_dim = 8};
  const detail::TilePlan plan(rule, e, 64, 64, 2);
  EXPECT_TRUE(plan.per_head());
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t qb = 0; qb < 4; ++qb) {
      EXPECT_EQ(plan.busy_key_blocks(0, h, qb), 1);
      for (int64_t kb = 0; kb < 4; ++kb)
        EXPECT_EQ(plan.at(0, h, qb, kb), qb == kb ? detail::Tile::full : detail::Tile::empty)
            << qb << ", " << kb;
    }
}

// Per-head masks give per-head classes; the plan evaluates only pairs the other masks
// leave (causality here), so a mask_mod that is false above the diagonal never matters.
TEST(MaskModPlan, PerHeadClassesAndOnlyVisiblePairsEvaluated) {
  std::atomic<int64_t> above_diagonal{0};
  const auto shifted = mask_mod([&above_diagonal](int64_t, int64_t h, int64_t i, int64_t j) {
    if (j > i) above_diagonal.fetch_add(1, std::memory_order_relaxed);
    return j <= i - 64 * h;  // head h sees keys at least 64·h behind
  });
  detail::MaskRule rule = dense_rule(1, 256, 256);
  rule.causal = Causal::top_left;
  rule.mask_mod = shifted;
  const detail::Extents e{.batch = 1, .q_len = 256, .k_len = 256, .q_heads = 2, .kv_heads = 2,
                          .head_dim = 8, .v_dim = 8};
  const detail::TilePlan plan(rule, e, 64, 64, 1);
  EXPECT_EQ(above_diagonal.load(), 0);
  for (int64_t qb = 0; qb < 4; ++qb) {
    EXPECT_EQ(plan.at(0, 0, qb, qb), detail::Tile::partial);  // head 0: plain causal
    if (qb > 0) {
      EXPECT_EQ(plan.at(0, 0, qb, qb - 1), detail::Tile::full);
      EXPECT_EQ(plan.at(0, 1, qb, qb), detail::Tile::empty);  // head 1: one block further back
      EXPECT_EQ(plan.at(0, 1, qb, qb - 1), detail::Tile::partial);
    }
  }
  EXPECT_EQ(plan.busy_key_blocks(0, 1, 0), 0);
}

// Every score_mod call of a block-diagonal mask lies in a diagonal tile: empty tiles are
// never scored. The forward scores each diagonal tile exactly once per (entry, head).
TEST(MaskModPlan, ScoreModNeverRunsOnAnEmptyTile) {
  std::atomic<int64_t> calls{0}, off_diagonal{0};
  const auto counting = score_mod(
      [&](float s, int64_t, int64_t, int64_t i, int64_t j) {
        calls.fetch_add(1, std::memory_order_relaxed);
        if (i / 64 != j / 64) off_diagonal.fetch_add(1, std::memory_order_relaxed);
        return s;
      },
      [](float, int64_t, int64_t, int64_t, int64_t) { return 1.0f; });
  const auto blocks = mask_mod([](int64_t, int64_t, int64_t i, int64_t j) { return i / 64 == j / 64; },
                               {.varies_with_head = false});
  const CaseSpec spec{.name = "blocks", .batch = 2, .q_len = 200, .k_len = 200, .q_heads = 3,
                      .kv_heads = 1, .head_dim = 16, .v_dim = 16};
  Case<float> c(spec, 15);
  c.options.modifiers = {.score = counting, .mask = blocks};
  Tensor<float, 4> out({2, 200, 3, 16});
  Tensor<float, 3> lse({2, 3, 200});
  AttentionOptions options = c.options;
  options.execution.backend = Backend::cpu;
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = lse.view()}, options);
  const int64_t per_head = 3 * 64 * 64 + 8 * 8;  // the diagonal tiles of 200 = 3·64 + 8
  EXPECT_EQ(calls.load(), 2 * 3 * per_head);
  EXPECT_EQ(off_diagonal.load(), 0);
  // The backward too (its schedule may score a tile twice, but never an empty one).
  calls = 0;
  const auto dout = test::random_tensor<float, 4>({2, 200, 3, 16}, 4);
  Tensor<float, 4> dq(c.q.shape()), dk(c.k.shape()), dv(c.v.shape());
  attention_backward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.cview(),
                      .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view()}, options);
  EXPECT_GE(calls.load(), 2 * 3 * per_head);
  EXPECT_EQ(off_diagonal.load(), 0);
  // And the result is block-diagonal attention: the reference agrees.
  expect_near_reference(c);
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

// ---------------------------------------------------------------------------------------
// The reference as the oracle: its explicit-Jacobian backward (through the mod's
// derivative) against central differences of its own fp64 forward, the mods evaluated
// in double (`auto` score).
TEST(ModifierGradients, ReferenceBackwardMatchesFiniteDifferences) {
  const CaseSpec spec{.name = "fd", .batch = 2, .q_len = 4, .k_len = 6, .q_heads = 2,
                      .kv_heads = 1, .head_dim = 3, .v_dim = 2, .causal = Causal::bottom_right};
  Case<double> c(spec, 5);
  const std::vector<double> table{0.3, -0.2, 0.5, 0.1, -0.7, 0.4, 0.2, 0.0, -0.1, 0.6, 0.25};
  const double* bias = table.data();
  const auto mod = score_mod(
      [bias](auto s, int64_t b, int64_t h, int64_t i, int64_t j) {
        const double gain = 1.0 + 0.5 * static_cast<double>(h) - 0.25 * static_cast<double>(b);
        return 2.0 * std::tanh(gain * s / 2.0) + bias[i - j + 6];
      },
      [](auto s, int64_t b, int64_t h, int64_t, int64_t) {
        const double gain = 1.0 + 0.5 * static_cast<double>(h) - 0.25 * static_cast<double>(b);
        const double t = std::tanh(gain * s / 2.0);
        return gain * (1.0 - t * t);
      });
  const auto mask = mask_mod([](int64_t b, int64_t h, int64_t i, int64_t j) { return (i + j + b + h) % 3 != 1 || j == 0; });
  c.options.modifiers = {.score = mod, .mask = mask};
  c.options.execution.backend = Backend::reference;
  const auto dout = test::random_tensor<double, 4>({2, 4, 2, 2}, 6);
  Tensor<double, 4> out({2, 4, 2, 2}), dq(c.q.shape()), dk(c.k.shape()), dv(c.v.shape());
  Tensor<double, 3> lse({2, 2, 4});
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = lse.view()}, c.options);
  attention_backward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.cview(),
                      .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view()}, c.options);
  auto loss = [&]() {
    Tensor<double, 4> o({2, 4, 2, 2});
    attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = o.view()}, c.options);
    double sum = 0.0;
    for (std::size_t i = 0; i < o.size(); ++i) sum += o[i] * dout[i];
    return sum;
  };
  test::expect_gradient_matches(c.q, dq, 1e-6, 1e-7, loss, "dq");
  test::expect_gradient_matches(c.k, dk, 1e-6, 1e-7, loss, "dk");
  test::expect_gradient_matches(c.v, dv, 1e-6, 1e-7, loss, "dv");
  // The check has something to check.
  EXPECT_GT(std::max({test::max_abs(dq), test::max_abs(dk), test::max_abs(dv)}), 1e-2);
}

// A generic (`auto`) score_mod runs in double on the reference: adding 1e-10 to every
// logit moves the LSE by exactly that (a float evaluation would lose it).
TEST(ModifierGradients, ReferenceEvaluatesGenericModsInDouble) {
  const CaseSpec spec{.name = "fp64", .q_len = 3, .k_len = 5};
  Case<double> c(spec, 7);
  c.options.execution.backend = Backend::reference;
  Tensor<double, 4> out({1, 3, 1, 4});
  Tensor<double, 3> plain({1, 1, 3}), shifted({1, 1, 3});
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = plain.view()}, c.options);
  const auto shift = score_mod([](auto s, int64_t, int64_t, int64_t, int64_t) { return s + 1e-10; });
  c.options.modifiers.score = shift;
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = shifted.view()}, c.options);
  for (int64_t i = 0; i < 3; ++i) EXPECT_NEAR(shifted(0, 0, i) - plain(0, 0, i), 1e-10, 1e-14);
}

// ---------------------------------------------------------------------------------------
// Non-finite mod results.

// A NaN from score_mod poisons its query row only, on both backends; mask_mod's removed
// pairs never reach the row even when score_mod gives NaN there.
TEST(ModifierNumerics, NaNFromScoreModPoisonsOnlyItsRow) {
  const auto poison = score_mod([](float s, int64_t, int64_t h, int64_t i, int64_t j) {
    if (h == 1 && i == 70 && j == 3) return std::numeric_limits<float>::quiet_NaN();
    if (j == 100) return std::numeric_limits<float>::quiet_NaN();  // removed by the mask
    return s;
  });
  const auto no_key_100 = mask_mod([](int64_t, int64_t, int64_t, int64_t j) { return j != 100; },
                                   {.varies_with_head = false});
  Case<float> c(kShape, 19);
  c.options.modifiers = {.score = poison, .mask = no_key_100};
  const test::Results cpu = test::run_cpu(c, {kShape}, nullptr);
  const test::Reference ref = test::run_reference(c, nullptr);
  for (int64_t b = 0; b < kShape.batch; ++b)
    for (int64_t i = 0; i < kShape.q_len; ++i)
      for (int64_t h = 0; h < kShape.q_heads; ++h) {
        const bool poisoned = h == 1 && i == 70;
        EXPECT_EQ(std::isnan(cpu.lse(b, h, i)), poisoned) << b << " " << h << " " << i;
        EXPECT_EQ(std::isnan(ref.lse(b, h, i)), poisoned);
        for (int64_t x = 0; x < kShape.v_dim; ++x) {
          EXPECT_EQ(std::isnan(cpu.out(b, i, h, x)), poisoned);
          if (!poisoned) {
            EXPECT_NEAR(cpu.out(b, i, h, x), ref.out(b, i, h, x), 4e-6);
          }
        }
      }
}

// A row that mask_mod empties entirely: out 0, lse −inf, zero gradients, never NaN.
TEST(ModifierNumerics, RowsEmptiedByMaskModAreZero) {
  const auto odd_rows_see_nothing = mask_mod([](int64_t, int64_t, int64_t i, int64_t) { return i % 2 == 0; });
  Case<float> c(kShape, 20);
  c.options.modifiers.mask = odd_rows_see_nothing;
  const test::Results cpu = run(c);
  for (int64_t b = 0; b < kShape.batch; ++b)
    for (int64_t i = 1; i < kShape.q_len; i += 2)
      for (int64_t h = 0; h < kShape.q_heads; ++h) {
        EXPECT_EQ(cpu.lse(b, h, i), -std::numeric_limits<float>::infinity());
        for (int64_t x = 0; x < kShape.v_dim; ++x) EXPECT_EQ(cpu.out(b, i, h, x), 0.0f);
        for (int64_t x = 0; x < kShape.head_dim; ++x) EXPECT_EQ(cpu.dq(b, i, h, x), 0.0f);
      }
  EXPECT_TRUE(test::all_finite(cpu.dk) && test::all_finite(cpu.dv));
  expect_near_reference(c);
}

// ---------------------------------------------------------------------------------------
// Errors: named, and nothing written.

// A temporary ScoreMod / MaskMod cannot be bound (it would dangle).
using Identity = decltype([](float s, int64_t, int64_t, int64_t, int64_t) { return s; });
using Everything = decltype([](int64_t, int64_t, int64_t, int64_t) { return true; });
static_assert(std::is_convertible_v<const ScoreMod<Identity>&, ScoreModHook>);
static_assert(!std::is_convertible_v<ScoreMod<Identity>&&, ScoreModHook>);
static_assert(std::is_convertible_v<const MaskMod<Everything>&, MaskModHook>);
static_assert(!std::is_convertible_v<MaskMod<Everything>&&, MaskModHook>);

void expect_error(const std::function<void(AttentionOptions&)>& spoil, const char* what,
                  bool backward, Backend backend) {
  const CaseSpec spec{.name = "err", .q_len = 20, .k_len = 20, .q_heads = 2, .kv_heads = 2};
  Case<float> c(spec, 1);
  c.options.execution.backend = backend;
  Tensor<float, 4> out({1, 20, 2, 4}), dq(c.q.shape()), dk(c.k.shape()), dv(c.v.shape());
  Tensor<float, 3> lse({1, 2, 20});
  if (backward) attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(),
                                   .out = out.view(), .lse = lse.view()}, c.options);
  spoil(c.options);
  for (auto* t : {&dq, &dk, &dv}) test::fill(*t, 5.0f);
  if (!backward) test::fill(out, 5.0f);
  try {
    if (backward) {
      attention_backward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.cview(),
                          .lse = lse.cview(), .dout = out.cview(), .dq = dq.view(), .dk = dk.view(),
                          .dv = dv.view()}, c.options);
    } else {
      attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view()},
                        c.options);
    }
    ADD_FAILURE() << "no error for " << what;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
  if (backward) {
    for (auto* t : {&dq, &dk, &dv})
      for (std::size_t i = 0; i < t->size(); ++i) ASSERT_EQ((*t)[i], 5.0f);
  } else {
    for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], 5.0f);
  }
}

TEST(ModifierErrors, BadModifiersAreNamedAndNothingIsWritten) {
  static const auto forward_only = score_mod([](float s, int64_t, int64_t, int64_t, int64_t) { return s; });
  static const auto keep_all = mask_mod([](int64_t, int64_t, int64_t, int64_t) { return true; });
  static const Tensor<float, 4> bias({1, 1, 20, 20});
  for (Backend backend : {Backend::cpu, Backend::reference}) {
    expect_error([](AttentionOptions& o) { o.modifiers.score = forward_only; },
                 "options.modifiers.score: the backward needs d score_mod / d score", true, backend);
    for (bool backward : {false, true})
      expect_error(
          [](AttentionOptions& o) {
            o.modifiers.mask = keep_all;
            o.mask.bias = bias.cview();
          },
          "options.modifiers.mask: not supported together with options.mask.bias", backward, backend);
    expect_error(
        [](AttentionOptions& o) {
          o.modifiers.score = forward_only;
          o.modifiers.score.tile = nullptr;  // a hand-made, incomplete hook
        },
        "options.modifiers.score: expected a hook made by qkv::score_mod", false, backend);
    expect_error(
        [](AttentionOptions& o) {
          o.modifiers.mask = keep_all;
          o.modifiers.mask.count = nullptr;
        },
        "options.modifiers.mask: expected a hook made by qkv::mask_mod", false, backend);
  }
}

TEST(ModifierErrors, VarlenBackwardNeedsTheDerivative) {
  static const auto forward_only = score_mod([](float s, int64_t, int64_t, int64_t, int64_t) { return s; });
  const std::vector<int64_t> cu{0, 3, 7};
  const auto q = test::random_tensor<float, 3>({7, 1, 4}, 1);
  Tensor<float, 3> out({7, 1, 4}), dq({7, 1, 4}), dk({7, 1, 4}), dv({7, 1, 4});
  Tensor<float, 2> lse({1, 7});
  AttentionOptions options;
  options.modifiers.score = forward_only;
  const std::span<const int64_t> offsets(cu);
  varlen_attention_forward({.q = q.cview(), .k = q.cview(), .v = q.cview(), .out = out.view(),
                            .lse = lse.view(), .cu_seqlens_q = offsets, .cu_seqlens_k = offsets},
                           options);
  test::fill(dq, 5.0f);
  EXPECT_THROW(varlen_attention_backward({.q = q.cview(), .k = q.cview(), .v = q.cview(),
                                          .out = out.cview(), .lse = lse.cview(), .dout = out.cview(),
                                          .dq = dq.view(), .dk = dk.view(), .dv = dv.view(),
                                          .cu_seqlens_q = offsets, .cu_seqlens_k = offsets},
                                         options),
               Error);
  for (std::size_t i = 0; i < dq.size(); ++i) ASSERT_EQ(dq[i], 5.0f);
}

}  // namespace
}  // namespace qkv
