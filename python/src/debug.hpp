// What the library was last handed, for tests that prove no copy was made: each view's
// address, shape and strides as passed to qkv::attention_forward / attention_backward
// (and, for caller-owned caches, qkv::decode / BatchPlan::run: the caches and their scales).
// Off unless a test turns it on (qkv._qkv._debug_record_views(True)): an ordinary call
// pays one relaxed load of a flag, nothing else. Per thread, overwritten by every call.
#pragma once

#include <nanobind/nanobind.h>

#include <atomic>

#include "qkv/options.hpp"
#include "qkv/tensor.hpp"

namespace qkv::python {

inline std::atomic<bool> debug_recording{false};

void debug_begin_call();
void debug_record(const char* name, const void* data, const int64_t* shape,
                  const int64_t* strides, int rank);

template <class T, int R>
void debug_record(const char* name, const TensorView<T, R>& view) {
  if (!view.empty()) debug_record(name, view.data, view.shape.data(), view.strides.data(), R);
}

// The mask and key-length views of `options`.
void debug_record_options(const AttentionOptions& options);

void bind_debug(nanobind::module_& m);

}  // namespace qkv::python
