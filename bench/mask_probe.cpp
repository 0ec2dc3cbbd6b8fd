// Masked, padded and packed batches by wall clock, in C++ without PyTorch: the qkv side
// of bench_masks.py's rows (and plain dense calls at any thread count), so that two
// builds can be timed against each other (bench/before_after.py).
//
//   qkv_mask_probe KIND B H N d THREADS [REPEATS=5]
//     KIND  none, causal (top_left, no mask), bool_B11N, bool_B1NN, float_B1NN, causal+pad,
//           float_bias, key_lengths, key_lengths+causal: bench_masks.py's kinds, entry 0
//           full length and the others half padding (bench_inputs.hpp, PaddingMasks);
//           varlen: B sequences of lengths uniform in 16..N (seed 0), packed
//     inputs [B, H, N, d] buffers (PyTorch's layout, as the Python benchmarks pass them)
//   prints  fwd_ms=… fwd_min_ms=… bwd_ms=… bwd_min_ms=…: median and fastest of REPEATS
//           timed calls after one warm-up (the backward on the forward's out and lse)
//
// QKV_SIMD_TARGET picks the kernels' SIMD target as for every qkv program.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "bench_inputs.hpp"

namespace {

using namespace qkv_bench;  // NOLINT(google-build-using-namespace)

struct Timing {
  double median_ms, min_ms;
};

template <class F>
Timing time_calls(F&& call, int repeats) {
  call();  // warm-up: caches, page faults, the thread pool
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    call();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front()};
}

void report(const Timing& forward, const Timing& backward) {
  std::printf("fwd_ms=%.3f fwd_min_ms=%.3f bwd_ms=%.3f bwd_min_ms=%.3f\n", forward.median_ms, forward.min_ms,
              backward.median_ms, backward.min_ms);
}

void dense(const std::string& kind, std::int64_t b, std::int64_t h, std::int64_t n, std::int64_t d,
           qkv::AttentionOptions base, int repeats) {
  std::vector<std::int64_t> lengths{n};  // entry 0 full, the others half padding
  lengths.resize(static_cast<std::size_t>(std::max<std::int64_t>(b, 1)), n / 2);
  const PaddingMasks masks(b, n, lengths, 1);
  qkv::AttentionOptions options = masks.options(kind == "causal" ? "none" : kind);
  if (kind == "causal") options.causal = qkv::Causal::top_left;
  options.execution = base.execution;
  const std::array<std::int64_t, 4> shape{b, h, n, d};
  const auto q = random_tensor<float, 4>(shape, 2), k = random_tensor<float, 4>(shape, 3),
             v = random_tensor<float, 4>(shape, 4), dout = random_tensor<float, 4>(shape, 5);
  auto out = output_tensor<float, 4>(shape), dq = output_tensor<float, 4>(shape),
       dk = output_tensor<float, 4>(shape), dv = output_tensor<float, 4>(shape);
  auto lse = output_tensor<float, 3>({b, h, n});
  const auto in = [](const qkv::Tensor<float, 4>& t) { return logical_view<const float>(t.data(), t.shape(), true); };
  const auto io = [](qkv::Tensor<float, 4>& t) { return logical_view<float>(t.data(), t.shape(), true); };
  const Timing forward = time_calls(
      [&] {
        qkv::attention_forward({.q = in(q), .k = in(k), .v = in(v), .out = io(out), .lse = lse.view()}, options);
      },
      repeats);
  const Timing backward = time_calls(
      [&] {
        qkv::attention_backward({.q = in(q), .k = in(k), .v = in(v), .out = in(out), .lse = lse.cview(),
                                 .dout = in(dout), .dq = io(dq), .dk = io(dk), .dv = io(dv)},
                                options);
      },
      repeats);
  report(forward, backward);
}

void varlen(std::int64_t sequences, std::int64_t h, std::int64_t n, std::int64_t d,
            const qkv::AttentionOptions& options, int repeats) {
  Rng rng(0);
  std::vector<std::int32_t> cu{0};
  for (std::int64_t s = 0; s < sequences; ++s) cu.push_back(cu.back() + static_cast<std::int32_t>(16 + rng.below(n - 15)));
  const std::int64_t total = cu.back();
  const std::span<const std::int32_t> offsets(cu);
  const auto q = random_tensor<float, 3>({total, h, d}, 2), k = random_tensor<float, 3>({total, h, d}, 3),
             v = random_tensor<float, 3>({total, h, d}, 4), dout = random_tensor<float, 3>({total, h, d}, 5);
  auto out = output_tensor<float, 3>(q.shape()), dq = output_tensor<float, 3>(q.shape()),
       dk = output_tensor<float, 3>(q.shape()), dv = output_tensor<float, 3>(q.shape());
  auto lse = output_tensor<float, 2>({h, total});
  const Timing forward = time_calls(
      [&] {
        qkv::varlen_attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                                       .lse = lse.view(), .cu_seqlens_q = offsets, .cu_seqlens_k = offsets},
                                      options);
      },
      repeats);
  const Timing backward = time_calls(
      [&] {
        qkv::varlen_attention_backward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.cview(),
                                        .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(), .dk = dk.view(),
                                        .dv = dv.view(), .cu_seqlens_q = offsets, .cu_seqlens_k = offsets},
                                       options);
      },
      repeats);
  report(forward, backward);
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 7) {
    std::fprintf(stderr, "usage: qkv_mask_probe KIND B H N d THREADS [REPEATS=5]\n");
    return 2;
  }
  const std::string kind = argv[1];
  const std::int64_t b = std::atoll(argv[2]), h = std::atoll(argv[3]), n = std::atoll(argv[4]),
                     d = std::atoll(argv[5]);
  qkv::AttentionOptions options;
  options.execution.threads = std::atoi(argv[6]);
  options.execution.backend = qkv::Backend::cpu;
  const int repeats = argc > 7 ? std::max(1, std::atoi(argv[7])) : 5;
  if (kind == "varlen") {
    varlen(b, h, n, d, options, repeats);
  } else {
    dense(kind, b, h, n, d, options, repeats);
  }
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "qkv_mask_probe: %s\n", error.what());
  return 1;
}
