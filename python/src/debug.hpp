// What the library was last handed, for tests that prove no copy was made: each view's
// address, shape and strides as passed to qkv::attention_forward / attention_backward.
// Per thread, overwritten by every call; costs a few small vector writes.
#pragma once

#include <nanobind/nanobind.h>

#include "qkv/tensor.hpp"

namespace qkv::python {

void debug_begin_call();
void debug_record(const char* name, const void* data, const int64_t* shape,
                  const int64_t* strides, int rank);

template <class T, int R>
void debug_record(const char* name, const TensorView<T, R>& view) {
  if (!view.empty()) debug_record(name, view.data, view.shape.data(), view.strides.data(), R);
}

void bind_debug(nanobind::module_& m);

}  // namespace qkv::python
