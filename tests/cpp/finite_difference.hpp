// Gradients against central differences: dL/dx ≈ (L(x + h) − L(x − h)) / 2h, whose error
// is h²/6·|L'''| (truncation) plus ε·|L|/h (rounding).
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <type_traits>

#include "attention_cases.hpp"

namespace qkv::test {

// L = Σ out ⊙ g for the forward on c's inputs and options, so ∂L/∂out = g: the
// gradients the backward returns for dout = g are ∂L/∂q, ∂L/∂k, ∂L/∂v.
inline double weighted_output(const Case<double>& c, const Tensor<double, 4>& g) {
  Tensor<double, 4> out(g.shape());
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view()},
                    c.options);
  double sum = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) sum += out[i] * g[i];
  return sum;
}

// The central difference of loss() in x, which is restored afterwards. x + h and 2h are
// computed in x's own type (a float sink or slope steps in float).
template <class Value, class Loss>
double central_difference(Value& x, std::type_identity_t<Value> step, Loss&& loss) {
  const Value saved = x;
  x = saved + step;
  const double up = loss();
  x = saved - step;
  const double down = loss();
  x = saved;
  return (up - down) / (2 * step);
}

// Every element of `values` (a tensor or vector that loss() reads): |grad[i] − central
// difference| ≤ tolerance.
template <class Values, class Grad, class Step, class Loss>
void expect_gradient_matches(Values& values, const Grad& grad, Step step, double tolerance, Loss&& loss,
                             const char* name) {
  for (std::size_t i = 0; i < values.size(); ++i)
    EXPECT_NEAR(grad[i], central_difference(values[i], step, loss), tolerance) << name << "[" << i << "]";
}

}  // namespace qkv::test
