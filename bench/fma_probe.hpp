// The machine's fp32 FMA peak and streaming read bandwidth, measured. FMA peak: each
// thread runs independent fused multiply-adds on enough accumulators to cover FMA
// latency × ports, nothing else, with the widest SIMD target Highway dispatches to (or
// QKV_SIMD_TARGET's, read as qkv reads it: the target qkv's kernels run). Shared by
// bench/fma_peak (for bench/bench_attention.py) and `qkv bench`, so both state a
// kernel's share of the same peak.
#pragma once

#include <cstddef>
#include <string>

namespace qkv::bench {

struct FmaPeak {
  double gflops = 0;   // the fastest of the repeats
  std::string target;  // Highway's name of the SIMD target, e.g. "AVX3"
};

// `threads` OpenMP threads, each running `iterations` rounds of FMAs, `repeats` times.
FmaPeak measure_fma_peak(int threads, long iterations, int repeats);

// One core's peak by the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID), not the
// wall clock: unaffected by other processes sharing the machine (bench/dense_probe.cpp).
FmaPeak measure_fma_peak_cpu_time(long iterations, int repeats);

// Streaming read bandwidth (GB/s, decimal) of `threads` threads summing disjoint shares
// of a `bytes` buffer (make it ≫ the last-level cache): the fastest of `repeats` passes.
// Whole vectors and independent accumulators, so it measures what the cores can pull
// from DRAM, the limit a decode call streaming its KV cache is held to.
double measure_read_bandwidth(int threads, std::size_t bytes, int repeats);

}  // namespace qkv::bench
