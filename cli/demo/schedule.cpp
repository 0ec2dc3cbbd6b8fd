#include "demo/schedule.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace qkv::demo {

double Schedule::at(int64_t step) const {
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (step >= total) return peak * kFloor;
  const double progress =
      static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(1, total - warmup));
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return peak * (kFloor + (1.0 - kFloor) * cosine);
}

}  // namespace qkv::demo
