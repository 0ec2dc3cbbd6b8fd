#include "stats.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <string>

#include "arrays.hpp"
#include "qkv/error.hpp"

namespace qkv::python {

template <class T, int R>
BasicAttentionStats<T, R> stats_views(const nanobind::dict& stats, const char* because) {
  BasicAttentionStats<T, R> views;
  for (auto [key, value] : stats) {
    const std::string name = nb::cast<std::string>(key);
    if (name == "saturation_threshold") {
      views.saturation_threshold = nb::cast<double>(value);
      continue;
    }
    const std::string arg = "stats." + name;
    const auto array = nb::cast<OutArray>(value);
    if (name == "max_weight_mean") {
      views.max_weight_mean = view_of<T, 2>(arg.c_str(), array, because);
    } else if (name == "max_weight_max") {
      views.max_weight_max = view_of<T, 2>(arg.c_str(), array, because);
    } else if (name == "entropy_mean") {
      views.entropy_mean = view_of<T, 2>(arg.c_str(), array, because);
    } else if (name == "saturated_share") {
      views.saturated_share = view_of<T, 2>(arg.c_str(), array, because);
    } else if (name == "rows") {
      views.rows = view_of<int64_t, 2>(arg.c_str(), array, "row counts");
    } else if (name == "row_max_weight") {
      views.row_max_weight = view_of<T, R>(arg.c_str(), array, because);
    } else if (name == "row_entropy") {
      views.row_entropy = view_of<T, R>(arg.c_str(), array, because);
    } else {
      throw Error("stats: unknown output '" + name +
                  "' (expected max_weight_mean, max_weight_max, entropy_mean, saturated_share, "
                  "rows, row_max_weight, row_entropy or saturation_threshold)");
    }
  }
  return views;
}

template BasicAttentionStats<float, 3> stats_views<float, 3>(const nanobind::dict&, const char*);
template BasicAttentionStats<double, 3> stats_views<double, 3>(const nanobind::dict&, const char*);
template BasicAttentionStats<float, 2> stats_views<float, 2>(const nanobind::dict&, const char*);
template BasicAttentionStats<double, 2> stats_views<double, 2>(const nanobind::dict&, const char*);

}  // namespace qkv::python
