// Standard normals for `qkv explain` and `qkv bench`, drawn from qkv::nn::Rng (xoshiro256**
// seeded through splitmix64), so that a seed gives the same numbers with every compiler
// and standard library (std::normal_distribution is implementation-defined).
//
// The normals come by the ziggurat method, not through nn::Rng::normal() (Box–Muller):
// the CLI's inputs, and so its outputs for a given seed, have been drawn this way from
// the start.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "qkv/nn/random.hpp"

namespace qkv::cli {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : bits_(seed) {}

  // Uniform in [0, 1).
  double uniform() { return bits_.uniform(); }

  // Standard normal N(0, 1), by the ziggurat method (Marsaglia & Tsang, 2000) with 128
  // layers; the layer index, the sign and the 53-bit abscissa come from disjoint bits of
  // one 64-bit draw (so they are independent, unlike the original 32-bit version).
  // About 99 % of draws cost one generator step and one multiply.
  double normal() {
    const std::uint64_t r = bits_.next_u64();
    const unsigned layer = static_cast<unsigned>(r & 127);
    const double x = static_cast<double>(r >> 11) * 0x1.0p-53 * kTable.x[layer];
    if (x < kTable.x[layer + 1]) [[likely]] {  // inside the rectangle under the curve
      return ((r >> 7) & 1) != 0 ? -x : x;
    }
    return normal_edge(r);
  }

  // out[0..n) = n standard normals, the same values n calls of normal() give.
  void fill_normal(float* out, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(normal());
  }

 private:
  // The rare rest of normal(): the tail, the wedges, and redraws.
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
      r = bits_.next_u64();
    }
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

  nn::Rng bits_;
};

}  // namespace qkv::cli
