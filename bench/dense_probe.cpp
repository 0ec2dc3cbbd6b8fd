// Dense attention per core, by the thread's own CPU time: fp32 forward and backward on
// one thread, GFLOP/s per CPU-second next to the FMA peak measured the same way.
//
// Wall-clock benchmarks (bench_attention.py, `qkv bench`) are what users see, but on a
// machine shared with other jobs they swing with the load. A single-threaded call timed
// with CLOCK_THREAD_CPUTIME_ID counts only the cycles this thread ran, so kernel
// changes can be compared even while other processes compete for the cores (caches and
// SMT siblings still add noise: take the fastest of several runs).
//
//   qkv_dense_probe [N=4096] [d=64] [causal=0] [heads=8] [repeats=5] [pass=fwd|bwd|both]
//                   [layout=bshd|bhsd]   (bhsd: PyTorch's, each head's rows contiguous)
//                   [target=best|AVX2|AVX3|...]  a lower SIMD target than the CPU's best,
//                   forced through Highway (hwy::SetSupportedTargetsForTest)
//                   [dtype=float32|bfloat16]  bfloat16: the same values stored in bf16, the
//                   default precision (dot products where the CPU has them; QKV_DOT_PRODUCTS
//                   =off for the float32 arithmetic), the bf16 dot peak printed too
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dot_peak.hpp"
#include "fma_probe.hpp"
#include "hwy/targets.h"
#include "qkv/attention.hpp"

namespace {

double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

}  // namespace

int main(int argc, char** argv) try {
  const int64_t n = argc > 1 ? std::atol(argv[1]) : 4096;
  const int64_t d = argc > 2 ? std::atol(argv[2]) : 64;
  const bool causal = argc > 3 && std::atoi(argv[3]) != 0;
  const int64_t heads = argc > 4 ? std::atol(argv[4]) : 8;
  const int repeats = argc > 5 ? std::atoi(argv[5]) : 5;
  const std::string pass = argc > 6 ? argv[6] : "both";
  const bool bhsd = argc > 7 && std::string(argv[7]) == "bhsd";
  const std::string target = argc > 8 ? argv[8] : "best";
  const bool bf16 = argc > 9 && std::string(argv[9]) == "bfloat16";
  if (target != "best") {
    int64_t chosen = 0;
    for (int64_t rest = hwy::SupportedTargets(); rest != 0; rest &= rest - 1)
      if (target == hwy::TargetName(rest & -rest)) chosen = rest & -rest;
    if (chosen == 0) {
      std::fprintf(stderr, "target %s is not supported here\n", target.c_str());
      return 2;
    }
    hwy::SetSupportedTargetsForTest(chosen);  // the kernels and the FMA probe alike
  }

  qkv::Tensor<float, 4> q({1, n, heads, d}), k({1, n, heads, d}), v({1, n, heads, d}),
      out({1, n, heads, d}), dout({1, n, heads, d}), dq({1, n, heads, d}), dk({1, n, heads, d}),
      dv({1, n, heads, d});
  qkv::Tensor<float, 3> lse({1, heads, n});
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto* t : {&q, &k, &v, &dout})
    for (size_t i = 0; i < t->size(); ++i) t->data()[i] = normal(rng);

  qkv::AttentionOptions options;
  options.causal = causal ? qkv::Causal::top_left : qkv::Causal::none;
  options.execution.threads = 1;
  options.execution.backend = qkv::Backend::cpu;
  const double flops = 4.0 * static_cast<double>(heads * n * n * d) * (causal ? 0.5 : 1.0);

  auto best_of = [&](auto&& call) {
    call();
    double best = 1e30;
    for (int r = 0; r < repeats; ++r) {
      const double t0 = thread_seconds();
      call();
      best = std::min(best, thread_seconds() - t0);
    }
    return best;
  };
  const qkv::bench::FmaPeak fma = qkv::bench::measure_fma_peak_cpu_time(100'000'000, 3);
  const double peak = fma.gflops;
  const double bf16_peak = qkv::bench::measure_dot_peak_cpu_time(qkv::bench::DotUnit::bf16, 100'000'000, 3);
  const double amx_peak = bf16 ? qkv::bench::measure_dot_peak_cpu_time(qkv::bench::DotUnit::amx_bf16, 100'000'000, 3) : 0.0;
  std::printf("N=%lld d=%lld heads=%lld %s %s, 1 thread, fastest of %d by thread CPU time; "
              "FMA peak %.1f GFLOP/s (%s)\n",
              static_cast<long long>(n), static_cast<long long>(d),
              static_cast<long long>(heads), causal ? "causal" : "dense", bhsd ? "bhsd" : "bshd", repeats, peak, fma.target.c_str());
  if (bf16) std::printf("  bfloat16 storage; bf16 dot peak %.1f GFLOP/s; AMX bf16 peak %.1f GFLOP/s\n", bf16_peak, amx_peak);
  // The same buffers seen in either layout (the values are random either way).
  auto in = [&](const qkv::Tensor<float, 4>& t) {
    return bhsd ? qkv::View4<const float>::from_bhsd(t.data(), 1, heads, n, d) : t.cview();
  };
  auto io = [&](qkv::Tensor<float, 4>& t) {
    return bhsd ? qkv::View4<float>::from_bhsd(t.data(), 1, heads, n, d) : t.view();
  };
  std::vector<qkv::Tensor<qkv::bfloat16, 4>> half;  // q, k, v, out, dout, dq, dk, dv
  if (bf16) {
    for (auto* t : {&q, &k, &v, &out, &dout, &dq, &dk, &dv}) {
      half.emplace_back(t->shape());
      for (size_t i = 0; i < t->size(); ++i) half.back().data()[i] = qkv::bfloat16(t->data()[i]);
    }
  }
  auto in16 = [&](size_t i) {
    return bhsd ? qkv::View4<const qkv::bfloat16>::from_bhsd(half[i].data(), 1, heads, n, d) : half[i].cview();
  };
  auto io16 = [&](size_t i) {
    return bhsd ? qkv::View4<qkv::bfloat16>::from_bhsd(half[i].data(), 1, heads, n, d) : half[i].view();
  };
  auto forward = [&] {
    if (bf16) {
      qkv::attention_forward(qkv::ForwardArgs<qkv::bfloat16>{in16(0), in16(1), in16(2), io16(3), lse.view()},
                             options);
      return;
    }
    qkv::attention_forward(qkv::ForwardArgs<float>{in(q), in(k), in(v), io(out), lse.view()},
                           options);
  };
  if (pass != "bwd") {
    const double t = best_of(forward);
    std::printf("  fwd  %8.2f ms  %6.1f GFLOP/s  %4.0f%% of peak", 1e3 * t, flops / t / 1e9,
                100 * flops / t / 1e9 / peak);
    if (bf16 && bf16_peak > 0) std::printf("  %4.0f%% of the bf16 dot peak", 100 * flops / t / 1e9 / bf16_peak);
    if (bf16 && amx_peak > 0) std::printf("  %4.1f%% of the AMX peak", 100 * flops / t / 1e9 / amx_peak);
    std::printf("\n");
  } else {
    forward();
  }
  if (pass != "fwd") {
    const double t = best_of([&] {
      if (bf16) {
        qkv::attention_backward(qkv::BackwardArgs<qkv::bfloat16>{in16(0), in16(1), in16(2), in16(3), lse.cview(),
                                                                 in16(4), io16(5), io16(6), io16(7)},
                                options);
        return;
      }
      qkv::attention_backward(
          qkv::BackwardArgs<float>{in(q), in(k), in(v), in(out), lse.cview(), in(dout),
                                   io(dq), io(dk), io(dv)},
          options);
    });
    std::printf("  bwd  %8.2f ms  %6.1f GFLOP/s  %4.0f%% of peak\n", 1e3 * t,
                2.5 * flops / t / 1e9, 100 * 2.5 * flops / t / 1e9 / peak);
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "qkv_dense_probe: %s\n", error.what());
  return 1;
}
