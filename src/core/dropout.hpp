// The keep decision of attention dropout: a counter-based hash of (seed, offset, entry,
// head, query, key), so any pass (forward, backward, reference, any thread) regenerates
// the same mask without storing it. Scalar here; the cpu kernels compute the very same
// bits with SIMD (block_ops-inl.h, DropoutTile), from the per-query row keys below.
//
//   row key   r = fmix32(fmix64(seed, offset, entry, head) + query·0x9E3779B1)
//   element   x = fmix32(r ^ (key·0x85EBCA77 + 0x165667B1))
//   kept  ⇔   x ≥ threshold = ⌊p·2³²⌋
//
// fmix32/fmix64 are MurmurHash3's finalizers: bijections with full avalanche, so each
// x is uniform on 32 bits and distinct keys (and queries) give unrelated bits.
#pragma once

#include <cmath>
#include <cstdint>

namespace qkv::detail {

inline constexpr std::uint32_t kDropoutQueryStep = 0x9E3779B1u;
inline constexpr std::uint32_t kDropoutKeyStep = 0x85EBCA77u;
inline constexpr std::uint32_t kDropoutKeyBias = 0x165667B1u;

inline std::uint32_t fmix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

inline std::uint64_t fmix64(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  x ^= x >> 33;
  return x;
}

// The hash key of one (entry, head).
inline std::uint32_t dropout_head_key(std::uint64_t seed, std::uint64_t offset, int64_t entry,
                                      int64_t head) {
  std::uint64_t x = fmix64(seed ^ 0x9E3779B97F4A7C15ull);
  x = fmix64(x ^ offset);
  x = fmix64(x ^ (static_cast<std::uint64_t>(entry) << 20) ^ static_cast<std::uint64_t>(head));
  return static_cast<std::uint32_t>(x ^ (x >> 32));
}

inline std::uint32_t dropout_row_key(std::uint32_t head_key, int64_t query) {
  return fmix32(head_key + static_cast<std::uint32_t>(query) * kDropoutQueryStep);
}

inline std::uint32_t dropout_bits(std::uint32_t row_key, int64_t key) {
  return fmix32(row_key ^ (static_cast<std::uint32_t>(key) * kDropoutKeyStep + kDropoutKeyBias));
}

// Weights whose bits fall below this are dropped: P(drop) = threshold / 2³² ≈ p.
inline std::uint32_t dropout_threshold(float p) {
  return static_cast<std::uint32_t>(std::ldexp(static_cast<double>(p), 32));
}

}  // namespace qkv::detail
