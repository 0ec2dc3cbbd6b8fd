#include "debug.hpp"

#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>
#include <vector>

namespace qkv::python {
namespace {

struct RecordedView {
  std::string name;
  std::uintptr_t address = 0;
  std::vector<int64_t> shape, strides;
};

thread_local std::vector<RecordedView> last_call;

nanobind::tuple to_tuple(const std::vector<int64_t>& values) {
  nanobind::list list;
  for (int64_t value : values) list.append(value);
  return nanobind::tuple(list);
}

}  // namespace

void debug_begin_call() { last_call.clear(); }

void debug_record(const char* name, const void* data, const int64_t* shape,
                  const int64_t* strides, int rank) {
  last_call.push_back({name, reinterpret_cast<std::uintptr_t>(data),
                       std::vector<int64_t>(shape, shape + rank),
                       std::vector<int64_t>(strides, strides + rank)});
}

void debug_record_options(const AttentionOptions& options) {
  debug_record("mask.keep", options.mask.keep);
  debug_record("mask.bias", options.mask.bias);
  if (!options.key_lengths.empty()) {
    const int64_t length = static_cast<int64_t>(options.key_lengths.size()), stride = 1;
    debug_record("key_lengths", options.key_lengths.data(), &length, &stride, 1);
  }
}

void bind_debug(nanobind::module_& m) {
  m.def(
      "_debug_record_views",
      [](bool on) {
        debug_recording.store(on, std::memory_order_relaxed);
        last_call.clear();
      },
      nanobind::arg("on"),
      "Turns the recording of the views handed to the library on or off (for tests).");
  m.def(
      "_debug_last_views",
      [] {
        nanobind::dict views;
        for (const RecordedView& view : last_call) {
          views[view.name.c_str()] =
              nanobind::make_tuple(view.address, to_tuple(view.shape), to_tuple(view.strides));
        }
        return views;
      },
      "The views (address, logical [B, N, H, d] shape, strides in elements) that the last "
      "attention call on this thread passed to the C++ library, while recording is on "
      "(_debug_record_views). For tests.");
}

}  // namespace qkv::python
