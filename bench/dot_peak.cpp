// The dot-product peak probes of dot_peak.hpp: 12 independent accumulator chains
// (≥ latency × ports of either unit on the CPUs measured), intrinsics under a target
// attribute, as the kernels use them (src/cpu/bf16_dot.cpp).
#include "dot_peak.hpp"

#include <omp.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu/amx_dot.hpp"
#endif

namespace qkv::bench {
namespace {

constexpr int kChains = 12;

#if defined(__x86_64__)
// Operations (2 per multiply-add) of `iterations` rounds; the sum keeps the work observable.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) double bf16_rounds(long iterations, float* sink) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  __m512i a = _mm512_set1_epi16(0x3F80), b = _mm512_set1_epi16(0x3380);  // 1.0, ~6e-8
  for (long i = 0; i < iterations; ++i) {
    for (int c = 0; c < kChains; ++c)
      acc[c] = _mm512_dpbf16_ps(acc[c], reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
    __asm__ volatile("" : "+v"(a));  // a loop-carried operand the compiler cannot hoist
  }
  __m512 total = acc[0];
  for (int c = 1; c < kChains; ++c) total = _mm512_add_ps(total, acc[c]);
  float lanes[16];  // (GCC 12's _mm512_reduce_* trip -Werror=uninitialized)
  _mm512_storeu_ps(lanes, total);
  *sink = lanes[0] + lanes[15];
  return 2.0 * 32 * kChains * static_cast<double>(iterations);
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) double int8_rounds(long iterations, float* sink) {
  __m512i acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c);
  __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(-1);
  for (long i = 0; i < iterations; ++i) {
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
    __asm__ volatile("" : "+v"(a));
  }
  __m512i total = acc[0];
  for (int c = 1; c < kChains; ++c) total = _mm512_add_epi32(total, acc[c]);
  int lanes[16];
  _mm512_storeu_si512(lanes, total);
  *sink = static_cast<float>(lanes[0] + lanes[15]);
  return 2.0 * 64 * kChains * static_cast<double>(iterations);
}

// Four independent 16 × 16 accumulator tiles (the kernels' 2 × 2 blocking, amx_dot.cpp),
// operands in registers: the tiles' own rate, without the loads a kernel adds.
__attribute__((target("amx-tile,amx-bf16"))) double amx_rounds(long iterations, float* sink) {
  struct alignas(64) {
    unsigned char palette = 1, start_row = 0, reserved[14] = {};
    unsigned short bytes_per_row[16] = {};
    unsigned char rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  alignas(64) static thread_local unsigned short operand[16 * 32];
  alignas(64) static thread_local float out[16 * 16];
  for (auto& x : operand) x = 0x3380;  // ~6e-8: sums stay finite
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  for (long i = 0; i < iterations / 16; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  *sink = out[0];
  return 2.0 * 16 * 16 * 32 * 4 * static_cast<double>(iterations / 16);
}
#endif

double rounds(DotUnit unit, long iterations, float* sink) {
#if defined(__x86_64__)
  if (unit == DotUnit::amx_bf16) return amx_rounds(iterations, sink);
  return unit == DotUnit::bf16 ? bf16_rounds(iterations, sink) : int8_rounds(iterations, sink);
#else
  (void)unit, (void)iterations, (void)sink;
  return 0.0;
#endif
}

double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

}  // namespace

bool has_dot_unit(DotUnit unit) {
#if defined(__x86_64__)
  if (unit == DotUnit::amx_bf16) return cpu::amx::available();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return false;
  return unit == DotUnit::bf16 ? __builtin_cpu_supports("avx512bf16") : __builtin_cpu_supports("avx512vnni");
#else
  (void)unit;
  return false;
#endif
}

double measure_dot_peak(DotUnit unit, int threads, long iterations, int repeats) {
  if (!has_dot_unit(unit)) return 0.0;
  std::vector<float> sinks(static_cast<size_t>(threads) * 16);  // a cache line per thread
  double best = 0.0;
  for (int repeat = 0; repeat < repeats; ++repeat) {
    double ops = 0.0;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : ops)
    ops += rounds(unit, iterations, &sinks[static_cast<size_t>(omp_get_thread_num()) * 16]);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, ops / seconds / 1e9);
  }
  return best;
}

double measure_dot_peak_cpu_time(DotUnit unit, long iterations, int repeats) {
  if (!has_dot_unit(unit)) return 0.0;
  float sink = 0.0f;
  double best = 0.0;
  for (int repeat = 0; repeat < repeats; ++repeat) {
    const double start = thread_seconds();
    const double ops = rounds(unit, iterations, &sink);
    best = std::max(best, ops / (thread_seconds() - start) / 1e9);
  }
  return best;
}

}  // namespace qkv::bench
