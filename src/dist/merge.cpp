// merge_partials: the LSE merge of two partial attention results (qkv/merge.hpp).
#include "qkv/merge.hpp"

#include <string>

#include "check/checker.hpp"
#include "core/lse_merge.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace {

using detail::Checker;
using detail::Described;

// Every axis of `view` as the same axis of `like` (both described, same rank).
void expect_like(const Checker& check, const Described& view, const Described& like,
                 const char* const* axis_names) {
  for (int axis = 0; axis < view.rank; ++axis) {
    const std::string because = "as " + like.name + ".shape[" + std::to_string(axis) + "]";
    check.expect_extent(view, axis, axis_names[axis], like.shape[axis], because);
  }
}

}  // namespace

void merge_partials(View4<float> out, View3<float> lse, View4<const float> part_out,
                    View3<const float> part_lse) {
  const Checker check("qkv::merge_partials");
  const Described d_out = detail::describe("out", out), d_lse = detail::describe("lse", lse),
                  d_part_out = detail::describe("part_out", part_out),
                  d_part_lse = detail::describe("part_lse", part_lse);
  constexpr const char* kOutAxes[] = {"batch", "seq", "heads", "head_dim"};
  constexpr const char* kLseAxes[] = {"batch", "heads", "seq"};
  expect_like(check, d_part_out, d_out, kOutAxes);
  // lse is [B, H, N] for out's [B, N, H, d].
  check.expect_extent(d_lse, 0, "batch", out.shape[0], "as out.shape[0]");
  check.expect_extent(d_lse, 1, "heads", out.shape[2], "as out.shape[2]");
  check.expect_extent(d_lse, 2, "seq", out.shape[1], "as out.shape[1]");
  expect_like(check, d_part_lse, d_lse, kLseAxes);
  for (const Described* view : {&d_out, &d_lse, &d_part_out, &d_part_lse}) check.expect_data(*view);

  const int64_t dim = out.shape[3];
  for (int64_t b = 0; b < out.shape[0]; ++b)
    for (int64_t h = 0; h < out.shape[2]; ++h)
      for (int64_t n = 0; n < out.shape[1]; ++n)
        detail::merge_lse_row(&out(b, n, h, 0), out.strides[3], lse(b, h, n), &part_out(b, n, h, 0),
                              part_out.strides[3], part_lse(b, h, n), dim);
}

}  // namespace qkv
