// qkv::Rotary checked once per call, then applied row by row (rotary.cpp): the stage the
// appending runs (batch_plan_append.cpp, kv_cache_rotary.cpp) put before the cache write.
#pragma once

#include <cstdint>

#include "core/validate.hpp"
#include "qkv/rotary.hpp"

namespace qkv::detail {

class CheckedRotary {
 public:
  CheckedRotary() = default;  // no rotation
  // `rotary` against `rows` new tokens of `head_dim` channels (qkv/rotary.hpp lists the
  // errors, each a qkv::Error through `check`). `rotary` must outlive this.
  // `width` names head_dim in the errors (keys in two parts rotate their last dr channels
  // as a row of their own: "dr").
  CheckedRotary(const Checker& check, const Rotary& rotary, int64_t rows, int64_t head_dim,
                const char* width = "head_dim");

  bool active() const { return rotary_ != nullptr; }
  int64_t dim() const { return dim_; }
  // One head's row of new token r: x [head_dim] rotated into out [head_dim] (out == x
  // allowed: each pair is read before it is written).
  void rotate(int64_t r, const float* x, float* out) const;

 private:
  const Rotary* rotary_ = nullptr;
  int64_t dim_ = 0, head_dim_ = 0;
};

}  // namespace qkv::detail
