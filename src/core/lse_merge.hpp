// The LSE merge of one row (qkv/merge.hpp states it): shared by qkv::merge_partials (ring
// attention) and qkv::BatchPlan's shared prefixes, so both combine parts with the same
// arithmetic — weights in double from the fp32 LSEs, the output row combined in fp32.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace qkv::detail {

// (acc, lse) ← the merge of (acc, lse) and (part, part_lse); rows of `dim` floats,
// acc_step and part_step apart. A part that saw no key (lse −∞) changes nothing; a NaN
// LSE makes the row NaN.
inline void merge_lse_row(float* acc, int64_t acc_step, float& lse, const float* part, int64_t part_step,
                          float part_lse, int64_t dim) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const float a = lse, p = part_lse;
  if (p == kNegInf) return;  // the part saw no key of this row
  if (a == kNegInf && !std::isnan(p)) {  // first part with keys: take it as is
    for (int64_t x = 0; x < dim; ++x) acc[x * acc_step] = part[x * part_step];
    lse = p;
    return;
  }
  // Both finite (or a NaN/+inf, which the arithmetic below turns into NaN).
  const double m = std::isnan(p) ? static_cast<double>(p) : std::fmax(a, p);
  const double wa = std::exp(static_cast<double>(a) - m);
  const double wp = std::exp(static_cast<double>(p) - m);
  const double total = wa + wp;
  const float keep = static_cast<float>(wa / total), take = static_cast<float>(wp / total);
  for (int64_t x = 0; x < dim; ++x) acc[x * acc_step] = keep * acc[x * acc_step] + take * part[x * part_step];
  lse = static_cast<float>(m + std::log(total));
}

}  // namespace qkv::detail
