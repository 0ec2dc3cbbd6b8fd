// qkv._qkv.decode and qkv._qkv.KVCache (see decode.cpp).
#pragma once

#include <nanobind/nanobind.h>

namespace qkv::python {

void bind_decode(nanobind::module_& m);

}  // namespace qkv::python
