// Machine and small-call probes for bench/bench_decode.py, in one C++ process:
//   qkv_decode_probe bandwidth THREADS   streaming read bandwidth (GB/s) over 1 GiB,
//                                        THREADS threads, best of 5 passes
//   qkv_decode_probe small-call          mean µs of attention_forward on q [1,12,1,64]
//                                        against 64 keys (1 and 2 threads), and of qkv::decode
// Prints "key=value" lines.
#include <omp.h>

#include <qkv/decode.hpp>
#include <qkv/qkv.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "hwy/highway.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Sum of a 1 GiB float array with `threads` threads, 4 independent accumulators each:
// the rate at which the cores can pull data from DRAM.
double bandwidth(int threads) {
  const std::size_t count = std::size_t{1} << 28;  // 1 GiB of floats
  float* data = static_cast<float*>(std::aligned_alloc(64, count * sizeof(float)));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::size_t i = 0; i < count; ++i) data[i] = 1.0f;
  double best = 0.0;
  volatile float sink = 0.0f;
  for (int pass = 0; pass < 5; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    float total = 0.0f;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (std::size_t block = 0; block < count / 64; ++block) {
      const float* p = data + block * 64;
      float a[16] = {};
      for (int i = 0; i < 64; i += 16)
        for (int j = 0; j < 16; ++j) a[j] += p[i + j];
      float s = 0.0f;
      for (float x : a) s += x;
      total += s;
    }
    sink = total;
    best = std::max(best, static_cast<double>(count * sizeof(float)) / seconds_since(start) / 1e9);
  }
  (void)sink;
  std::free(data);
  return best;
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
    DecodeOptions decode_options;
    decode_options.threads = threads;
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

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[1]) == "bandwidth") {
    std::printf("bandwidth_gbs=%.2f\n", bandwidth(std::atoi(argv[2])));
    return 0;
  }
  if (argc >= 2 && std::string(argv[1]) == "small-call") {
    small_call();
    return 0;
  }
  std::fprintf(stderr, "usage: qkv_decode_probe bandwidth THREADS | small-call\n");
  return 2;
}
