// Bindings of qkv::attention_forward / attention_backward over caller-allocated arrays.
#pragma once

#include <nanobind/nanobind.h>

namespace qkv::python {

void bind_attention(nanobind::module_& m);

}  // namespace qkv::python
