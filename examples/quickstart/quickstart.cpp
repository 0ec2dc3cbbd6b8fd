// qkv in one screen: attention forward and backward on PyTorch-layout tensors, the
// attention weights, and why the 1/√d scale is there.
#include <qkv/qkv.hpp>

#include <cmath>
#include <cstdio>
#include <random>

int main() {
  constexpr int64_t batch = 1, heads = 2, seq = 5, dim = 16;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);

  // Buffers in PyTorch's [batch, heads, seq, dim] layout, seen by qkv without a copy.
  qkv::Tensor<float, 4> q({batch, heads, seq, dim}), k(q.shape()), v(q.shape()), out(q.shape());
  for (auto* t : {&q, &k, &v})
    for (std::size_t i = 0; i < t->size(); ++i) (*t)[i] = normal(rng);
  auto bhsd = [](auto& t) {
    return qkv::View4<float>::from_bhsd(t.data(), batch, heads, seq, dim);
  };

  qkv::Tensor<float, 3> lse({batch, heads, seq});
  qkv::Tensor<float, 4> weights({batch, heads, seq, seq});
  qkv::AttentionOptions options;
  options.causal = qkv::Causal::top_left;
  qkv::attention_forward({.q = bhsd(q), .k = bhsd(k), .v = bhsd(v), .out = bhsd(out),
                          .lse = lse.view(), .weights = weights.view()},
                         options);

  std::printf("causal attention weights of head 0 (rows sum to 1, upper triangle is 0):\n");
  for (int64_t i = 0; i < seq; ++i) {
    for (int64_t j = 0; j < seq; ++j) std::printf(" %6.3f", static_cast<double>(weights(0, 0, i, j)));
    std::printf("\n");
  }

  // Backward: gradients of L = Σ out for every input.
  qkv::Tensor<float, 4> dout(q.shape()), dq(q.shape()), dk(q.shape()), dv(q.shape());
  for (std::size_t i = 0; i < dout.size(); ++i) dout[i] = 1.0f;
  qkv::attention_backward({.q = bhsd(q), .k = bhsd(k), .v = bhsd(v), .out = bhsd(out),
                           .lse = lse.view(), .dout = bhsd(dout), .dq = bhsd(dq),
                           .dk = bhsd(dk), .dv = bhsd(dv)},
                          options);
  double dv_sum = 0.0;
  for (std::size_t i = 0; i < dv.size(); ++i) dv_sum += dv[i];
  // Σ dV = Σ_ij P_ij · Σ dO = (number of rows) · dim, since every row of P sums to 1.
  std::printf("sum of dV = %.4f (expected %lld)\n", dv_sum,
              static_cast<long long>(batch * heads * seq * dim));

  // The textbook: softmax((1, 2, 3, 1e6)) is one-hot, and its Jacobian is then zero.
  const float x[4] = {1.0f, 2.0f, 3.0f, 1e6f};
  float s[4], jacobian[16];
  qkv::softmax(x, s);
  qkv::softmax_jacobian(s, jacobian);
  double jacobian_norm = 0.0;
  for (float value : jacobian) jacobian_norm += static_cast<double>(value) * value;
  std::printf("softmax(1, 2, 3, 1e6) = (%g, %g, %g, %g); |J|_F = %g\n", static_cast<double>(s[0]),
              static_cast<double>(s[1]), static_cast<double>(s[2]), static_cast<double>(s[3]),
              std::sqrt(jacobian_norm));
  return std::abs(dv_sum - static_cast<double>(batch * heads * seq * dim)) < 1e-3 ? 0 : 1;
}
