// The checks a ring pass makes on this rank's views before the ranks agree to start.
// They repeat what attention_forward/backward check on each block call, because a call
// that threw in the middle of the ring would leave the other ranks waiting forever: by
// the time the ring starts, no block call may fail on the caller's input.
#pragma once

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "qkv/error.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor.hpp"

namespace qkv::dist::detail {

struct ViewChecks {
  std::string function;

  [[noreturn]] void fail(const std::string& what) const { throw Error(function + ": " + what); }

  // Non-negative extents and strides, contiguous last dimension, data when not empty.
  template <class T, int R>
  void well_formed(const char* name, const TensorView<T, R>& view) const {
    for (int axis = 0; axis < R; ++axis) {
      if (view.shape[axis] < 0) fail(std::string(name) + ".shape[" + std::to_string(axis) + "]: expected >= 0");
    }
    if (view.numel() == 0) return;
    if (view.data == nullptr) fail(std::string(name) + ": data is null but the view has elements");
    for (int axis = 0; axis < R; ++axis) {
      if (view.strides[axis] < 0) {
        fail(std::string(name) + ".strides[" + std::to_string(axis) + "]: expected >= 0, got " +
             std::to_string(view.strides[axis]));
      }
    }
    if (view.shape[R - 1] > 1 && view.strides[R - 1] != 1) {
      fail(std::string(name) + ".strides[" + std::to_string(R - 1) +
           "]: expected 1 (the innermost dimension must be contiguous), got " +
           std::to_string(view.strides[R - 1]));
    }
  }

  template <class T, int R>
  void extent(const char* name, const TensorView<T, R>& view, int axis, const char* axis_name,
              int64_t expected, const std::string& because) const {
    if (view.shape[axis] != expected) {
      fail(std::string(name) + ".shape[" + std::to_string(axis) + "] (" + axis_name +
           "): expected " + std::to_string(expected) + " (" + because + "), got " +
           std::to_string(view.shape[axis]));
    }
  }

  // An output shares no byte with another view (byte ranges, as the core checks).
  template <class A, int RA, class B, int RB>
  void disjoint(const char* out_name, const TensorView<A, RA>& out, const char* other_name,
                const TensorView<B, RB>& other) const {
    const auto [a_lo, a_hi] = byte_range(out);
    const auto [b_lo, b_hi] = byte_range(other);
    if (a_lo != a_hi && b_lo != b_hi && a_lo < b_hi && b_lo < a_hi) {
      fail(std::string(out_name) + ": must not share memory with " + other_name +
           " (outputs may not alias inputs or other outputs)");
    }
  }

  // check_finite: every element finite (an LSE may be −inf: a row with no key).
  template <class T, int R>
  void finite(const char* name, const TensorView<T, R>& view, bool allow_minus_inf = false) const {
    if (view.numel() == 0) return;
    std::array<int64_t, R> index{};
    while (true) {
      int64_t offset = 0;
      for (int axis = 0; axis < R; ++axis) offset += index[axis] * view.strides[axis];
      const float value = view.data[offset];
      if (!std::isfinite(value) && !(allow_minus_inf && value == -INFINITY)) {
        std::ostringstream out;
        out << "check_finite: " << name << '[';
        for (int axis = 0; axis < R; ++axis) out << (axis ? ", " : "") << index[axis];
        out << "] (local index) is " << value;
        fail(out.str());
      }
      int axis = R - 1;
      while (axis >= 0 && ++index[axis] == view.shape[axis]) index[axis--] = 0;
      if (axis < 0) return;
    }
  }

  // What a ring pass cannot take.
  void ring_options(const AttentionOptions& options) const {
    if (!options.mask.empty()) {
      fail("options.mask: not supported by ring attention (use causal and key_lengths, "
           "which the ring applies in global positions)");
    }
    if (options.modifiers.active()) {
      fail("options.modifiers: not supported by ring attention (each rank's call would see "
           "key positions local to its block)");
    }
  }

 private:
  template <class T, int R>
  static std::pair<std::uintptr_t, std::uintptr_t> byte_range(const TensorView<T, R>& view) {
    if (view.numel() == 0 || view.data == nullptr) return {0, 0};
    int64_t last = 0;
    for (int axis = 0; axis < R; ++axis) last += (view.shape[axis] - 1) * view.strides[axis];
    const auto first = reinterpret_cast<std::uintptr_t>(view.data);
    return {first, first + static_cast<std::uintptr_t>(last + 1) * sizeof(T)};
  }
};

}  // namespace qkv::dist::detail
