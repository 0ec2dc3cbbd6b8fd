// The fixed cost of one small qkv::attention_forward call (issue 11, part 3), in C++:
// q [1, 12, 1, 64] against 64 keys, float32 — one decoding step of one layer of a small
// model, routed to the decode kernel. Each call is timed on its own (steady_clock), warm,
// the thread settings interleaved in blocks; printed: median and 10th/90th percentile µs.
//
//   qkv_small_call [calls]        (default 20000 per setting)
//
// threads=0 is what the Python package passes by default (every hardware thread).
#include <qkv/qkv.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  using namespace qkv;
  using Clock = std::chrono::steady_clock;
  const int calls = argc > 1 ? std::atoi(argv[1]) : 20000;
  const int64_t heads = 12, d = 64, keys = 64;
  Tensor<float, 4> q({1, 1, heads, d}), k({1, keys, heads, d}), v({1, keys, heads, d});
  Tensor<float, 4> out({1, 1, heads, d});
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = v[i] = static_cast<float>(i % 7) * 0.1f;
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = 0.01f * static_cast<float>(i % 5);

  const int settings[] = {0, 1, 2};
  std::vector<std::vector<double>> times(std::size(settings));
  auto call = [&](int threads) {
    AttentionOptions options;
    options.execution.threads = threads;
    attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view()}, options);
  };
  for (int threads : settings)
    for (int i = 0; i < 2000; ++i) call(threads);  // warm
  constexpr int kBlock = 200;
  for (int done = 0; done < calls; done += kBlock)
    for (std::size_t s = 0; s < std::size(settings); ++s)
      for (int i = 0; i < kBlock; ++i) {
        const auto start = Clock::now();
        call(settings[s]);
        times[s].push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
      }
  for (std::size_t s = 0; s < std::size(settings); ++s) {
    std::vector<double>& t = times[s];
    std::sort(t.begin(), t.end());
    auto at = [&](double p) { return t[std::min(t.size() - 1, static_cast<std::size_t>(p * static_cast<double>(t.size())))]; };
    std::printf("C++ attention_forward threads=%d: median %.2f us, p10 %.2f, p90 %.2f (%zu calls)\n",
                settings[s], at(0.5), at(0.1), at(0.9), t.size());
  }
  return 0;
}
