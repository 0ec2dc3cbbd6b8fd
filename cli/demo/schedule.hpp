// The demo's learning-rate schedule: linear warmup, cosine decay to a tenth, then flat.
// It depends only on the step index and fixed settings, never on where a run stops, so
// a resumed run sees exactly the rates an uninterrupted one would.
#pragma once

#include <cstdint>

namespace qkv::demo {

struct Schedule {
  double peak = 0;
  int64_t warmup = 0;     // steps of linear warmup
  int64_t total = 0;      // the cosine reaches peak/10 here
  static constexpr double kFloor = 0.1;  // final rate as a fraction of the peak

  // Rate for the update that makes step `step` (0-based) of training.
  double at(int64_t step) const;
};

}  // namespace qkv::demo
