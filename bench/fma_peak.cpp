// Prints the machine's fp32 FMA peak (fma_probe.hpp) and its dot-product peaks
// (dot_peak.hpp; 0 where the CPU lacks the unit) for 1..max threads, one line each:
// "threads=T gflops=G target=NAME bf16_gflops=B int8_gops=I amx_gflops=A". bench/bench_attention.py
// and bench_decode.py read it to state every kernel's share of its own unit's peak.
// QKV_SIMD_TARGET=AVX2 (any target qkv accepts) measures that target's FMA peak, as its
// kernels run it; target= names the one measured. The dot units' peaks do not depend on it.
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <exception>

#include "dot_peak.hpp"
#include "fma_probe.hpp"

int main(int argc, char** argv) try {
  const int max_threads = argc > 1 ? std::atoi(argv[1]) : omp_get_max_threads();
  for (int threads = 1; threads <= max_threads; ++threads) {
    const qkv::bench::FmaPeak peak = qkv::bench::measure_fma_peak(threads, 100'000'000, 3);
    const double bf16 = qkv::bench::measure_dot_peak(qkv::bench::DotUnit::bf16, threads, 100'000'000, 3);
    const double int8 = qkv::bench::measure_dot_peak(qkv::bench::DotUnit::int8, threads, 100'000'000, 3);
    const double amx = qkv::bench::measure_dot_peak(qkv::bench::DotUnit::amx_bf16, threads, 100'000'000, 3);
    std::printf("threads=%d gflops=%.1f target=%s bf16_gflops=%.1f int8_gops=%.1f amx_gflops=%.1f\n", threads,
                peak.gflops, peak.target.c_str(), bf16, int8, amx);
  }
  return 0;
} catch (const std::exception& error) {  // a QKV_SIMD_TARGET this build or CPU lacks
  std::fprintf(stderr, "qkv_fma_peak: %s\n", error.what());
  return 1;
}
