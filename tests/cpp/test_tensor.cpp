#include <gtest/gtest.h>

#include <cstdint>

#include "test_support.hpp"

namespace qkv {
namespace {

TEST(Tensor, IsSixtyFourByteAlignedAndZeroed) {
  for (int64_t n : {1, 3, 17, 1000}) {
    Tensor<float, 2> t({n, 3});
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u);
    EXPECT_EQ(t.size(), static_cast<std::size_t>(n * 3));
    for (std::size_t i = 0; i < t.size(); ++i) ASSERT_EQ(t[i], 0.0f);
  }
}

TEST(Tensor, ContiguousViewIsRowMajor) {
  Tensor<double, 3> t({2, 3, 4});
  const auto v = t.view();
  EXPECT_EQ(v.strides, (std::array<int64_t, 3>{12, 4, 1}));
  t(1, 2, 3) = 5.0;
  EXPECT_EQ(t[23], 5.0);
  EXPECT_EQ(v.numel(), 24);
}

TEST(Tensor, FromBhsdSeesTorchLayoutAsBshd) {
  // buffer in [B=2, H=3, S=4, D=5] order; element (b, h, s, d) holds its own index tuple.
  Tensor<float, 4> buffer({2, 3, 4, 5});
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 3; ++h)
      for (int64_t s = 0; s < 4; ++s)
        for (int64_t d = 0; d < 5; ++d)
          buffer(b, h, s, d) = static_cast<float>(1000 * b + 100 * h + 10 * s + d);
  const auto view = View4<float>::from_bhsd(buffer.data(), 2, 3, 4, 5);
  EXPECT_EQ(view.shape, (std::array<int64_t, 4>{2, 4, 3, 5}));
  EXPECT_EQ(view(1, 2, 0, 4), 1000.0f + 0.0f + 20.0f + 4.0f);
  EXPECT_EQ(view(0, 3, 2, 1), 200.0f + 30.0f + 1.0f);
}

TEST(Tensor, MutableViewConvertsToConst) {
  Tensor<float, 4> t({1, 1, 1, 2});
  View4<const float> c = t.view();
  t[1] = 3.0f;
  EXPECT_EQ(c(0, 0, 0, 1), 3.0f);
}

TEST(Tensor, CopiesAreDeep) {
  Tensor<float, 1> a({3});
  a[0] = 1.0f;
  Tensor<float, 1> b = a;
  b[0] = 2.0f;
  EXPECT_EQ(a[0], 1.0f);
  EXPECT_NE(a.data(), b.data());
}

}  // namespace
}  // namespace qkv
