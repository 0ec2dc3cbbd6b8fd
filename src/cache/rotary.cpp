// Rotary position embedding (qkv/rotary.hpp): the checks, and the rotation of one row.
//
// Compiled with -ffp-contract=off (src/CMakeLists.txt): out = x·cos + rotate_half(x)·sin
// must round each product and then the sum, as PyTorch's float32 does, so that a rotated
// key is bitwise transformers' — a fused multiply-add would round once and differ in the
// last bit now and then.
#include "cache/rotary.hpp"

#include "check/checker.hpp"

#include <string>
#include <vector>

#include "qkv/error.hpp"

namespace qkv::detail {
namespace {

std::string at(const char* name, int64_t index) { return std::string(name) + "[" + std::to_string(index) + "]"; }

}  // namespace

CheckedRotary::CheckedRotary(const Checker& check, const Rotary& rotary, int64_t rows, int64_t head_dim,
                             const char* width)
    : head_dim_(head_dim) {
  if (rotary.empty()) {
    if (rotary.positions.size() != 0) check.fail("rotary.positions: given without rotary.cos and rotary.sin");
    if (rotary.rotary_dim != 0) check.fail("rotary.rotary_dim: given without rotary.cos and rotary.sin");
    return;
  }
  if (rotary.cos.empty()) check.fail("rotary.cos: expected with rotary.sin (both tables or neither)");
  if (rotary.sin.empty()) check.fail("rotary.sin: expected with rotary.cos (both tables or neither)");
  const Described cos_view = describe("rotary.cos", rotary.cos), sin_view = describe("rotary.sin", rotary.sin);
  check.expect_well_formed(cos_view);
  check.expect_well_formed(sin_view);
  check.expect_extent(sin_view, 0, "rows", rotary.cos.shape[0], "as rotary.cos.shape[0]");
  check.expect_extent(sin_view, 1, "rotary_dim", rotary.cos.shape[1], "as rotary.cos.shape[1]");
  dim_ = rotary.cos.shape[1];
  if (rotary.rotary_dim != 0 && rotary.rotary_dim != dim_) {
    check.fail("rotary.rotary_dim: expected rotary.cos.shape[1] (" + std::to_string(dim_) +
               ", the tables' width), got " + std::to_string(rotary.rotary_dim));
  }
  if (dim_ < 2 || dim_ % 2 != 0 || dim_ > head_dim) {
    check.fail("rotary.cos.shape[1] (rotary_dim): expected an even number 2.." + std::to_string(head_dim) + " (" +
               width + "; channels rotate in pairs), got " + std::to_string(dim_));
  }
  const int64_t table_rows = rotary.cos.shape[0];
  if (rotary.positions.size() == 0) {
    check.expect_extent(cos_view, 0, "new tokens", rows, "one row per new token; or give rotary.positions into a table");
  } else {
    if (static_cast<int64_t>(rotary.positions.size()) != rows) {
      check.fail("rotary.positions: expected one position per new token (" + std::to_string(rows) + "), got " +
                 std::to_string(rotary.positions.size()));
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t position = rotary.positions[static_cast<std::size_t>(r)];
      if (position < 0 || position >= table_rows) {
        check.fail(at("rotary.positions", r) + ": expected a row of the tables, 0.." + std::to_string(table_rows - 1) +
                   " (rotary.cos.shape[0] - 1), got " + std::to_string(position));
      }
    }
  }
  rotary_ = &rotary;
}

void CheckedRotary::rotate(int64_t r, const float* x, float* out) const {
  const int64_t row = rotary_->positions.size() == 0 ? r : rotary_->positions[static_cast<std::size_t>(r)];
  const float* cos_row = &rotary_->cos(row, 0);
  const float* sin_row = &rotary_->sin(row, 0);
  // Pair (a, b): a' = a·cos[a] − b·sin[a], b' = b·cos[b] + a·sin[b] (the header's rule).
  const int64_t half = dim_ / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = rotary_->interleaved ? 2 * i : i;
    const int64_t b = rotary_->interleaved ? 2 * i + 1 : i + half;
    const float xa = x[a], xb = x[b];
    const float ra = xa * cos_row[a], sa = -xb * sin_row[a];
    const float rb = xb * cos_row[b], sb = xa * sin_row[b];
    out[a] = ra + sa;
    out[b] = rb + sb;
  }
  if (out != x)
    for (int64_t c = dim_; c < head_dim_; ++c) out[c] = x[c];
}

}  // namespace qkv::detail

namespace qkv {

void apply_rotary(View3<const float> x, View3<float> out, const Rotary& rotary) {
  const detail::Checker check("qkv::apply_rotary");
  const detail::Described xd = detail::describe("x", x), od = detail::describe("out", out);
  check.expect_well_formed(xd);
  check.expect_well_formed(od);
  for (int axis = 0; axis < 3; ++axis) check.expect_extent(od, axis, axis == 2 ? "head_dim" : "extent", x.shape[axis], "as x");
  if (rotary.empty()) check.fail("rotary.cos: expected the tables (rotary.cos and rotary.sin)");
  const detail::CheckedRotary rotate(check, rotary, x.shape[0], x.shape[2]);
  std::vector<detail::Described> outputs{od}, inputs{detail::describe("rotary.cos", rotary.cos),
                                                     detail::describe("rotary.sin", rotary.sin)};
  if (out.data != x.data) inputs.push_back(xd);
  check.expect_outputs_apart(outputs, inputs);
  for (int64_t r = 0; r < x.shape[0]; ++r)
    for (int64_t h = 0; h < x.shape[1]; ++h) rotate.rotate(r, &x(r, h, 0), &out(r, h, 0));
}

}  // namespace qkv
