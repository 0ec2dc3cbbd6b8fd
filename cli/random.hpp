// A small, fully specified random number generator, so that `qkv explain --seed S` and
// `qkv bench` produce the same numbers with every compiler and standard library
// (std::normal_distribution is implementation-defined).
//
//   xoshiro256** (Blackman & Vigna) seeded through splitmix64;
//   uniform doubles from the top 53 bits;
//   normals by the ziggurat method (exact N(0, 1); see normal()).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace qkv::cli {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) {
    for (std::uint64_t& word : state_) word = splitmix64(seed);
  }

  std::uint64_t next() {
    const std::uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const std::uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

  // Standard normal N(0, 1), by the ziggurat method (Marsaglia & Tsang, 2000) with 128
  // layers; the layer index, the sign and the 53-bit abscissa come from disjoint bits of
  // one 64-bit draw (so they are independent, unlike the original 32-bit version).
  // About 99 % of draws cost one generator step and one multiply.
  double normal() {
    const std::uint64_t r = next();
    const unsigned layer = static_cast<unsigned>(r & 127);
    const double x = static_cast<double>(r >> 11) * 0x1.0p-53 * kTable.x[layer];
    if (x < kTable.x[layer + 1]) [[likely]] {  // inside the rectangle under the curve
      return ((r >> 7) & 1) != 0 ? -x : x;
    }
    return normal_edge(r);
  }

  // out[0..n) = n standard normals, the same values n calls of normal() give. The
  // generator works on a local copy so its state stays in registers.
  void fill_normal(float* out, std::size_t n) {
    Rng local = *this;
    for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(local.normal());
    *this = local;
  }

 private:
  // The rare rest of normal(): the tail, the wedges, and redraws. Kept out of line so the
  // fast path keeps the generator state in registers.
  [[gnu::noinline]] double normal_edge(std::uint64_t r) {
    while (true) {
      const unsigned layer = static_cast<unsigned>(r & 127);
      const bool negative = ((r >> 7) & 1) != 0;
      const double x = static_cast<double>(r >> 11) * 0x1.0p-53 * kTable.x[layer];
      if (x < kTable.x[layer + 1]) return negative ? -x : x;
      if (layer == 0) {  // the tail beyond R, by Marsaglia's exponential method
        double a = 0.0, b = 0.0;
        do {
          a = -std::log(1.0 - uniform()) / Ziggurat::kR;
          b = -std::log(1.0 - uniform());
        } while (b + b < a * a);
        return negative ? -(Ziggurat::kR + a) : Ziggurat::kR + a;
      }
      // The wedge between the curve and the layer's rectangle.
      const double y = kTable.f[layer] + uniform() * (kTable.f[layer + 1] - kTable.f[layer]);
      if (y < std::exp(-0.5 * x * x)) return negative ? -x : x;
      r = next();
    }
  }

  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  static std::uint64_t splitmix64(std::uint64_t& x) {
    std::uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  // Layer i covers [0, x[i]] × [f(x[i]), f(x[i+1])] of f(x) = exp(−x²/2); every layer
  // has area kV (the base layer's rectangle [0, x[0]] × [0, f(R)] together with the tail).
  struct Ziggurat {
    static constexpr int kLayers = 128;
    static constexpr double kR = 3.442619855899;          // x[1], where the tail starts
    static constexpr double kV = 9.91256303526217e-3;     // area of each layer
    double x[kLayers + 1];
    double f[kLayers + 1];
    Ziggurat() {
      const double f_r = std::exp(-0.5 * kR * kR);
      x[0] = kV / f_r;
      x[1] = kR;
      for (int i = 1; i < kLayers - 1; ++i) {
        x[i + 1] = std::sqrt(-2.0 * std::log(std::exp(-0.5 * x[i] * x[i]) + kV / x[i]));
      }
      x[kLayers] = 0.0;
      for (int i = 0; i <= kLayers; ++i) f[i] = std::exp(-0.5 * x[i] * x[i]);
      f[0] = 0.0;  // the base layer reaches down to y = 0 (its wedge test is never used)
    }
  };
  static inline const Ziggurat kTable{};

  std::uint64_t state_[4]{};
};

}  // namespace qkv::cli
