// merge_partials: the LSE merge of two partial attention results (qkv/merge.hpp).
#include "qkv/merge.hpp"

#include <cmath>
#include <limits>
#include <string>

#include "check/checker.hpp"
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

  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t dim = out.shape[3];
  for (int64_t b = 0; b < out.shape[0]; ++b) {
    for (int64_t h = 0; h < out.shape[2]; ++h) {
      for (int64_t n = 0; n < out.shape[1]; ++n) {
        const float a = lse(b, h, n), p = part_lse(b, h, n);
        float* acc = &out(b, n, h, 0);
        const float* part = &part_out(b, n, h, 0);
        const int64_t acc_step = out.strides[3], part_step = part_out.strides[3];
        if (p == kNegInf) continue;  // the part saw no key of this row
        if (a == kNegInf && !std::isnan(p)) {  // first part with keys: take it as is
          for (int64_t x = 0; x < dim; ++x) acc[x * acc_step] = part[x * part_step];
          lse(b, h, n) = p;
          continue;
        }
        // Both finite (or a NaN/+inf, which the arithmetic below turns into NaN).
        const double m = std::isnan(p) ? static_cast<double>(p) : std::fmax(a, p);
        const double wa = std::exp(static_cast<double>(a) - m);
        const double wp = std::exp(static_cast<double>(p) - m);
        const double total = wa + wp;
        const float keep = static_cast<float>(wa / total), take = static_cast<float>(wp / total);
        for (int64_t x = 0; x < dim; ++x)
          acc[x * acc_step] = keep * acc[x * acc_step] + take * part[x * part_step];
        lse(b, h, n) = static_cast<float>(m + std::log(total));
      }
    }
  }
}

}  // namespace qkv
