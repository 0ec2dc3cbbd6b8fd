// Cost of the programmable modifiers (qkv/modifiers.hpp) against the built-in variants
// they restate, on the cpu backend, forward and backward, in one process:
//   soft-cap     options.softcap = c        vs  score_mod c·tanh(s/c) (+ derivative)
//   ALiBi        options.alibi_slopes       vs  score_mod s − slope·|i + Nk − Nq − j|
//   causal       options.causal = top_left  vs  mask_mod j ≤ i
//   documents    options.mask.keep [N, N]   vs  mask_mod doc[i] == doc[j]   (4 documents)
// and a plain call for scale. Median of `repeats` timed calls after one warm-up call.
// The modifiers' tile loops are compiled here, with this file's flags: build it once
// with the default flags (qkv_bench_modifiers) and once with -march=native
// (qkv_bench_modifiers_native) to see what the compiler's vectorization buys.
//
//   qkv_bench_modifiers [N=1024] [heads=8] [head_dim=64] [threads=0] [repeats=7]
#include <qkv/qkv.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "cpu/cpu_backend.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double median_ms(const std::function<void()>& call, int repeats) {
  call();  // warm-up: page in the outputs, start the thread pool
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto start = Clock::now();
    call();
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 1024;
  const int64_t heads = argc > 2 ? std::atoll(argv[2]) : 8;
  const int64_t dim = argc > 3 ? std::atoll(argv[3]) : 64;
  const int threads = argc > 4 ? std::atoi(argv[4]) : 0;
  const int repeats = argc > 5 ? std::atoi(argv[5]) : 7;

  qkv::Tensor<float, 4> q({1, n, heads, dim}), k(q.shape()), v(q.shape()), out(q.shape()),
      dout(q.shape()), dq(q.shape()), dk(q.shape()), dv(q.shape());
  qkv::Tensor<float, 3> lse({1, heads, n});
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto* t : {&q, &k, &v, &dout})
    for (std::size_t i = 0; i < t->size(); ++i) (*t)[i] = normal(rng);

  const float cap = 5.0f;  // logits of unit-variance q, k reach ±4: the cap acts
  std::vector<float> slopes;
  for (int64_t h = 0; h < heads; ++h)
    slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(heads)));
  const float* slope = slopes.data();
  std::vector<int32_t> document(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) document[static_cast<std::size_t>(i)] = static_cast<int32_t>(4 * i / n);
  const int32_t* doc = document.data();
  qkv::Tensor<std::uint8_t, 4> keep({1, 1, n, n});
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) keep(0, 0, i, j) = doc[i] == doc[j] ? 1 : 0;

  const auto softcap = qkv::score_mod(
      [cap](float s, int64_t, int64_t, int64_t, int64_t) { return cap * std::tanh(s / cap); },
      [cap](float s, int64_t, int64_t, int64_t, int64_t) {
        const float t = std::tanh(s / cap);
        return 1.0f - t * t;
      });
  const auto alibi = qkv::score_mod(
      [slope](float s, int64_t, int64_t h, int64_t i, int64_t j) {
        return s - slope[h] * static_cast<float>(i > j ? i - j : j - i);
      },
      [](float, int64_t, int64_t, int64_t, int64_t) { return 1.0f; });
  const auto causal = qkv::mask_mod([](int64_t, int64_t, int64_t i, int64_t j) { return j <= i; },
                                    {.varies_with_head = false});
  const auto documents = qkv::mask_mod(
      [doc](int64_t, int64_t, int64_t i, int64_t j) { return doc[i] == doc[j]; },
      {.varies_with_head = false});

  struct Row {
    const char* name;
    std::function<void(qkv::AttentionOptions&)> set;
  };
  const std::vector<Row> rows{
      {"plain", [](qkv::AttentionOptions&) {}},
      {"softcap built-in", [&](qkv::AttentionOptions& o) { o.softcap = cap; }},
      {"softcap score_mod", [&](qkv::AttentionOptions& o) { o.modifiers.score = softcap; }},
      {"alibi built-in", [&](qkv::AttentionOptions& o) { o.alibi_slopes = slopes; }},
      {"alibi score_mod", [&](qkv::AttentionOptions& o) { o.modifiers.score = alibi; }},
      {"causal built-in", [&](qkv::AttentionOptions& o) { o.causal = qkv::Causal::top_left; }},
      {"causal mask_mod", [&](qkv::AttentionOptions& o) { o.modifiers.mask = causal; }},
      {"documents mask.keep", [&](qkv::AttentionOptions& o) { o.mask.keep = keep.cview(); }},
      {"documents mask_mod", [&](qkv::AttentionOptions& o) { o.modifiers.mask = documents; }},
  };

  std::printf("# qkv modifiers bench: N=%lld heads=%lld d=%lld threads=%d, SIMD target %s, "
              "median of %d\n",
              static_cast<long long>(n), static_cast<long long>(heads), static_cast<long long>(dim),
              threads, qkv::cpu::simd_target_name(), repeats);
  std::printf("| variant | forward ms | backward ms |\n|---|---|---|\n");
  for (const Row& row : rows) {
    qkv::AttentionOptions options;
    options.execution.backend = qkv::Backend::cpu;
    options.execution.threads = threads;
    row.set(options);
    const double forward = median_ms(
        [&] {
          qkv::attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                                  .lse = lse.view()}, options);
        },
        repeats);
    const double backward = median_ms(
        [&] {
          qkv::attention_backward({.q = q.cview(), .k = k.cview(), .v = v.cview(),
                                   .out = out.cview(), .lse = lse.cview(), .dout = dout.cview(),
                                   .dq = dq.view(), .dk = dk.view(), .dv = dv.view()},
                                  options);
        },
        repeats);
    std::printf("| %s | %.2f | %.2f |\n", row.name, forward, backward);
  }
  return 0;
}
