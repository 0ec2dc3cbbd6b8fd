// The public softmax math (qkv/softmax.hpp), written as the textbook states it.
#include "qkv/softmax.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "reference/softmax_row.hpp"

namespace qkv {
namespace {

void expect_size(const char* function, const char* argument, std::size_t expected,
                 std::size_t actual, const char* because) {
  if (expected != actual) {
    throw Error(std::string("qkv::") + function + ": " + argument + ".size(): expected " +
                std::to_string(expected) + " (" + because + "), got " + std::to_string(actual));
  }
}

template <class T>
void softmax_impl(std::span<const T> x, std::span<T> s) {
  expect_size("softmax", "s", x.size(), s.size(), "as x.size()");
  std::vector<double> in(x.begin(), x.end()), out(x.size());
  detail::softmax_row(in.data(), out.data(), static_cast<int64_t>(in.size()));
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<T>(out[i]);
}

template <class T>
void log_softmax_impl(std::span<const T> x, std::span<T> out) {
  expect_size("log_softmax", "out", x.size(), out.size(), "as x.size()");
  std::vector<double> in(x.begin(), x.end()), s(x.size());
  const double lse = detail::softmax_row(in.data(), s.data(), static_cast<int64_t>(in.size()));
  // x_i - lse, not log(s_i): exact for entries whose s_i underflows to 0.
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = std::isinf(lse) ? static_cast<T>(-INFINITY) : static_cast<T>(in[i] - lse);
  }
}

template <class T>
void jacobian_impl(std::span<const T> s, std::span<T> jacobian) {
  const std::size_t n = s.size();
  expect_size("softmax_jacobian", "jacobian", n * n, jacobian.size(), "n·n for n = s.size()");
  // J_ij = ∂s_i/∂x_j = s_i·(δ_ij − s_j), i.e. diag(s) − s·sᵀ.
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      const double si = s[i], sj = s[j];
      jacobian[i * n + j] = static_cast<T>((i == j ? si : 0.0) - si * sj);
    }
  }
}

template <class T>
void backward_impl(std::span<const T> s, std::span<const T> g, std::span<T> dx) {
  expect_size("softmax_backward", "g", s.size(), g.size(), "as s.size()");
  expect_size("softmax_backward", "dx", s.size(), dx.size(), "as s.size()");
  // Jᵀ·g with J symmetric: (diag(s) − s·sᵀ)·g = s ⊙ g − s·⟨s, g⟩ = s ⊙ (g − ⟨s, g⟩).
  double dot = 0.0;
  for (std::size_t i = 0; i < s.size(); ++i) dot += static_cast<double>(s[i]) * g[i];
  for (std::size_t i = 0; i < s.size(); ++i) {
    dx[i] = static_cast<T>(static_cast<double>(s[i]) * (static_cast<double>(g[i]) - dot));
  }
}

}  // namespace

void softmax(std::span<const float> x, std::span<float> s) { softmax_impl(x, s); }
void softmax(std::span<const double> x, std::span<double> s) { softmax_impl(x, s); }
void log_softmax(std::span<const float> x, std::span<float> out) { log_softmax_impl(x, out); }
void log_softmax(std::span<const double> x, std::span<double> out) {
  log_softmax_impl(x, out);
}
void softmax_jacobian(std::span<const float> s, std::span<float> jacobian) {
  jacobian_impl(s, jacobian);
}
void softmax_jacobian(std::span<const double> s, std::span<double> jacobian) {
  jacobian_impl(s, jacobian);
}
void softmax_backward(std::span<const float> s, std::span<const float> g, std::span<float> dx) {
  backward_impl(s, g, dx);
}
void softmax_backward(std::span<const double> s, std::span<const double> g,
                      std::span<double> dx) {
  backward_impl(s, g, dx);
}

}  // namespace qkv
