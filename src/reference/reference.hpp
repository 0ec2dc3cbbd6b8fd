// The reference backend: the exact oracle every other backend is tested against.
// fp64 accumulation, materialized S and P, and a backward that builds the softmax
// Jacobian J(P_i) = diag(P_i) − P_i·P_iᵀ for every row and multiplies it. Slow on
// purpose: it is written to be checked against the math, line by line.
#pragma once

#include "core/problem.hpp"

namespace qkv::reference {

void forward(const detail::ForwardProblem<float>& problem);
void forward(const detail::ForwardProblem<double>& problem);
void backward(const detail::BackwardProblem<float>& problem);
void backward(const detail::BackwardProblem<double>& problem);

}  // namespace qkv::reference
