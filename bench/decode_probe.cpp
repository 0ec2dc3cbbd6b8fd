// Machine and small-call probes for bench/bench_decode.py, in one C++ process:
//   qkv_decode_probe bandwidth THREADS   streaming read bandwidth (GB/s) over 1 GiB,
//                                        THREADS threads, best of 5 passes
//   qkv_decode_probe decode HQ HKV D N TYPE THREADS [PAGE]
//                                        best ms and GB/s of qkv::decode, one query per
//                                        head, N keys, TYPE f32|bf16|f16|i8|e4m3|e5m2 (i8: a
//                                        scale per row; float8: one per kv head, zero-stride
//                                        views as vLLM's per-head scales), PAGE 0 = contiguous
//                                        [1, N, HKV, D], -1 = PyTorch's [1, HKV, N, D], > 0 paged
//   qkv_decode_probe cache HQ HKV D N TYPE THREADS
//                                        best ms and GB/s of a qkv::KVCache's attend, one
//                                        query per head, N keys of random values, TYPE
//                                        f32|bf16|i8 (row scales)|i8c (channel scales,
//                                        groups of 32)|i4 (float16 scales)|i4f32; bytes
//                                        counted from the cache's arrays
//   qkv_decode_probe small-call          mean µs of attention_forward on q [1,12,1,64]
//                                        against 64 keys (1 and 2 threads), and of qkv::decode
// Prints "key=value" lines.
#include <omp.h>

#include <qkv/decode.hpp>
#include <qkv/kv_cache.hpp>
#include <qkv/qkv.hpp>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "fma_probe.hpp"
#include "hwy/highway.h"
#include "hwy/targets.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Streaming read bandwidth of `threads` threads over 1 GiB (fma_probe.hpp), best of 5.
double bandwidth(int threads) { return qkv::bench::measure_read_bandwidth(threads, std::size_t{1} << 30, 5); }

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

void small_call() {
  using namespace qkv;
  const int64_t heads = 12, d = 64, keys = 64;
  Tensor<float, 4> q({1, 1, heads, d}), k({1, keys, heads, d}), v({1, keys, heads, d}), out({1, 1, heads, d});
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = v[i] = static_cast<float>(i % 7) * 0.1f;
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 0.01f * static_cast<float>(i % 5);
  std::vector<int64_t> lengths{keys};
  for (int threads : {1, 2}) {
    AttentionOptions options;
    options.execution.threads = threads;
    auto forward = [&] {
      attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view()}, options);
    };
    AttentionOptions decode_options;
    decode_options.causal = Causal::bottom_right;
    decode_options.execution.threads = threads;
    auto direct = [&] {
      decode(DecodeArgs<float>{.q = q.cview(), .k_cache = k.cview(), .v_cache = v.cview(),
                               .cache_lengths = lengths, .out = out.view()},
             decode_options);
    };
    for (auto [name, fn] : {std::pair<const char*, std::function<void()>>{"attention_forward", forward},
                            {"decode", direct}}) {
      for (int i = 0; i < 2000; ++i) fn();
      double best = 1e9;
      for (int round = 0; round < 5; ++round) {
        const int calls = 20000;
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < calls; ++i) fn();
        best = std::min(best, seconds_since(start) / calls * 1e6);
      }
      std::printf("small_call_us_%s_threads%d=%.2f\n", name, threads, best);
    }
  }
}

// The target HWY_DYNAMIC_DISPATCH picks: the best one compiled and supported (Highway's
// better targets have lower bits).
const char* best_target() {
  const int64_t targets = hwy::SupportedTargets() & HWY_TARGETS;
  return hwy::TargetName(targets & -targets);
}

// QKV_PROBE_TARGET=AVX2 (or AVX3, EMU128): run the kernels on that SIMD target only, if
// this machine supports it and it was compiled.
void force_target() {
  const char* name = std::getenv("QKV_PROBE_TARGET");
  if (name == nullptr) return;
  for (int64_t rest = hwy::SupportedTargets() & HWY_TARGETS; rest != 0; rest &= rest - 1) {
    const int64_t target = rest & -rest;
    if (std::string(hwy::TargetName(target)) == name) {
      hwy::SetSupportedTargetsForTest(target);
      return;
    }
  }
  std::fprintf(stderr, "QKV_PROBE_TARGET=%s: not compiled or not supported here\n", name);
  std::exit(2);
}

template <class T>
void decode_rate(int64_t q_heads, int64_t kv_heads, int64_t d, int64_t n, int threads, int64_t page) {
  using namespace qkv;
  Tensor<float, 4> q({1, 1, q_heads, d}), out({1, 1, q_heads, d});
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 0.01f * static_cast<float>(i % 13);
  const int64_t blocks = page > 0 ? (n + page - 1) / page : 1;
  Tensor<T, 4> k(page > 0 ? std::array<int64_t, 4>{blocks, page, kv_heads, d} : std::array<int64_t, 4>{1, n, kv_heads, d});
  Tensor<T, 4> v(k.shape());
  constexpr bool kInt8 = std::is_same_v<T, std::int8_t>;
  constexpr bool kFloat8 = is_float8(storage_type_of<T>);
  for (std::size_t i = 0; i < k.size(); ++i) {
    if constexpr (kInt8) k[i] = v[i] = static_cast<std::int8_t>(i % 17);
    else k[i] = v[i] = T(static_cast<float>(i % 17) * 0.05f);
  }
  // float8: one scale per kv head, a [rows, .., Hkv] view with strides {0, 0, 1}.
  std::vector<float> head_scales(static_cast<std::size_t>(kv_heads), 0.05f);
  // int8: one scale per row (4 bytes per d values; counted in the bytes read below).
  Tensor<float, 3> scales({k.shape()[0], k.shape()[1], kv_heads});
  for (std::size_t i = 0; i < scales.size(); ++i) scales[i] = 0.05f;
  Tensor<int32_t, 2> table({1, blocks});
  for (int64_t j = 0; j < blocks; ++j) table(0, j) = static_cast<int32_t>((j * 7919) % blocks);  // scattered
  std::vector<int64_t> lengths{n};
  DecodeArgs<T> args{.q = q.cview(), .k_cache = k.cview(), .v_cache = v.cview(), .cache_lengths = lengths,
                     .out = out.view()};
  if (page > 0) args.block_table = table.cview();
  if (page < 0) {  // PyTorch's [B, Hkv, N, d] buffer: each head's keys contiguous
    args.k_cache = TensorView<const T, 4>::from_bhsd(k.data(), 1, kv_heads, n, d);
    args.v_cache = TensorView<const T, 4>::from_bhsd(v.data(), 1, kv_heads, n, d);
  }
  if constexpr (kInt8) args.k_scale = args.v_scale = scales.cview();
  if constexpr (kFloat8)
    args.k_scale = args.v_scale =
        View3<const float>(head_scales.data(), {k.shape()[0], k.shape()[1], kv_heads}, {0, 0, 1});
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  options.execution.threads = threads;
  decode(args, options);
  // Wall time, and the process's CPU time per thread asked: on a machine shared with
  // other work the second leaves out the time a thread waited for a core.
  double best = 1e9, best_cpu = 1e9;
  const char* rounds_env = std::getenv("QKV_PROBE_ROUNDS");  // more samples for a profiler
  const int rounds = rounds_env != nullptr ? std::atoi(rounds_env) : 15;
  for (int round = 0; round < rounds; ++round) {
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = cpu_seconds();
    decode(args, options);
    best = std::min(best, seconds_since(start));
    best_cpu = std::min(best_cpu, (cpu_seconds() - cpu_start) / threads);
  }
  const double bytes = static_cast<double>(n * kv_heads * 2) * (static_cast<double>(d * sizeof(T)) + (kInt8 ? 4.0 : 0.0));
  std::printf("decode_ms=%.3f decode_gbs=%.2f cpu_ms=%.3f cpu_gbs=%.2f target=%s\n", best * 1e3, bytes / best / 1e9,
              best_cpu * 1e3, bytes / best_cpu / 1e9, best_target());
}

// attend of a KVCache of N random keys (normal values, a few outlier channels as
// post-RoPE keys have), one query per head; bytes = every array the cache holds for
// those keys (levels, scales, zero points).
void cache_rate(int64_t q_heads, int64_t kv_heads, int64_t d, int64_t n, const std::string& type, int threads) {
  using namespace qkv;
  KVCacheConfig config{.batch = 1, .capacity = n, .kv_heads = kv_heads, .head_dim = d};
  if (type == "bf16") config.dtype = StorageType::bfloat16;
  if (type == "i8" || type == "i8c") config.dtype = StorageType::int8;
  if (type == "i8c") config.key_scales = KeyScales::channel;
  if (type == "i4" || type == "i4f32") {
    config.dtype = StorageType::int4;
    config.key_scales = KeyScales::channel;
  }
  if (type == "i4f32") config.scale_dtype = StorageType::float32;
  KVCache cache(config);
  std::mt19937 random(7);
  std::normal_distribution<float> normal;
  const int64_t chunk = 4096;
  Tensor<float, 4> k({1, chunk, kv_heads, d}), v({1, chunk, kv_heads, d});
  for (int64_t done = 0; done < n; done += chunk) {
    const int64_t rows = std::min(chunk, n - done);
    Tensor<float, 4> kk({1, rows, kv_heads, d}), vv({1, rows, kv_heads, d});
    for (std::size_t i = 0; i < kk.size(); ++i) {
      kk[i] = normal(random) * ((i % static_cast<std::size_t>(d)) % 16 == 3 ? 4.0f : 1.0f);
      vv[i] = normal(random);
    }
    cache.append(kk.cview(), vv.cview());
  }
  Tensor<float, 4> q({1, 1, q_heads, d}), out({1, 1, q_heads, d});
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = normal(random);
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  options.execution.threads = threads;
  cache.attend(q.cview(), out.view(), {}, options);
  double best = 1e9;
  const char* rounds_env = std::getenv("QKV_PROBE_ROUNDS");
  const int rounds = rounds_env != nullptr ? std::atoi(rounds_env) : 15;
  for (int round = 0; round < rounds; ++round) {
    const auto start = std::chrono::steady_clock::now();
    cache.attend(q.cview(), out.view(), {}, options);
    best = std::min(best, seconds_since(start));
  }
  const auto elements = [](std::array<int64_t, 4> shape) { return static_cast<double>(shape[0] * shape[1] * shape[2] * shape[3]); };
  const double element_bytes = config.dtype == StorageType::float32    ? 4.0
                               : config.dtype == StorageType::bfloat16 ? 2.0
                               : config.dtype == StorageType::int4     ? 0.5  // k_shape counts values
                                                                       : 1.0;
  const double scale_bytes = cache.config().scale_dtype == StorageType::float16 ? 2.0 : 4.0;
  const bool half = cache.config().scale_dtype == StorageType::float16;
  const double scales = half ? static_cast<double>(cache.k_scales<float16>().size() + cache.k_channel_scales<float16>().size() +
                                                   cache.k_channel_zeros<float16>().size() + cache.v_group_scales<float16>().size())
                             : static_cast<double>(cache.k_scales().size() + cache.v_scales().size() + cache.k_channel_scales().size() +
                                                   cache.k_channel_zeros().size() + cache.v_group_scales().size());
  const double bytes = (elements(cache.k_shape()) + elements(cache.v_shape())) * element_bytes + scales * scale_bytes;
  std::printf("cache_ms=%.3f cache_gbs=%.2f bytes_per_value=%.3f target=%s\n", best * 1e3, bytes / best / 1e9,
              bytes / static_cast<double>(2 * n * kv_heads * d), best_target());
}

}  // namespace

int main(int argc, char** argv) {
  force_target();
  if (argc >= 3 && std::string(argv[1]) == "bandwidth") {
    std::printf("bandwidth_gbs=%.2f\n", bandwidth(std::atoi(argv[2])));
    return 0;
  }
  if (argc >= 8 && std::string(argv[1]) == "decode") {
    const int64_t hq = std::atoll(argv[2]), hkv = std::atoll(argv[3]), d = std::atoll(argv[4]), n = std::atoll(argv[5]);
    const std::string type = argv[6];
    const int threads = std::atoi(argv[7]);
    const int64_t page = argc >= 9 ? std::atoll(argv[8]) : 0;
    if (type == "bf16") decode_rate<qkv::bfloat16>(hq, hkv, d, n, threads, page);
    else if (type == "f16") decode_rate<qkv::float16>(hq, hkv, d, n, threads, page);
    else if (type == "i8") decode_rate<std::int8_t>(hq, hkv, d, n, threads, page);
    else if (type == "e4m3") decode_rate<qkv::float8_e4m3fn>(hq, hkv, d, n, threads, page);
    else if (type == "e5m2") decode_rate<qkv::float8_e5m2>(hq, hkv, d, n, threads, page);
    else decode_rate<float>(hq, hkv, d, n, threads, page);
    return 0;
  }
  if (argc >= 8 && std::string(argv[1]) == "cache") {
    cache_rate(std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), std::atoll(argv[5]), argv[6], std::atoi(argv[7]));
    return 0;
  }
  if (argc >= 2 && std::string(argv[1]) == "small-call") {
    small_call();
    return 0;
  }
  std::fprintf(stderr, "usage: qkv_decode_probe bandwidth THREADS | decode HQ HKV D N TYPE THREADS [PAGE] | cache HQ HKV D N TYPE THREADS | small-call\n");
  return 2;
}
