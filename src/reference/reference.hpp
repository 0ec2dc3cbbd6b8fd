// The reference backend: the exact oracle every other backend is tested against.
// fp64 accumulation, materialized S and P, and a backward that builds the softmax
// Jacobian J(P_i) = diag(P_i) − P_i·P_iᵀ for every row and multiplies it. Slow on
// purpose: it is written to be checked against the math, line by line. bfloat16 and
// float16 inputs are widened exactly to double; outputs are rounded to the storage type
// through float (double → float → half: a double rounding, off by one half-ulp only in
// rare ties; the tests read the reference in double, so the error contract never sees it).
#pragma once

#include "core/problem.hpp"

namespace qkv::reference {

void forward(const detail::ForwardProblem<float>& problem);
void forward(const detail::ForwardProblem<double>& problem);
void backward(const detail::BackwardProblem<float>& problem);
void backward(const detail::BackwardProblem<double>& problem);
void forward(const detail::ForwardProblem<bfloat16>& problem);
void forward(const detail::ForwardProblem<float16>& problem);
void backward(const detail::BackwardProblem<bfloat16>& problem);
void backward(const detail::BackwardProblem<float16>& problem);

}  // namespace qkv::reference
