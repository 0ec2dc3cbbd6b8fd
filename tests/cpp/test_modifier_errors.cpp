// Modifiers' error paths: every bad modifier is named in a qkv::Error and nothing is
// written; temporaries cannot be bound.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <type_traits>

#include "modifier_check.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;
using namespace test::modifiers;

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
