// A small, portable, seedable random number generator and the initializers built on it.
//
// xoshiro256** (Blackman & Vigna, 2018) seeded through splitmix64: the same seed gives
// the same stream on every platform and compiler (unlike std::normal_distribution,
// whose algorithm the standard leaves open), and its whole state is four words, so a
// checkpoint can store it and a resumed run continues the very same stream.
#pragma once

#include <array>
#include <cstdint>
#include <span>

namespace qkv::nn {

class Rng {
 public:
  using State = std::array<uint64_t, 4>;

  explicit Rng(uint64_t seed = 0);

  uint64_t next_u64();
  // Uniform in [0, 1) with 53 random bits.
  double uniform();
  // Uniform integer in [0, n), n ≥ 1, without modulo bias.
  uint64_t below(uint64_t n);
  // Standard normal (Box–Muller, one value per call so the state alone is the stream).
  double normal();

  const State& state() const { return state_; }
  // Restores a state from `state()`; an all-zero state is invalid and throws qkv::Error.
  void set_state(const State& state);

 private:
  State state_{};
};

// Fill with U(lo, hi) or N(mean, stddev²), drawing from `rng` in index order.
void fill_uniform(std::span<float> values, double lo, double hi, Rng& rng);
void fill_uniform(std::span<double> values, double lo, double hi, Rng& rng);
void fill_normal(std::span<float> values, double mean, double stddev, Rng& rng);
void fill_normal(std::span<double> values, double mean, double stddev, Rng& rng);

}  // namespace qkv::nn
