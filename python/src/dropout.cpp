// qkv.dropout_mask: the keep decisions of attention dropout (qkv/dropout.hpp) as a
// [B, H, Nq, Nk] bool array, so tests and users can see the mask the kernels apply.
#include <nanobind/ndarray.h>

#include <cstdint>

#include "arrays.hpp"
#include "qkv/dropout.hpp"
#include "qkv/error.hpp"

namespace qkv::python {

void bind_dropout(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def(
      "dropout_mask",
      [](const OutArray& keep, float p, std::uint64_t seed, std::uint64_t offset) {
        const Caller caller("qkv.dropout_mask");
        const auto view = view_of<bool, 4>("keep", keep, "a bool array [B, H, Nq, Nk]");
        if (!(p >= 0.0f && p < 1.0f))
          throw Error("dropout_p: expected a probability in [0, 1), got " + std::to_string(p));
        dropout_keep_mask(view, Dropout{.p = p, .seed = seed, .offset = offset});
      },
      nb::arg("keep"), nb::arg("dropout_p"), nb::arg("seed"), nb::arg("offset") = 0,
      "Fills keep[b, h, i, j] with whether attention dropout keeps weight (i, j).");
}

}  // namespace qkv::python
