// Bindings of the textbook softmax math (qkv/softmax.hpp), row by row.
#pragma once

#include <nanobind/nanobind.h>

namespace qkv::python {

void bind_softmax(nanobind::module_& m);

}  // namespace qkv::python
