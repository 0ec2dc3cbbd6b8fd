// GELU, exact (erf) form: double through libm, float through the vectorizable
// approximations of fast_math.hpp (erf to < 3e-7 absolute).
#include "qkv/nn/gelu.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "check.hpp"
#include "fast_math.hpp"
#include "parallel.hpp"

namespace qkv::nn {
namespace {

constexpr double kInvSqrt2 = 0.70710678118654752440;    // 1/√2
constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1/√(2π)

// The float loop, which the compiler vectorizes (gelu.cpp is built with
// -fno-trapping-math, see CMakeLists.txt): no libm call, no branch. With GCC on x86-64
// it is compiled for AVX-512, AVX2 + FMA and baseline x86-64, and the loader picks the
// one the CPU runs. y may alias x: each x[i] is read before y[i] is written.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void gelu_float(const float* x, float* y, float* slope, std::size_t n) {
  constexpr auto kInvSqrt2f = static_cast<float>(kInvSqrt2);
  constexpr auto kInvSqrt2Pif = static_cast<float>(kInvSqrt2Pi);
  if (slope != nullptr) {
    for (std::size_t i = 0; i < n; ++i) {
      const float v = x[i];
      const float cdf = 0.5f * (1.0f + detail::erf_approx(v * kInvSqrt2f));        // Φ(x)
      slope[i] = cdf + v * kInvSqrt2Pif * detail::exp_approx(-0.5f * v * v);  // Φ + x·φ
      y[i] = v * cdf;
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      const float v = x[i];
      y[i] = v * 0.5f * (1.0f + detail::erf_approx(v * kInvSqrt2f));
    }
  }
}

void gelu_double(const double* x, double* y, double* slope, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const double v = x[i];
    const double cdf = 0.5 * (1.0 + std::erf(v * kInvSqrt2));                  // Φ(x)
    if (slope != nullptr) slope[i] = cdf + v * kInvSqrt2Pi * std::exp(-0.5 * v * v);
    y[i] = v * cdf;
  }
}

// Whole activations in fixed chunks on the thread pool (element-wise: any split gives
// the same bits).
constexpr int64_t kChunk = 16384;

void gelu(const float* x, float* y, float* slope, std::size_t n) {
  detail::parallel_blocks(static_cast<int64_t>(n), kChunk, [&](int64_t begin, int64_t end) {
    gelu_float(x + begin, y + begin, slope == nullptr ? nullptr : slope + begin,
               static_cast<std::size_t>(end - begin));
  });
}
void gelu(const double* x, double* y, double* slope, std::size_t n) {
  detail::parallel_blocks(static_cast<int64_t>(n), kChunk, [&](int64_t begin, int64_t end) {
    gelu_double(x + begin, y + begin, slope == nullptr ? nullptr : slope + begin,
                static_cast<std::size_t>(end - begin));
  });
}

template <class T>
void forward_impl(std::span<const T> x, std::span<T> y, std::span<T> derivative) {
  detail::expect(x.size() == y.size(), "gelu_forward",
                 "y.size(): expected " + std::to_string(x.size()) + " (as x), got " +
                     std::to_string(y.size()));
  if (!derivative.empty()) {
    detail::expect(derivative.size() == x.size(), "gelu_forward",
                   "derivative.size(): expected " + std::to_string(x.size()) + " (as x), got " +
                       std::to_string(derivative.size()));
  }
  gelu(x.data(), y.data(), derivative.empty() ? nullptr : derivative.data(), x.size());
}

template <class T>
void backward_impl(std::span<const T> x, std::span<const T> dy, std::span<T> dx) {
  detail::expect(dy.size() == x.size(), "gelu_backward",
                 "dy.size(): expected " + std::to_string(x.size()) + " (as x), got " +
                     std::to_string(dy.size()));
  detail::expect(dx.size() == x.size(), "gelu_backward",
                 "dx.size(): expected " + std::to_string(x.size()) + " (as x), got " +
                     std::to_string(dx.size()));
  std::vector<T> value(x.size()), slope(x.size());
  gelu(x.data(), value.data(), slope.data(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i) dx[i] = slope[i] * dy[i];  // dx = gelu'(x) ⊙ dy
}

}  // namespace

void gelu_forward(std::span<const float> x, std::span<float> y, std::span<float> derivative) {
  forward_impl(x, y, derivative);
}
void gelu_forward(std::span<const double> x, std::span<double> y, std::span<double> derivative) {
  forward_impl(x, y, derivative);
}
void gelu_backward(std::span<const float> x, std::span<const float> dy, std::span<float> dx) {
  backward_impl(x, dy, dx);
}
void gelu_backward(std::span<const double> x, std::span<const double> dy,
                   std::span<double> dx) {
  backward_impl(x, dy, dx);
}

}  // namespace qkv::nn
