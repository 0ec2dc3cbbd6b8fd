// Parameters: a learnable tensor, its gradient, and the list an optimizer walks.
//
// Every layer owns its Parameters and lists them, with dotted names
// ("blocks.0.attn.q_proj.weight"), through `collect`. Gradients are *accumulated* by the
// layers' backward passes (so a parameter used twice gets both contributions); call
// `zero_grad` on the list before each step.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "qkv/tensor.hpp"

namespace qkv::nn {

// A row-major matrix view: shape [rows, cols], strides [row stride, 1].
template <class T>
using Matrix = TensorView<T, 2>;

template <class T>
struct Parameter {
  Parameter() = default;
  // Zero-filled value and gradient of the given shape (rank 1 or 2). `decay`: whether
  // AdamW's decoupled weight decay applies (weights: yes; biases and norm gains: no).
  Parameter(std::vector<int64_t> shape, bool decay);

  std::vector<int64_t> shape;
  Tensor<T, 1> value;
  Tensor<T, 1> grad;
  bool decay = true;

  int64_t numel() const { return static_cast<int64_t>(value.size()); }
  bool empty() const { return value.size() == 0; }

  std::span<T> values() { return {value.data(), value.size()}; }
  std::span<const T> values() const { return {value.data(), value.size()}; }
  std::span<T> grads() { return {grad.data(), grad.size()}; }
  std::span<const T> grads() const { return {grad.data(), grad.size()}; }

  // The value (or gradient) as a [shape[0], shape[1]] matrix; rank-2 parameters only.
  Matrix<T> matrix();
  Matrix<const T> matrix() const;
  Matrix<T> grad_matrix();
};

template <class T>
struct NamedParameter {
  std::string name;
  Parameter<T>* parameter = nullptr;
};

template <class T>
using ParameterList = std::vector<NamedParameter<T>>;

// Sets every gradient in the list to zero.
template <class T>
void zero_grad(const ParameterList<T>& parameters);

// Total number of scalars in the list.
template <class T>
int64_t count_parameters(const ParameterList<T>& parameters);

}  // namespace qkv::nn
