// Shared helpers of the quantized KV-cache tests (test_kv_cache_channel.cpp,
// test_kv_cache_int4.cpp): keys with outlier channels, appends of token ranges, attend
// with a chosen backend and thread count, bitwise comparison of results.
#pragma once

#include <gtest/gtest.h>
#include <qkv/kv_cache.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "test_support.hpp"

namespace qkv::test {

// N(0, 1) keys [batch, tokens, heads, d] whose channels 1 and 5 are 20× larger: the
// outlier channels post-RoPE keys have, which one scale per row handles worst.
inline Tensor<float, 4> outlier_keys(int64_t batch, int64_t tokens, int64_t heads, int64_t d, std::uint64_t seed) {
  auto k = random_tensor<float, 4>({batch, tokens, heads, d}, seed);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c : {1, 5}) k(b, t, h, c % d) *= 20.0f;
  return k;
}

// Appends tokens [from, to) of k [B, T, Hkv, d] and v [B, T, Hkv, dv] to every sequence.
inline void append_range(KVCache& cache, const Tensor<float, 4>& k, const Tensor<float, 4>& v, int64_t from,
                         int64_t to) {
  const int64_t batch = k.shape()[0], heads = k.shape()[2], d = k.shape()[3], dv = v.shape()[3];
  Tensor<float, 4> ks({batch, to - from, heads, d}), vs({batch, to - from, heads, dv});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = from; t < to; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t c = 0; c < d; ++c) ks(b, t - from, h, c) = k(b, t, h, c);
        for (int64_t c = 0; c < dv; ++c) vs(b, t - from, h, c) = v(b, t, h, c);
      }
  cache.append(ks.cview(), vs.cview());
}

// Appends tokens [from, to) of sequence b of k and v to that sequence alone.
inline void append_sequence(KVCache& cache, const Tensor<float, 4>& k, const Tensor<float, 4>& v, int64_t b,
                            int64_t from, int64_t to) {
  const int64_t heads = k.shape()[2], d = k.shape()[3], dv = v.shape()[3];
  Tensor<float, 4> ks({1, to - from, heads, d}), vs({1, to - from, heads, dv});
  for (int64_t t = from; t < to; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t c = 0; c < d; ++c) ks(0, t - from, h, c) = k(b, t, h, c);
      for (int64_t c = 0; c < dv; ++c) vs(0, t - from, h, c) = v(b, t, h, c);
    }
  const std::vector<int64_t> seq{b};
  cache.append(ks.cview(), vs.cview(), seq);
}

struct AttendResult {
  Tensor<float, 4> out;
  Tensor<float, 3> lse;
};

// cache.attend(q), bottom-right, on `backend` with `threads` threads.
inline AttendResult attend(const KVCache& cache, const Tensor<float, 4>& q, Backend backend, int threads) {
  const auto& s = q.shape();
  AttendResult r{Tensor<float, 4>({s[0], s[1], s[2], cache.config().v_dim}), Tensor<float, 3>({s[0], s[2], s[1]})};
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  options.execution.backend = backend;
  options.execution.threads = threads;
  cache.attend(q.cview(), r.out.view(), r.lse.view(), options);
  return r;
}

// ‖a − b‖₂ over every element, in double.
inline double l2_distance(const Tensor<float, 4>& a, const Tensor<float, 4>& b) {
  double sum = 0.0;
  for (std::size_t x = 0; x < a.size(); ++x) sum += (double(a[x]) - b[x]) * (double(a[x]) - b[x]);
  return std::sqrt(sum);
}

inline bool same_bits(const AttendResult& a, const AttendResult& b) {
  return std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float)) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

// cache.attend(q) on the cpu backend: the same bits on 1 and 2 threads, and within `bound`
// of the fp64 reference over the same stored values.
inline void expect_kernel_matches_reference(const KVCache& cache, const Tensor<float, 4>& q, double bound) {
  const AttendResult cpu1 = attend(cache, q, Backend::cpu, 1), cpu2 = attend(cache, q, Backend::cpu, 2);
  const AttendResult ref = attend(cache, q, Backend::reference, 1);
  EXPECT_TRUE(same_bits(cpu1, cpu2)) << "threads change the bits, q_len " << q.shape()[1];
  double worst = 0.0;
  for (std::size_t x = 0; x < ref.out.size(); ++x) worst = std::max(worst, double(std::abs(cpu1.out[x] - ref.out[x])));
  EXPECT_LE(worst, bound) << "q_len " << q.shape()[1];
}

}  // namespace qkv::test
