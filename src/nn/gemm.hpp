// The one place qkv::nn calls the BLAS: C = α·op(A)·op(B) + β·C on row-major views.
// Callers have validated shapes; a mismatch here is an internal error.
#pragma once

#include "qkv/nn/parameter.hpp"

namespace qkv::nn::detail {

enum class Op { none, transpose };

void gemm(Op op_a, Op op_b, float alpha, Matrix<const float> a, Matrix<const float> b,
          float beta, Matrix<float> c);
void gemm(Op op_a, Op op_b, double alpha, Matrix<const double> a, Matrix<const double> b,
          double beta, Matrix<double> c);

}  // namespace qkv::nn::detail
