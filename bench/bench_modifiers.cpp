// Cost of the programmable modifiers (qkv/modifiers.hpp) against the built-in variants
// they restate, on the cpu backend, forward and backward, in one process:
//   soft-cap     options.softcap = c        vs  score_mod c·tanh(s/c) (+ derivative)
//   ALiBi        options.alibi_slopes       vs  score_mod s − slope·|i + Nk − Nq − j|
//   causal       options.causal = top_left  vs  mask_mod j ≤ i
//   documents    options.mask.keep [N, N]   vs  mask_mod doc[i] == doc[j]   (4 documents)
// and a plain call for scale. Median of `repeats` timed calls after one warm-up call,
// the three variants of a row called in turn.
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

double elapsed_ms(const std::function<void()>& call) {
  const auto start = Clock::now();
  call();
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

double median(std::vector<double> times) {
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

  qkv::Tensor<float, 4> q({1, n, heads, dim}), k(q.shape()), values(q.shape()),
      dout(q.shape()), dq(q.shape()), dk(q.shape()), dv(q.shape());
  qkv::Tensor<float, 3> lse({1, heads, n});
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto* t : {&q, &k, &values, &dout})
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

  using Set = std::function<void(qkv::AttentionOptions&)>;
  struct Pair {
    const char* name;
    Set builtin, programmable;
  };
  const std::vector<Pair> pairs{
      {"soft-cap c·tanh(s/c)", [&](qkv::AttentionOptions& o) { o.softcap = cap; },
       [&](qkv::AttentionOptions& o) { o.modifiers.score = softcap; }},
      {"ALiBi", [&](qkv::AttentionOptions& o) { o.alibi_slopes = slopes; },
       [&](qkv::AttentionOptions& o) { o.modifiers.score = alibi; }},
      {"causal", [&](qkv::AttentionOptions& o) { o.causal = qkv::Causal::top_left; },
       [&](qkv::AttentionOptions& o) { o.modifiers.mask = causal; }},
      {"4 documents", [&](qkv::AttentionOptions& o) { o.mask.keep = keep.cview(); },
       [&](qkv::AttentionOptions& o) { o.modifiers.mask = documents; }},
  };

  // One call pair at a time, alternating built-in and modifier (and plain, for scale), so
  // that the other load on the machine hits all three alike.
  struct Variant {
    qkv::AttentionOptions options;
    qkv::Tensor<float, 4> out;
    qkv::Tensor<float, 3> lse;
    std::vector<double> forward, backward;
  };
  auto make = [&](const Set& set) {
    Variant v{{}, qkv::Tensor<float, 4>(q.shape()), qkv::Tensor<float, 3>(lse.shape()), {}, {}};
    v.options.execution.backend = qkv::Backend::cpu;
    v.options.execution.threads = threads;
    set(v.options);
    return v;
  };
  auto forward = [&](Variant& v) {
    qkv::attention_forward({.q = q.cview(), .k = k.cview(), .v = values.cview(), .out = v.out.view(),
                            .lse = v.lse.view()}, v.options);
  };
  auto backward = [&](Variant& v) {
    qkv::attention_backward({.q = q.cview(), .k = k.cview(), .v = values.cview(), .out = v.out.cview(),
                             .lse = v.lse.cview(), .dout = dout.cview(), .dq = dq.view(),
                             .dk = dk.view(), .dv = dv.view()}, v.options);
  };

  std::printf("# qkv modifiers bench: N=%lld heads=%lld d=%lld threads=%d, SIMD target %s, "
              "median of %d alternating calls\n",
              static_cast<long long>(n), static_cast<long long>(heads), static_cast<long long>(dim),
              threads, qkv::cpu::simd_target_name(), repeats);
  std::printf("| variant | plain fwd / bwd ms | built-in fwd / bwd ms | modifier fwd / bwd ms | "
              "modifier / built-in fwd | bwd |\n|---|---|---|---|---|---|\n");
  for (const Pair& pair : pairs) {
    std::vector<Variant> variants;
    variants.push_back(make([](qkv::AttentionOptions&) {}));
    variants.push_back(make(pair.builtin));
    variants.push_back(make(pair.programmable));
    for (Variant& v : variants) forward(v), backward(v);  // warm-up
    for (int r = 0; r < repeats; ++r)
      for (Variant& v : variants) {
        v.forward.push_back(elapsed_ms([&] { forward(v); }));
        v.backward.push_back(elapsed_ms([&] { backward(v); }));
      }
    const double f0 = median(variants[0].forward), b0 = median(variants[0].backward);
    const double f1 = median(variants[1].forward), b1 = median(variants[1].backward);
    const double f2 = median(variants[2].forward), b2 = median(variants[2].backward);
    std::printf("| %s | %.1f / %.1f | %.1f / %.1f | %.1f / %.1f | %.2f× | %.2f× |\n", pair.name, f0,
                b0, f1, b1, f2, b2, f2 / f1, b2 / b1);
  }
  return 0;
}
