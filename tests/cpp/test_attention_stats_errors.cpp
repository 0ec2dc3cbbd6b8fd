// Attention health's error paths: every wrong statistics view is named in a qkv::Error,
// and nothing is written before it.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "stats_check.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;
using namespace test::stats;

// ---- errors ------------------------------------------------------------------------

constexpr float kSentinel = 12345.0f;

struct StatsCall {
  Tensor<float, 4> q = test::random_tensor<float, 4>({2, 3, 4, 5}, 1);
  Tensor<float, 4> k = test::random_tensor<float, 4>({2, 4, 2, 5}, 2);
  Tensor<float, 4> v = test::random_tensor<float, 4>({2, 4, 2, 6}, 3);
  Tensor<float, 4> out{{2, 3, 4, 6}};
  StatsOut<float> stats{2, 4, 3};
  AttentionStats<float> views = stats.views();

  void run() {
    attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                       .stats = &views});
  }
  bool untouched() const {
    for (std::size_t i = 0; i < out.size(); ++i)
      if (out[i] != kSentinel) return false;
    for (const auto* t : {&stats.row_max_weight, &stats.row_entropy})
      for (std::size_t i = 0; i < t->size(); ++i)
        if ((*t)[i] != kSentinel) return false;
    for (const auto* t : {&stats.max_weight_mean, &stats.entropy_mean})
      for (std::size_t i = 0; i < t->size(); ++i)
        if ((*t)[i] != kSentinel) return false;
    return true;
  }
};

void expect_stats_error(const std::function<void(StatsCall&)>& breaking,
                        std::initializer_list<std::string> fragments) {
  StatsCall call;
  test::fill(call.out, kSentinel);
  for (auto* t : {&call.stats.row_max_weight, &call.stats.row_entropy}) test::fill(*t, kSentinel);
  for (auto* t : {&call.stats.max_weight_mean, &call.stats.entropy_mean}) test::fill(*t, kSentinel);
  breaking(call);
  try {
    call.run();
    ADD_FAILURE() << "expected qkv::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos) << "message: " << message;
  }
  EXPECT_TRUE(call.untouched()) << "an output was written before the error";
}

TEST(AttentionStatsErrors, WrongShapesThresholdAliasing) {
  expect_stats_error([](StatsCall& c) { c.views.max_weight_mean.shape = {2, 3}; },
                     {"qkv::attention_forward", "stats.max_weight_mean.shape[1] (heads)",
                      "expected 4", "got 3"});
  expect_stats_error([](StatsCall& c) { c.views.rows.shape = {1, 4}; },
                     {"stats.rows.shape[0] (batch)", "expected 2", "got 1"});
  expect_stats_error([](StatsCall& c) { c.views.saturated_share.shape = {2, 5}; },
                     {"stats.saturated_share.shape[1]"});
  expect_stats_error([](StatsCall& c) { c.views.entropy_mean.strides = {1, 2}; },
                     {"stats.entropy_mean.strides[1]", "contiguous"});
  expect_stats_error([](StatsCall& c) { c.views.row_entropy.shape = {2, 4, 4}; },
                     {"stats.row_entropy.shape[2] (seq)", "expected 3", "got 4"});
  expect_stats_error([](StatsCall& c) { c.views.row_max_weight.shape = {2, 2, 3}; },
                     {"stats.row_max_weight.shape[1] (heads)"});
  expect_stats_error([](StatsCall& c) { c.views.saturation_threshold = 1.5; },
                     {"stats.saturation_threshold", "[0, 1]", "1.5"});
  expect_stats_error([](StatsCall& c) { c.views.saturation_threshold = std::nan(""); },
                     {"stats.saturation_threshold"});
  expect_stats_error([](StatsCall& c) { c.views = AttentionStats<float>{}; },
                     {"stats: expected at least one output view"});
  expect_stats_error(
      [](StatsCall& c) {
        c.views.row_entropy = View3<float>(c.out.data(), {2, 4, 3}, {12, 3, 1});
      },
      {"stats.row_entropy", "must not share memory", "out"});
  expect_stats_error(
      [](StatsCall& c) { c.views.entropy_mean = c.stats.max_weight_mean.view(); },
      {"must not share memory", "stats.max_weight_mean"});
  expect_stats_error(
      [](StatsCall& c) {
        c.views.max_weight_mean = TensorView<float, 2>(c.q.data(), {2, 4}, {4, 1});
      },
      {"stats.max_weight_mean", "must not share memory with q"});
}

TEST(AttentionStatsErrors, VarlenShapes) {
  const std::vector<int64_t> cu{0, 2, 5};
  const auto q = test::random_tensor<float, 3>({5, 2, 4}, 1);
  const auto k = test::random_tensor<float, 3>({5, 1, 4}, 2);
  Tensor<float, 3> out({5, 2, 4});
  Tensor<float, 2> per_sequence({3, 2}), per_row({2, 6});
  const auto expect = [&](const VarlenAttentionStats<float>& views, const std::string& fragment) {
    try {
      varlen_attention_forward({.q = q.cview(), .k = k.cview(), .v = k.cview(), .out = out.view(),
                                .cu_seqlens_q = std::span<const int64_t>(cu),
                                .cu_seqlens_k = std::span<const int64_t>(cu), .stats = &views});
      ADD_FAILURE() << "expected qkv::Error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect({.max_weight_mean = per_sequence.view()},
         "stats.max_weight_mean.shape[0] (sequences): expected 2");
  expect({.row_entropy = per_row.view()}, "stats.row_entropy.shape[1] (total_q): expected 5");
}

}  // namespace
}  // namespace qkv
