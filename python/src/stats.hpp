// The `stats` keyword of the forward bindings (attention.cpp, varlen.cpp): a dict of
// caller-allocated output arrays, any subset of
//   max_weight_mean, max_weight_max, entropy_mean, saturated_share   [B, Hq], lse's dtype
//   rows                                                               [B, Hq], int64
//   row_max_weight, row_entropy                                        like lse
// plus "saturation_threshold" (a float), as the library's statistics views
// (qkv/attention_stats.hpp). Shapes are the library's to check.
#pragma once

#include <nanobind/nanobind.h>

#include "qkv/attention_stats.hpp"

namespace qkv::python {

// T: the statistics' element type (the call's LseOf: float for 16-bit inputs); R = 3 for
// dense calls (rows [B, Hq, Nq]), 2 for varlen ([Hq, total_q]); `because` says where the
// expected dtype comes from, for the messages.
template <class T, int R>
BasicAttentionStats<T, R> stats_views(const nanobind::dict& stats, const char* because);

}  // namespace qkv::python
