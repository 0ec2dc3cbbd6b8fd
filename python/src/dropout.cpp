// qkv.dropout_mask: the keep decisions of attention dropout (core/dropout.hpp) as a
// [B, H, Nq, Nk] bool array, so tests and users can see the mask the kernels apply.
#include <nanobind/ndarray.h>

#include <cstdint>

#include "arrays.hpp"
#include "core/dropout.hpp"
#include "qkv/error.hpp"

namespace qkv::python {

void bind_dropout(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def(
      "dropout_mask",
      [](const OutArray& keep, float p, std::uint64_t seed, std::uint64_t offset) {
        const auto view = view_of<bool, 4>("keep", keep, "a bool array [B, H, Nq, Nk]");
        if (!(p >= 0.0f && p < 1.0f))
          throw Error("dropout_p: expected a probability in [0, 1), got " + std::to_string(p));
        const uint32_t threshold = detail::dropout_threshold(p);
        for (int64_t b = 0; b < view.shape[0]; ++b)
          for (int64_t h = 0; h < view.shape[1]; ++h) {
            const uint32_t head_key = detail::dropout_head_key(seed, offset, b, h);
            for (int64_t i = 0; i < view.shape[2]; ++i) {
              const uint32_t row_key = detail::dropout_row_key(head_key, i);
              for (int64_t j = 0; j < view.shape[3]; ++j)
                view(b, h, i, j) = detail::dropout_bits(row_key, j) >= threshold;
            }
          }
      },
      nb::arg("keep"), nb::arg("dropout_p"), nb::arg("seed"), nb::arg("offset") = 0,
      "Fills keep[b, h, i, j] with whether attention dropout keeps weight (i, j).");
}

}  // namespace qkv::python
