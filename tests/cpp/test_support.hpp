// Shared helpers for the C++ tests: seeded random tensors, error measures, sentinels.
#pragma once

#include <gtest/gtest.h>
#include <qkv/qkv.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <random>
#include <vector>

namespace qkv::test {

template <class T, int R>
Tensor<T, R> random_tensor(const std::array<int64_t, R>& shape, std::uint64_t seed,
                           double stddev = 1.0) {
  Tensor<T, R> t(shape);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, stddev);
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<T>(normal(rng));
  return t;
}

template <class T, int R>
void fill(Tensor<T, R>& t, T value) {
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = value;
}

template <class A, class B, int R>
double max_abs_diff(const Tensor<A, R>& a, const Tensor<B, R>& b) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (std::isnan(d)) return INFINITY;
    worst = std::max(worst, d);
  }
  return worst;
}

template <class T, int R>
bool all_finite(const Tensor<T, R>& t) {
  for (std::size_t i = 0; i < t.size(); ++i)
    if (!std::isfinite(t[i])) return false;
  return true;
}

// Copy of a [B, S, H, D] tensor into PyTorch's [B, H, S, D] memory order.
template <class T>
Tensor<T, 4> to_bhsd(const Tensor<T, 4>& bshd) {
  const auto& s = bshd.shape();
  Tensor<T, 4> out({s[0], s[2], s[1], s[3]});
  for (int64_t b = 0; b < s[0]; ++b)
    for (int64_t i = 0; i < s[1]; ++i)
      for (int64_t h = 0; h < s[2]; ++h)
        for (int64_t c = 0; c < s[3]; ++c) out(b, h, i, c) = bshd(b, i, h, c);
  return out;
}

template <class T>
View4<T> bhsd_view(Tensor<T, 4>& bhsd) {
  const auto& s = bhsd.shape();
  return View4<T>::from_bhsd(bhsd.data(), s[0], s[1], s[2], s[3]);
}

// Options with the reference backend selected explicitly.
inline AttentionOptions reference_options() {
  AttentionOptions options;
  options.execution.backend = Backend::reference;
  return options;
}

// call() must throw qkv::Error whose message contains `needle`.
inline void expect_error(const std::function<void()>& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "no qkv::Error; expected one mentioning " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace qkv::test
