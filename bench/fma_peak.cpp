// Prints the machine's fp32 FMA peak (fma_probe.hpp) for 1..max threads, one line each:
// "threads=T gflops=G target=NAME". bench/bench_attention.py reads it to state every
// kernel's share of the peak.
#include <omp.h>

#include <cstdio>
#include <cstdlib>

#include "fma_probe.hpp"

int main(int argc, char** argv) {
  const int max_threads = argc > 1 ? std::atoi(argv[1]) : omp_get_max_threads();
  for (int threads = 1; threads <= max_threads; ++threads) {
    const qkv::bench::FmaPeak peak = qkv::bench::measure_fma_peak(threads, 100'000'000, 3);
    std::printf("threads=%d gflops=%.1f target=%s\n", threads, peak.gflops, peak.target.c_str());
  }
  return 0;
}
