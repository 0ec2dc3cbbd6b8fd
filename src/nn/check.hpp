// Argument checks shared by the layers, on the checker every qkv library uses
// (check/checker.hpp): each throws qkv::Error "qkv::nn::function: argument: expected …,
// got …".
#pragma once

#include <cstdint>
#include <string>

#include "check/checker.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/parameter.hpp"

namespace qkv::nn::detail {

// The shared Checker for a layer function ("Linear::forward"), prefixed with qkv::nn::.
// Holds the name itself: the Checker only refers to it.
class LayerChecker {
 public:
  explicit LayerChecker(const std::string& function)
      : name_("qkv::nn::" + function), check_(name_) {}
  LayerChecker(const LayerChecker&) = delete;
  LayerChecker& operator=(const LayerChecker&) = delete;
  const qkv::detail::Checker& operator*() const { return check_; }
  const qkv::detail::Checker* operator->() const { return &check_; }

 private:
  std::string name_;
  qkv::detail::Checker check_;
};

[[noreturn]] inline void fail(const std::string& function, const std::string& message) {
  LayerChecker(function)->fail(message);
}

inline void expect(bool condition, const std::string& function, const std::string& message) {
  if (!condition) fail(function, message);
}

// `view` is [rows, cols] with contiguous rows; cols < 0 or rows < 0 means "any".
template <class T>
void check_matrix(const std::string& function, const char* name, const Matrix<T>& view,
                  int64_t rows, int64_t cols) {
  const LayerChecker check(function);
  const qkv::detail::Described d = qkv::detail::describe(name, view);
  check->expect_data(d);
  if (rows >= 0) check->expect_extent(d, 0, "rows", rows);
  if (cols >= 0) check->expect_extent(d, 1, "features", cols);
  if (view.shape[1] > 1 && view.strides[1] != 1) {
    check->fail(std::string(name) + ".strides[1]: expected 1 (contiguous rows), got " +
                std::to_string(view.strides[1]));
  }
  if (view.shape[0] > 1 && view.strides[0] < view.shape[1]) {
    check->fail(std::string(name) + ".strides[0]: expected ≥ " + std::to_string(view.shape[1]) +
                " (rows must not overlap), got " + std::to_string(view.strides[0]));
  }
}

// A [B, N, F] view whose B·N rows are evenly spaced, seen as the matrix [B·N, F].
template <class T>
Matrix<T> flatten_rows(const std::string& function, const char* name,
                       const TensorView<T, 3>& view) {
  const int64_t batch = view.shape[0], seq = view.shape[1], features = view.shape[2];
  int64_t row_stride = view.strides[1];
  if (seq == 1) {
    row_stride = view.strides[0];
  } else if (batch > 1 && view.strides[0] != seq * view.strides[1]) {
    fail(function, std::string(name) + ": the [batch, seq] axes must flatten to rows: " +
                       "expected strides[0] = shape[1]·strides[1] = " +
                       std::to_string(seq * view.strides[1]) + ", got " +
                       std::to_string(view.strides[0]));
  }
  if (batch * seq <= 1) row_stride = features;
  Matrix<T> matrix(view.data, {batch * seq, features}, {row_stride, view.strides[2]});
  check_matrix(function, name, matrix, -1, -1);
  return matrix;
}

// Resizes a contiguous owning tensor if its shape differs (contents then zero).
template <class T, int R>
void ensure_shape(Tensor<T, R>& tensor, const typename Tensor<T, R>::Shape& shape) {
  if (tensor.shape() != shape || (tensor.data() == nullptr)) tensor = Tensor<T, R>(shape);
}

}  // namespace qkv::nn::detail
