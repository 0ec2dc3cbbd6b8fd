// The argument checker of every qkv library (the core and its caches, qkv::dist,
// qkv::ring_plan, qkv::nn): a view reduced to what the checks need, and a Checker whose
// failures throw qkv::Error "function: argument: expected …, got …". One wording per
// failure, whichever entry point finds it, so a caller can match on the argument's name.
// The attention-specific rules built on it (scale, threads, backend, grouped-query
// heads) are in core/attention_rules.hpp. Built as the header-only target qkv_check (see
// src/check/CMakeLists.txt).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/half.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail {

// A view reduced to what the checks need: its name, extents, strides and byte range.
struct Described {
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
  // [first byte, one past the last byte) that the view can touch; empty when numel == 0.
  std::pair<std::uintptr_t, std::uintptr_t> byte_range() const {
    if (numel() == 0 || data == nullptr) return {0, 0};
    int64_t last = 0;
    for (int axis = 0; axis < rank; ++axis) last += (shape[axis] - 1) * strides[axis];
    const auto first = reinterpret_cast<std::uintptr_t>(data);
    return {first, first + static_cast<std::uintptr_t>(last + 1) * element_bytes};
  }
};

// Up to N described views on the stack: what the validators collect on every call (the
// outputs, the inputs they must not alias), without a heap allocation per call.
template <std::size_t N>
class DescribedList {
 public:
  DescribedList(std::initializer_list<Described> views) {
    for (const Described& view : views) push_back(view);
  }
  void push_back(const Described& view) {
    if (size_ == N) throw Error("qkv internal error: DescribedList capacity exceeded");
    items_[size_++] = view;
  }
  operator std::span<const Described>() const { return {items_.data(), size_}; }  // NOLINT

 private:
  std::array<Described, N> items_{};
  std::size_t size_ = 0;
};

// Every storage type widened for the finiteness check: the half types exactly to float
// (so the value printed is the stored one), integers (int8 caches) to themselves.
inline double widen_for_check(double value) { return value; }
inline float widen_for_check(float value) { return value; }
inline float widen_for_check(bfloat16 value) { return static_cast<float>(value); }
inline float widen_for_check(float16 value) { return static_cast<float>(value); }
inline double widen_for_check(std::int8_t value) { return value; }

template <class T, int R>
Described describe(std::string name, const TensorView<T, R>& view) {
  static_assert(R <= 4, "Described holds up to 4 axes");
  Described d;
  d.name = std::move(name);
  d.rank = R;
  for (int axis = 0; axis < R; ++axis) {
    d.shape[axis] = view.shape[axis];
    d.strides[axis] = view.strides[axis];
  }
  d.data = view.data;
  d.element_bytes = sizeof(T);
  return d;
}

inline std::string format_index(const std::array<int64_t, 4>& index, int rank) {
  std::ostringstream out;
  out << '[';
  for (int axis = 0; axis < rank; ++axis) out << (axis ? ", " : "") << index[axis];
  out << ']';
  return out.str();
}

class Checker {
 public:
  // `function` names the entry point in every message. A Checker is built on every call,
  // so it copies nothing until a check fails: the caller keeps `function` alive (a
  // string literal, or a std::string of its own).
  explicit Checker(std::string_view function) : function_(function) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(std::string(function_) + ": " + what);
  }

  // `because` says what the extent must match ("as q.shape[0]"); empty: nothing to add.
  void expect_extent(const Described& view, int axis, const char* axis_name, int64_t expected,
                     std::string_view because = {}) const {
    if (view.shape[axis] != expected) {
      std::ostringstream out;
      out << view.name << ".shape[" << axis << "] (" << axis_name << "): expected " << expected;
      if (!because.empty()) out << " (" << because << ")";
      out << ", got " << view.shape[axis];
      fail(out.str());
    }
  }

  // Broadcastable axis: 1 or the full extent.
  void expect_extent_or_one(const Described& view, int axis, const char* axis_name,
                            int64_t expected, std::string_view because) const {
    if (view.shape[axis] != expected && view.shape[axis] != 1) {
      std::ostringstream out;
      out << view.name << ".shape[" << axis << "] (" << axis_name << "): expected " << expected
          << " (" << because << ") or 1 to broadcast, got " << view.shape[axis];
      fail(out.str());
    }
  }

  void expect_at_least_one(const Described& view, int axis, const char* axis_name) const {
    if (view.shape[axis] < 1) {
      std::ostringstream out;
      out << view.name << ".shape[" << axis << "] (" << axis_name << "): expected >= 1, got "
          << view.shape[axis] << " (" << axis_name << " may not be empty)";
      fail(out.str());
    }
  }

  // A view with elements has data to read them from.
  void expect_data(const Described& view) const {
    if (view.data == nullptr && view.numel() > 0) {
      fail(view.name + ": data is null but the shape " + format_index(view.shape, view.rank) +
           " has elements");
    }
  }

  // Layout rules shared by every tensor argument. Strides of an empty view address
  // nothing (NumPy gives empty arrays all-zero strides), so only its extents count.
  // inner_contiguous: the last axis must have stride 1 (every view a kernel reads a row
  // of). Views read element by element (int8 caches' per-row scales) may pass false.
  void expect_well_formed(const Described& view, bool inner_contiguous = true) const {
    for (int axis = 0; axis < view.rank; ++axis) {
      if (view.shape[axis] < 0) {
        std::ostringstream out;
        out << view.name << ".shape[" << axis << "]: expected >= 0, got " << view.shape[axis];
        fail(out.str());
      }
    }
    if (view.numel() == 0) return;
    for (int axis = 0; axis < view.rank; ++axis) {
      if (view.strides[axis] < 0) {
        std::ostringstream out;
        out << view.name << ".strides[" << axis << "]: expected >= 0, got "
            << view.strides[axis];
        fail(out.str());
      }
    }
    const int inner = view.rank - 1;
    if (inner_contiguous && view.shape[inner] > 1 && view.strides[inner] != 1) {
      std::ostringstream out;
      out << view.name << ".strides[" << inner
          << "]: expected 1 (the innermost dimension must be contiguous), got "
          << view.strides[inner];
      fail(out.str());
    }
    expect_data(view);
  }

  // Outputs must not have two indices on one element: sort the axes by stride and ask
  // each stride to step over everything the smaller axes span (sufficient condition).
  void expect_no_self_overlap(const Described& view) const {
    if (view.numel() == 0) return;
    std::vector<int> axes;
    for (int axis = 0; axis < view.rank; ++axis)
      if (view.shape[axis] > 1) axes.push_back(axis);
    std::sort(axes.begin(), axes.end(),
              [&](int a, int b) { return view.strides[a] < view.strides[b]; });
    int64_t spanned = 1;  // elements covered by the axes already visited
    for (int axis : axes) {
      if (view.strides[axis] < spanned) {
        std::ostringstream out;
        out << view.name << ": an output's elements must not overlap, but strides[" << axis
            << "] = " << view.strides[axis] << " revisits memory already spanned by the axes"
            << " with smaller strides (" << spanned << " elements)";
        fail(out.str());
      }
      spanned = view.strides[axis] * (view.shape[axis] - 1) + spanned;
    }
  }

  void expect_disjoint(const Described& output, const Described& other) const {
    const auto [a_lo, a_hi] = output.byte_range();
    const auto [b_lo, b_hi] = other.byte_range();
    if (a_lo == a_hi || b_lo == b_hi) return;
    if (a_lo < b_hi && b_lo < a_hi) {
      fail(output.name + ": must not share memory with " + other.name +
           " (outputs may not alias inputs or other outputs)");
    }
  }

  // Every output has one index per element and shares no memory with an input or with
  // another output.
  void expect_outputs_apart(std::span<const Described> outputs,
                            std::span<const Described> inputs) const {
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      expect_no_self_overlap(outputs[i]);
      for (const Described& input : inputs) expect_disjoint(outputs[i], input);
      for (std::size_t j = 0; j < i; ++j) expect_disjoint(outputs[i], outputs[j]);
    }
  }

  // check_finite: every element of a view of storage type T is finite (an LSE may be
  // −inf: a row with no key). `index_note` qualifies the index printed (qkv::dist:
  // "local index", the index in this rank's shard).
  template <class T>
  void expect_finite(const Described& view, bool allow_minus_inf = false,
                     std::string_view index_note = {}) const {
    if (view.numel() == 0) return;
    const T* base = static_cast<const T*>(view.data);
    std::array<int64_t, 4> index{};
    const int rank = view.rank;
    while (true) {
      int64_t offset = 0;
      for (int axis = 0; axis < rank; ++axis) offset += index[axis] * view.strides[axis];
      const auto value = static_cast<double>(widen_for_check(base[offset]));
      const bool ok = std::isfinite(value) || (allow_minus_inf && value == -INFINITY);
      if (!ok) {
        std::ostringstream out;
        out << "check_finite: " << view.name << format_index(index, rank);
        if (!index_note.empty()) out << " (" << index_note << ")";
        out << " is " << value;
        fail(out.str());
      }
      int axis = rank - 1;
      while (axis >= 0 && ++index[axis] == view.shape[axis]) index[axis--] = 0;
      if (axis < 0) break;
    }
  }

 private:
  std::string_view function_;
};

}  // namespace qkv::detail
