// Linear: forward against plain loops, gradients against finite differences, argument
// errors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "blas_coretype.hpp"
#include "nn_test_support.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/nn/threads.hpp"

namespace qkv::nn {
namespace {

using testing::expect_gradient;
using testing::expect_parameter_gradients;

TEST(Linear, ForwardMatchesLoops) {
  for (bool bias : {true, false}) {
    Rng rng(1);
    Linear<double> linear(5, 3, bias);
    linear.reset_parameters(rng);
    Tensor<double, 2> x({7, 5}), y({7, 3});
    testing::fill(x, rng);
    linear.forward(x.cview(), y.view());
    for (int r = 0; r < 7; ++r) {
      for (int o = 0; o < 3; ++o) {
        double expected = bias ? linear.bias.value[o] : 0.0;
        for (int i = 0; i < 5; ++i) expected += x(r, i) * linear.weight.value[o * 5 + i];
        EXPECT_NEAR(y(r, o), expected, 1e-14) << "bias " << bias << " row " << r;
      }
    }
  }
}

TEST(Linear, DefaultInitIsPyTorchs) {
  Rng rng(3);
  Linear<float> linear(64, 32);
  linear.reset_parameters(rng);
  const double bound = 1.0 / 8.0;
  double sum_squares = 0;
  for (float w : linear.weight.values()) {
    ASSERT_LE(std::fabs(w), bound);
    sum_squares += w * w;
  }
  // U(−b, b) has variance b²/3; 2048 draws pin it to within a few percent.
  EXPECT_NEAR(sum_squares / 2048, bound * bound / 3, 0.1 * bound * bound / 3);
  for (float b : linear.bias.values()) ASSERT_LE(std::fabs(b), bound);
}

TEST(Linear, GradientsMatchFiniteDifferences) {
  for (bool bias : {true, false}) {
    Rng rng(2);
    Linear<double> linear(6, 4, bias);
    linear.reset_parameters(rng);
    Tensor<double, 2> x({5, 6}), y({5, 4}), w({5, 4}), dx({5, 6});
    testing::fill(x, rng);
    testing::fill(w, rng);
    auto loss = [&] {
      linear.forward(x.cview(), y.view());
      return testing::weighted_sum({y.data(), y.size()}, {w.data(), w.size()});
    };
    ParameterList<double> list;
    linear.collect(list, "linear");
    zero_grad(list);
    loss();
    linear.backward(x.cview(), w.cview(), dx.view());
    expect_parameter_gradients(list, loss);
    expect_gradient({x.data(), x.size()}, {dx.data(), dx.size()}, loss, "x");
  }
}

TEST(Linear, BackwardAccumulatesParametersAndOptionallyInputs) {
  Rng rng(4);
  Linear<double> linear(3, 2);
  linear.reset_parameters(rng);
  Tensor<double, 2> x({4, 3}), dy({4, 2}), dx({4, 3});
  testing::fill(x, rng);
  testing::fill(dy, rng);
  linear.backward(x.cview(), dy.cview(), dx.view());
  const Tensor<double, 1> once = linear.weight.grad;
  const Tensor<double, 2> dx_once = dx;
  linear.backward(x.cview(), dy.cview(), dx.view(), /*accumulate_dx=*/true);
  for (std::size_t i = 0; i < once.size(); ++i) EXPECT_DOUBLE_EQ(linear.weight.grad[i], 2 * once[i]);
  for (std::size_t i = 0; i < dx.size(); ++i) EXPECT_DOUBLE_EQ(dx[i], 2 * dx_once[i]);
  linear.backward(x.cview(), dy.cview(), dx.view());  // written, not accumulated
  for (std::size_t i = 0; i < dx.size(); ++i) EXPECT_DOUBLE_EQ(dx[i], dx_once[i]);
  linear.backward(x.cview(), dy.cview(), {});  // no input gradient wanted
  for (std::size_t i = 0; i < once.size(); ++i) EXPECT_DOUBLE_EQ(linear.weight.grad[i], 4 * once[i]);
}

TEST(Linear, AcceptsStridedRows) {
  Rng rng(5);
  Linear<float> linear(3, 2);
  linear.reset_parameters(rng);
  // Rows 8 apart in a wider buffer, as a slice of a bigger activation.
  Tensor<float, 2> wide({4, 8}), packed({4, 3}), y_wide({4, 2}), y_packed({4, 2});
  testing::fill(wide, rng);
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 3; ++c) packed(r, c) = wide(r, c + 2);
  }
  const Matrix<const float> slice(wide.data() + 2, {4, 3}, {8, 1});
  linear.forward(slice, y_wide.view());
  linear.forward(packed.cview(), y_packed.view());
  for (std::size_t i = 0; i < y_wide.size(); ++i) EXPECT_EQ(y_wide[i], y_packed[i]);
}

TEST(Linear, RejectsBadShapesNamingTheArgument) {
  Linear<float> linear(3, 2);
  Tensor<float, 2> x({4, 3}), y({4, 2}), bad_x({4, 5}), bad_y({3, 2});
  EXPECT_THROW(
      {
        try {
          linear.forward(bad_x.cview(), y.view());
        } catch (const Error& e) {
          EXPECT_STREQ(e.what(), "qkv::nn::Linear::forward: x.shape[1] (features): expected 3, got 5");
          throw;
        }
      },
      Error);
  EXPECT_THROW(linear.forward(x.cview(), bad_y.view()), Error);
  EXPECT_THROW(linear.backward(x.cview(), bad_y.cview(), x.view()), Error);
  EXPECT_THROW(Linear<float>(0, 2), Error);
  const Matrix<const float> column_strided(x.data(), {4, 3}, {3, 2});
  EXPECT_THROW(linear.forward(column_strided, y.view()), Error);
}

TEST(Blas, KnowsWhenOpenBlasRunsItsSlowestKernels) {
  // OpenBLAS releases older than the CPU fall back to SSE3 "Prescott" kernels (7× slower
  // sgemm); faster_blas_coretype() then names the OPENBLAS_CORETYPE that fixes it (the
  // qkv command restarts itself with it: tests/demo checks the kernels it reports).
  const std::string kernels = blas_kernels();
  EXPECT_EQ(kernels.rfind("OpenBLAS ", 0), 0u) << kernels;
  const detail::CpuVectorFeatures cpu = detail::cpu_vector_features();
  const bool fallback = kernels == "OpenBLAS Prescott" &&
                        std::getenv("OPENBLAS_CORETYPE") == nullptr && cpu.avx2_fma;
  EXPECT_EQ(faster_blas_coretype().empty(), !fallback) << kernels;

  using detail::faster_coretype;
  const detail::CpuVectorFeatures avx512{.avx512 = true, .avx2_fma = true};
  const detail::CpuVectorFeatures avx2{.avx512 = false, .avx2_fma = true};
  EXPECT_EQ(faster_coretype("Prescott", false, avx512), "SkylakeX");
  EXPECT_EQ(faster_coretype("Prescott", false, avx2), "Haswell");
  EXPECT_EQ(faster_coretype("Prescott", false, {}), "");          // SSE3 is all it has
  EXPECT_EQ(faster_coretype("Prescott", true, avx512), "");       // the user chose
  EXPECT_EQ(faster_coretype("Cooperlake", false, avx512), "");    // OpenBLAS knows it
  EXPECT_EQ(faster_coretype("Zen", false, avx2), "");
  EXPECT_THROW(set_threads(0), Error);
}

}  // namespace
}  // namespace qkv::nn
