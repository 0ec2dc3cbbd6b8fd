// xoshiro256** and splitmix64 (Blackman & Vigna), Box–Muller normals.
#include "qkv/nn/random.hpp"

#include <cmath>
#include <numbers>

#include "check.hpp"

namespace qkv::nn {
namespace {

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

}  // namespace

Rng::Rng(uint64_t seed) {
  uint64_t x = seed;
  for (uint64_t& word : state_) word = splitmix64(x);
}

uint64_t Rng::next_u64() {
  const uint64_t result = rotl(state_[1] * 5, 7) * 9;
  const uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotl(state_[3], 45);
  return result;
}

double Rng::uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

uint64_t Rng::below(uint64_t n) {
  detail::expect(n >= 1, "Rng::below", "n: expected ≥ 1, got 0");
  // Reject the top partial copy of [0, n) so every residue is equally likely.
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x = next_u64();
  while (x >= limit) x = next_u64();
  return x % n;
}

double Rng::normal() {
  // 1 − u ∈ (0, 1]: the log is finite.
  const double u1 = 1.0 - uniform();
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

void Rng::set_state(const State& state) {
  detail::expect(state[0] != 0 || state[1] != 0 || state[2] != 0 || state[3] != 0,
                 "Rng::set_state", "state: all zero (not a state of xoshiro256**)");
  state_ = state;
}

namespace {

template <class T>
void uniform_impl(std::span<T> values, double lo, double hi, Rng& rng) {
  for (T& value : values) value = static_cast<T>(lo + (hi - lo) * rng.uniform());
}

template <class T>
void normal_impl(std::span<T> values, double mean, double stddev, Rng& rng) {
  for (T& value : values) value = static_cast<T>(mean + stddev * rng.normal());
}

}  // namespace

void fill_uniform(std::span<float> values, double lo, double hi, Rng& rng) {
  uniform_impl(values, lo, hi, rng);
}
void fill_uniform(std::span<double> values, double lo, double hi, Rng& rng) {
  uniform_impl(values, lo, hi, rng);
}
void fill_normal(std::span<float> values, double mean, double stddev, Rng& rng) {
  normal_impl(values, mean, stddev, rng);
}
void fill_normal(std::span<double> values, double mean, double stddev, Rng& rng) {
  normal_impl(values, mean, stddev, rng);
}

}  // namespace qkv::nn
