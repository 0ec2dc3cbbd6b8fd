// Measures the machine's fp32 FMA peak with the widest SIMD target Highway dispatches
// to: each thread runs independent fused multiply-adds on kChains accumulators (enough
// to cover FMA latency × ports), nothing else. Prints GFLOP/s for 1..max threads, one
// line each: "threads=T gflops=G target=NAME". Used by bench/bench_attention.py to
// state every kernel's share of the peak.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "fma_peak.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"

#ifndef QKV_BENCH_FMA_PEAK_ONCE_
#define QKV_BENCH_FMA_PEAK_ONCE_
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv_bench::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// FLOPs of `iterations` rounds on one thread; the sum keeps the work observable.
double FmaRounds(long iterations, float* sink) {
  const hn::ScalableTag<float> d;
  constexpr int kChains = 12;  // ≥ latency (4) × FMA ports (2), with room
  hn::Vec<decltype(d)> acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = hn::Set(d, 1.0f + 1e-3f * static_cast<float>(c));
  const auto mul = hn::Set(d, 0.9999999f), add = hn::Set(d, 1e-7f);
  for (long i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = hn::MulAdd(acc[c], mul, add);
  auto total = acc[0];
  for (int c = 1; c < kChains; ++c) total = hn::Add(total, acc[c]);
  *sink = hn::GetLane(total);
  return 2.0 * static_cast<double>(hn::Lanes(d)) * kChains * static_cast<double>(iterations);
}

}  // namespace qkv_bench::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv_bench {
HWY_EXPORT(FmaRounds);

double measure(int threads, long iterations) {
  std::vector<float> sinks(static_cast<size_t>(threads) * 16);
  double flops = 0.0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
  flops += HWY_DYNAMIC_DISPATCH(FmaRounds)(iterations, &sinks[static_cast<size_t>(omp_get_thread_num()) * 16]);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return flops / seconds / 1e9;
}
}  // namespace qkv_bench

int main(int argc, char** argv) {
  const int max_threads = argc > 1 ? std::atoi(argv[1]) : omp_get_max_threads();
  const long iterations = 100'000'000;
  const int64_t usable = hwy::SupportedTargets() & HWY_TARGETS;
  for (int threads = 1; threads <= max_threads; ++threads) {
    double best = 0.0;
    for (int repeat = 0; repeat < 3; ++repeat) best = std::max(best, qkv_bench::measure(threads, iterations));
    std::printf("threads=%d gflops=%.1f target=%s\n", threads, best, hwy::TargetName(usable & -usable));
  }
  return 0;
}
#endif
