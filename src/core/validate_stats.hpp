// Checks of the optional softmax-statistics outputs (qkv/attention_stats.hpp), shared by
// the dense and varlen validators: shapes, layout, the threshold; adds every given view
// to the outputs that must not alias inputs or each other.
#pragma once

#include <array>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "core/attention_rules.hpp"
#include "qkv/attention_stats.hpp"

namespace qkv::detail {

// One axis an output must have: extent, axis name and what it must match.
struct ExpectedAxis {
  int64_t extent;
  const char* name;
  const char* because;
};

// `outputs`: a std::vector<Described> or a DescribedList with room for 7 more.
template <class T, int R, class Outputs>
void check_stats(const Checker& check, const BasicAttentionStats<T, R>& stats,
                 const std::array<ExpectedAxis, 2>& head_axes,
                 const std::array<ExpectedAxis, R>& row_axes, Outputs& outputs) {
  const double threshold = stats.saturation_threshold;
  if (!(threshold >= 0.0 && threshold <= 1.0)) {  // NaN fails too
    std::ostringstream out;
    out << "stats.saturation_threshold: expected a weight in [0, 1], got " << threshold;
    check.fail(out.str());
  }
  if (!stats.any_head_view() && !stats.any_row_view()) {
    check.fail("stats: expected at least one output view (max_weight_mean, max_weight_max, "
               "entropy_mean, saturated_share, rows, row_max_weight or row_entropy), got none");
  }
  auto expect = [&](const Described& view, const auto& axes) {
    check.expect_well_formed(view);
    for (int axis = 0; axis < static_cast<int>(axes.size()); ++axis)
      check.expect_extent(view, axis, axes[axis].name, axes[axis].extent, axes[axis].because);
    outputs.push_back(view);
  };
  auto head = [&](const char* name, const auto& view) {
    if (!view.empty()) expect(describe(std::string("stats.") + name, view), head_axes);
  };
  head("max_weight_mean", stats.max_weight_mean);
  head("max_weight_max", stats.max_weight_max);
  head("entropy_mean", stats.entropy_mean);
  head("saturated_share", stats.saturated_share);
  head("rows", stats.rows);
  if (!stats.row_max_weight.empty())
    expect(describe("stats.row_max_weight", stats.row_max_weight), row_axes);
  if (!stats.row_entropy.empty())
    expect(describe("stats.row_entropy", stats.row_entropy), row_axes);
}

}  // namespace qkv::detail
