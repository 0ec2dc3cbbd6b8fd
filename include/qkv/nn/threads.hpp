// Threads of qkv::nn's own work: GEMMs and element-wise loops.
//
// qkv::nn runs one pool of threads, OpenMP's, which is also the one the attention core
// uses (its thread count is per call: qkv::Execution::threads). GEMMs call OpenBLAS
// single-threaded on blocks of 64 rows (or columns) of the output, spread over the pool;
// element-wise loops split into fixed blocks too. A second pool (OpenBLAS's own threads)
// next to OpenMP's would spin against it on the same cores: measured here, 2 threads
// then cost twice the CPU time of 1 for the same work.
//
// Because the blocks do not depend on the thread count, neither do the results: every
// element is computed by the same code in the same order with 1 thread or 16.
//
// OpenBLAS kernels: OpenBLAS chooses them from the CPU model when it loads. A release
// older than the CPU falls back to its slowest (SSE3 "Prescott") kernels, 7× slower than
// the AVX-512 ones; the documented remedy is OPENBLAS_CORETYPE (e.g. SkylakeX or
// Haswell), set before the library loads. faster_blas_coretype() says when and which; the
// `qkv` command acts on it by starting itself again with the variable set.
#pragma once

#include <string>

namespace qkv::nn {

// n ≥ 1, else qkv::Error. Process-wide; the default is 1. Also sets OpenBLAS to one
// thread (qkv::nn parallelizes above it).
void set_threads(int n);
int threads();

// The BLAS and the kernels it runs, e.g. "OpenBLAS SkylakeX".
std::string blas_kernels();

// "SkylakeX" or "Haswell" when OpenBLAS fell back to its SSE3 "Prescott" kernels on a CPU
// with AVX-512 or AVX2 + FMA and OPENBLAS_CORETYPE was not set: running the program again
// with OPENBLAS_CORETYPE set to it gives the fast kernels. Otherwise "".
std::string faster_blas_coretype();

}  // namespace qkv::nn
