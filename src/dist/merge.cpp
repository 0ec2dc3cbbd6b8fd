// merge_partials: the LSE merge of two partial attention results (qkv/merge.hpp).
#include "qkv/merge.hpp"

#include <cmath>
#include <limits>
#include <string>

#include "qkv/error.hpp"

namespace qkv {
namespace {

template <class V>
void expect_shape(const char* name, const V& view, const V& like, const char* like_name) {
  constexpr int rank = static_cast<int>(std::tuple_size_v<typename V::Shape>);
  for (int axis = 0; axis < rank; ++axis) {
    if (view.shape[axis] != like.shape[axis]) {
      throw Error(std::string("qkv::merge_partials: ") + name + ".shape[" + std::to_string(axis) +
                  "]: expected " + std::to_string(like.shape[axis]) + " (as " + like_name +
                  "), got " + std::to_string(view.shape[axis]));
    }
  }
  if (view.numel() > 0 && view.empty()) {
    throw Error(std::string("qkv::merge_partials: ") + name + ": null data");
  }
}

}  // namespace

void merge_partials(View4<float> out, View3<float> lse, View4<const float> part_out,
                    View3<const float> part_lse) {
  const View4<const float> out_c = out;
  const View3<const float> lse_c = lse;
  expect_shape("part_out", part_out, out_c, "out");
  const View3<const float> lse_shape(nullptr, {out.shape[0], out.shape[2], out.shape[1]}, {});
  expect_shape("lse", lse_c, lse_shape, "out's [B, H, N]");
  expect_shape("part_lse", part_lse, lse_c, "lse");
  if (out.numel() > 0 && out.empty()) throw Error("qkv::merge_partials: out: null data");

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
