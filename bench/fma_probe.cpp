// The machine probes (fma_probe.hpp): the FMA peak and the streaming read bandwidth,
// compiled for every SIMD target Highway knows and dispatched at run time to the best
// the CPU has, or to the one QKV_SIMD_TARGET forces (as qkv's kernels are), so that a
// run on forced kernels states its share of the peak that target can reach.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "fma_probe.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"

#ifndef QKV_BENCH_FMA_PROBE_ONCE_
#define QKV_BENCH_FMA_PROBE_ONCE_
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "cpu/simd_target.hpp"  // qkv's own reading of QKV_SIMD_TARGET
#include "fma_probe.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv_bench::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// FLOPs of `iterations` rounds on one thread; the sum keeps the work observable.
double FmaRounds(long iterations, float* sink) {
  const hn::ScalableTag<float> d;
  constexpr int kChains = 12;  // ≥ latency (4) × FMA ports (2), with room
  hn::Vec<decltype(d)> acc[kChains];
  // The starting values and factors come through volatiles: with them known, GCC proves
  // on the SCALAR target that x·0.9999999f + 1e-7f rounds back to x near 1 and deletes the
  // loop (qkv_fma_peak printed 3.7 PFLOP/s there).
  volatile float one = 1.0f, factor = 0.9999999f, term = 1e-7f;
  for (int c = 0; c < kChains; ++c) acc[c] = hn::Set(d, one + 1e-3f * static_cast<float>(c));
  const auto mul = hn::Set(d, factor), add = hn::Set(d, term);
  for (long i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = hn::MulAdd(acc[c], mul, add);
  auto total = acc[0];
  for (int c = 1; c < kChains; ++c) total = hn::Add(total, acc[c]);
  *sink = hn::GetLane(total);
  return 2.0 * static_cast<double>(hn::Lanes(d)) * kChains * static_cast<double>(iterations);
}

// Sum of floats [0, count): whole vectors, 8 independent accumulators (≥ add latency ×
// ports), no per-block horizontal sums, so the loads — not the adds — set the pace.
float ReadSum(const float* HWY_RESTRICT data, size_t count) {
  const hn::ScalableTag<float> d;
  const size_t lanes = hn::Lanes(d);
  constexpr size_t kChains = 8;
  hn::Vec<decltype(d)> acc[kChains];
  for (size_t c = 0; c < kChains; ++c) acc[c] = hn::Zero(d);
  size_t i = 0;
  for (; i + kChains * lanes <= count; i += kChains * lanes)
    for (size_t c = 0; c < kChains; ++c) acc[c] = hn::Add(acc[c], hn::LoadU(d, data + i + c * lanes));
  for (size_t c = 1; c < kChains; ++c) acc[0] = hn::Add(acc[0], acc[c]);
  float total = hn::GetLane(hn::SumOfLanes(d, acc[0]));
  for (; i < count; ++i) total += data[i];
  return total;
}

}  // namespace qkv_bench::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv_bench {
HWY_EXPORT(FmaRounds);
HWY_EXPORT(ReadSum);

// Each thread sums its own contiguous share of `data` (first touched by the same thread).
double read_pass(const float* data, size_t count, int threads) {
  float total = 0.0f;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const size_t share = count / static_cast<size_t>(omp_get_num_threads());
    const size_t first = share * static_cast<size_t>(omp_get_thread_num());
    total += HWY_DYNAMIC_DISPATCH(ReadSum)(data + first, share);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float sink = total;
  (void)sink;
  return static_cast<double>(count / static_cast<size_t>(threads) * static_cast<size_t>(threads)) *
         sizeof(float) / seconds / 1e9;
}

double measure(int threads, long iterations) {
  std::vector<float> sinks(static_cast<size_t>(threads) * 16);  // a cache line per thread
  double flops = 0.0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
  flops += HWY_DYNAMIC_DISPATCH(FmaRounds)(iterations, &sinks[static_cast<size_t>(omp_get_thread_num()) * 16]);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return flops / seconds / 1e9;
}

double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// FLOP/s of one thread's rounds by its CPU time (dispatched here, inside the namespace
// of the exported function, as the static-only build's dispatch macro requires).
double cpu_time_gflops(long iterations, float* sink) {
  const double start = thread_seconds();
  const double flops = HWY_DYNAMIC_DISPATCH(FmaRounds)(iterations, sink);
  return flops / (thread_seconds() - start) / 1e9;
}
}  // namespace qkv_bench

namespace qkv::bench {

FmaPeak measure_fma_peak(int threads, long iterations, int repeats) {
  // The library's override (it throws qkv::Error naming the choices for a bad name):
  // Highway's dispatch mask is process-wide, so it forces these probes as well.
  qkv::cpu::apply_simd_target_override();
  FmaPeak peak;
  for (int repeat = 0; repeat < repeats; ++repeat) {
    peak.gflops = std::max(peak.gflops, qkv_bench::measure(threads, iterations));
  }
  const int64_t usable = hwy::SupportedTargets() & HWY_TARGETS;
  peak.target = hwy::TargetName(usable & -usable);
  return peak;
}

FmaPeak measure_fma_peak_cpu_time(long iterations, int repeats) {
  FmaPeak peak = measure_fma_peak(1, 1000, 1);  // the target's name, and a warm-up
  peak.gflops = 0.0;
  float sink = 0.0f;
  for (int repeat = 0; repeat < repeats; ++repeat)
    peak.gflops = std::max(peak.gflops, qkv_bench::cpu_time_gflops(iterations, &sink));
  return peak;
}

double measure_read_bandwidth(int threads, size_t bytes, int repeats) {
  qkv::cpu::apply_simd_target_override();  // as measure_fma_peak
  const size_t count = bytes / sizeof(float);
  float* data = static_cast<float*>(std::aligned_alloc(64, count * sizeof(float)));
  if (data == nullptr) return 0.0;
#pragma omp parallel num_threads(threads)
  {  // each thread touches the pages it will read (its NUMA node, its TLB walks)
    const size_t share = count / static_cast<size_t>(omp_get_num_threads());
    const size_t first = share * static_cast<size_t>(omp_get_thread_num());
    std::fill(data + first, data + first + share, 1.0f);
  }
  double best = 0.0;
  for (int repeat = 0; repeat < repeats; ++repeat)
    best = std::max(best, qkv_bench::read_pass(data, count, threads));
  std::free(data);
  return best;
}

}  // namespace qkv::bench
#endif
