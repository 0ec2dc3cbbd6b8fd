// GEMM through CBLAS (OpenBLAS): single-threaded calls on output blocks spread over the
// OpenMP pool (see qkv/nn/threads.hpp), and what OpenBLAS says about its kernels.
#include "gemm.hpp"

#include <cblas.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "blas_coretype.hpp"
#include "check.hpp"
#include "parallel.hpp"
#include "qkv/nn/threads.hpp"

namespace qkv::nn {
namespace detail {
namespace {

// Leading dimension for CBLAS: the row stride, at least max(1, cols) even when the
// matrix has a single row (whose stride is never used).
template <class T>
int ld(const Matrix<T>& m) {
  const int64_t minimum = m.shape[1] > 1 ? m.shape[1] : 1;
  return static_cast<int>(m.shape[0] > 1 && m.strides[0] > minimum ? m.strides[0] : minimum);
}

struct Dims {
  int64_t m, n, k;
};

template <class T>
Dims dims(Op op_a, Op op_b, const Matrix<const T>& a, const Matrix<const T>& b,
          const Matrix<T>& c) {
  const int64_t m = op_a == Op::none ? a.shape[0] : a.shape[1];
  const int64_t k = op_a == Op::none ? a.shape[1] : a.shape[0];
  const int64_t k_b = op_b == Op::none ? b.shape[0] : b.shape[1];
  const int64_t n = op_b == Op::none ? b.shape[1] : b.shape[0];
  if (m != c.shape[0] || n != c.shape[1] || k != k_b) {
    fail("gemm", "internal error: shapes (" + std::to_string(m) + "×" + std::to_string(k) +
                     ")·(" + std::to_string(k_b) + "×" + std::to_string(n) + ") → " +
                     std::to_string(c.shape[0]) + "×" + std::to_string(c.shape[1]));
  }
  return {m, n, k};
}

// K = 0: the product is empty, C = β·C (BLAS may not accept k = 0 with these ld's).
template <class T>
void scale_only(T beta, Matrix<T> c) {
  for (int64_t i = 0; i < c.shape[0]; ++i) {
    for (int64_t j = 0; j < c.shape[1]; ++j) c(i, j) = beta == T(0) ? T(0) : beta * c(i, j);
  }
}

CBLAS_TRANSPOSE trans(Op op) { return op == Op::none ? CblasNoTrans : CblasTrans; }

void ensure_blas_ready() {
  static std::once_flag once;
  std::call_once(once, [] {
    openblas_set_num_threads(1);  // parallelism comes from above, see threads.hpp
  });
}

// Output blocks: the larger output dimension is cut into blocks of kBlock, each one
// single-threaded GEMM. 64 rows or columns keep each call large enough for OpenBLAS's
// kernels (≥ 64 × the other dimension × k) while giving 2–16 threads enough pieces.
constexpr int64_t kBlock = 64;

template <class T, class Gemm>
void blocked_gemm(Op op_a, Op op_b, T alpha, Matrix<const T> a, Matrix<const T> b, T beta,
                  Matrix<T> c, Gemm&& call) {
  const Dims d = dims(op_a, op_b, a, b, c);
  if (d.m == 0 || d.n == 0) return;
  if (d.k == 0) return scale_only(beta, c);
  ensure_blas_ready();
  const int lda = ld(a), ldb = ld(b), ldc = ld(c);
  auto run = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    // Row block of op(A) and C, column block of op(B) and C.
    const T* a_block = a.data + (op_a == Op::none ? m0 * lda : m0);
    const T* b_block = b.data + (op_b == Op::none ? n0 : n0 * ldb);
    call(trans(op_a), trans(op_b), static_cast<int>(m1 - m0), static_cast<int>(n1 - n0),
         static_cast<int>(d.k), alpha, a_block, lda, b_block, ldb, beta, c.data + m0 * ldc + n0,
         ldc);
  };
  if (d.m >= d.n) {
    parallel_blocks(d.m, kBlock, [&](int64_t m0, int64_t m1) { run(m0, m1, 0, d.n); });
  } else {
    parallel_blocks(d.n, kBlock, [&](int64_t n0, int64_t n1) { run(0, d.m, n0, n1); });
  }
}

}  // namespace

void use_single_threaded_blas() { ensure_blas_ready(); }

void gemm(Op op_a, Op op_b, float alpha, Matrix<const float> a, Matrix<const float> b,
          float beta, Matrix<float> c) {
  blocked_gemm(op_a, op_b, alpha, a, b, beta, c,
               [](CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, float al,
                  const float* pa, int la, const float* pb, int lb, float be, float* pc, int lc) {
                 cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, al, pa, la, pb, lb, be, pc, lc);
               });
}

void gemm(Op op_a, Op op_b, double alpha, Matrix<const double> a, Matrix<const double> b,
          double beta, Matrix<double> c) {
  blocked_gemm(op_a, op_b, alpha, a, b, beta, c,
               [](CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, double al,
                  const double* pa, int la, const double* pb, int lb, double be, double* pc,
                  int lc) {
                 cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, al, pa, la, pb, lb, be, pc, lc);
               });
}

}  // namespace detail

std::string blas_kernels() {
  detail::ensure_blas_ready();
  const char* name = openblas_get_corename();
  return std::string("OpenBLAS ") + (name != nullptr ? name : "?");
}

std::string faster_blas_coretype() {
  const char* name = openblas_get_corename();
  return detail::faster_coretype(name != nullptr ? name : "", std::getenv("OPENBLAS_CORETYPE") != nullptr,
                                 detail::cpu_vector_features());
}

}  // namespace qkv::nn
