// Argument checks for the decode entry points (qkv::decode, KVCache), with the same
// rules and message shapes as attention_forward's (core/validate.cpp): "function:
// argument: expected …, got …". Kept apart from validate.cpp for now; the two can share
// one checker once the per-call plan lands.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail {

// A view reduced to what the checks need.
struct ViewFacts {
  std::string name;
  int rank = 0;
  std::array<int64_t, 4> shape{};
  std::array<int64_t, 4> strides{};
  const void* data = nullptr;
  std::size_t element_bytes = 0;

  int64_t numel() const {
    int64_t n = 1;
    for (int axis = 0; axis < rank; ++axis) n *= shape[axis];
    return n;
  }
  // [first byte, one past the last byte) the view can touch; empty when it has no elements.
  std::pair<std::uintptr_t, std::uintptr_t> byte_range() const {
    if (numel() == 0 || data == nullptr) return {0, 0};
    int64_t last = 0;
    for (int axis = 0; axis < rank; ++axis) last += (shape[axis] - 1) * strides[axis];
    const auto first = reinterpret_cast<std::uintptr_t>(data);
    return {first, first + static_cast<std::uintptr_t>(last + 1) * element_bytes};
  }
};

template <class T, int R>
ViewFacts facts_of(std::string name, const TensorView<T, R>& view) {
  ViewFacts f;
  f.name = std::move(name);
  f.rank = R;
  for (int axis = 0; axis < R; ++axis) {
    f.shape[axis] = view.shape[axis];
    f.strides[axis] = view.strides[axis];
  }
  f.data = view.data;
  f.element_bytes = sizeof(T);
  return f;
}

class ViewChecker {
 public:
  explicit ViewChecker(std::string function) : function_(std::move(function)) {}

  [[noreturn]] void fail(const std::string& what) const { throw Error(function_ + ": " + what); }

  // Extents ≥ 0; for a view with elements: strides ≥ 0, innermost contiguous, data set.
  void well_formed(const ViewFacts& view) const {
    for (int axis = 0; axis < view.rank; ++axis)
      if (view.shape[axis] < 0)
        fail(view.name + ".shape[" + std::to_string(axis) + "]: expected >= 0, got " +
             std::to_string(view.shape[axis]));
    if (view.numel() == 0) return;
    for (int axis = 0; axis < view.rank; ++axis)
      if (view.strides[axis] < 0)
        fail(view.name + ".strides[" + std::to_string(axis) + "]: expected >= 0, got " +
             std::to_string(view.strides[axis]));
    const int inner = view.rank - 1;
    if (view.shape[inner] > 1 && view.strides[inner] != 1)
      fail(view.name + ".strides[" + std::to_string(inner) +
           "]: expected 1 (the innermost dimension must be contiguous), got " +
           std::to_string(view.strides[inner]));
    if (view.data == nullptr) fail(view.name + ": data is null but the view has elements");
  }

  void extent(const ViewFacts& view, int axis, const char* axis_name, int64_t expected,
              const std::string& because) const {
    if (view.shape[axis] == expected) return;
    std::ostringstream out;
    out << view.name << ".shape[" << axis << "] (" << axis_name << "): expected " << expected
        << " (" << because << "), got " << view.shape[axis];
    fail(out.str());
  }

  void at_least_one(const ViewFacts& view, int axis, const char* axis_name) const {
    if (view.shape[axis] >= 1) return;
    std::ostringstream out;
    out << view.name << ".shape[" << axis << "] (" << axis_name << "): expected >= 1, got "
        << view.shape[axis];
    fail(out.str());
  }

  // Outputs have one index per element and share no memory with inputs or each other.
  void outputs_apart(const std::vector<ViewFacts>& outputs,
                     const std::vector<ViewFacts>& inputs) const {
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      no_self_overlap(outputs[i]);
      for (const ViewFacts& input : inputs) disjoint(outputs[i], input);
      for (std::size_t j = 0; j < i; ++j) disjoint(outputs[i], outputs[j]);
    }
  }

  double scale(const std::optional<double>& scale, int64_t head_dim) const {
    if (!scale) return 1.0 / std::sqrt(static_cast<double>(head_dim));
    if (!std::isfinite(*scale) || *scale <= 0.0) {
      std::ostringstream out;
      out << "options.scale: expected a finite value > 0, got " << *scale;
      fail(out.str());
    }
    return *scale;
  }

  int threads(int requested) const {
    if (requested < 0)
      fail("options.threads: expected >= 0 (0 = all hardware threads), got " +
           std::to_string(requested));
    if (requested > 0) return requested;
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }

 private:
  void no_self_overlap(const ViewFacts& view) const {
    if (view.numel() == 0) return;
    std::vector<int> axes;
    for (int axis = 0; axis < view.rank; ++axis)
      if (view.shape[axis] > 1) axes.push_back(axis);
    std::sort(axes.begin(), axes.end(),
              [&](int a, int b) { return view.strides[a] < view.strides[b]; });
    int64_t spanned = 1;
    for (int axis : axes) {
      if (view.strides[axis] < spanned)
        fail(view.name + ": an output's elements must not overlap, but strides[" +
             std::to_string(axis) + "] = " + std::to_string(view.strides[axis]) +
             " revisits memory already spanned by the axes with smaller strides");
      spanned = view.strides[axis] * (view.shape[axis] - 1) + spanned;
    }
  }

  void disjoint(const ViewFacts& output, const ViewFacts& other) const {
    const auto [a_lo, a_hi] = output.byte_range();
    const auto [b_lo, b_hi] = other.byte_range();
    if (a_lo == a_hi || b_lo == b_hi) return;
    if (a_lo < b_hi && b_lo < a_hi)
      fail(output.name + ": must not share memory with " + other.name +
           " (outputs may not alias inputs or other outputs)");
  }

  std::string function_;
};

}  // namespace qkv::detail
