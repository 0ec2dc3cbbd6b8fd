// A plain, unfused fp32 attention (materialized S and P, float accumulation), forward
// and backward: the yardstick for the fused kernels' tolerance. The rule: the
// fused backend may be off the fp64 reference by at most 2× what this is off by.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include "attention_cases.hpp"
#include "core/problem.hpp"  // detail::MaskRule, the library's own mask rule

namespace qkv::test {

struct PlainResult {
  Tensor<float, 4> out, dq, dk, dv;
  Tensor<float, 3> lse;
};

// Element (b, h, i, j) of a mask view that may broadcast (extent 1) on its first 3 axes.
template <class T>
T broadcast_at(const View4<const T>& m, int64_t b, int64_t h, int64_t i, int64_t j) {
  return m(m.shape[0] == 1 ? 0 : b, m.shape[1] == 1 ? 0 : h, m.shape[2] == 1 ? 0 : i, j);
}

// The case's softmax scale in float, and its mask rule (causal, key lengths).
inline float plain_scale(const CaseSpec& s) {
  return static_cast<float>(s.scale ? *s.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim)));
}
inline detail::MaskRule plain_rule(const Case<float>& c) {
  detail::MaskRule rule;
  rule.causal = c.spec.causal;
  rule.sequences = {.count = c.spec.batch, .dense_q_len = c.spec.q_len, .dense_k_len = c.spec.k_len};
  rule.key_lengths = c.key_lengths;
  return rule;
}

// Row (b, h, i) of P in float, loop by loop, into p (k_len entries, 0 where a key is
// removed), reading the masks from c.options (any broadcast shape); returns the row's
// log-sum-exp (−inf when no key is left). Additive entries are added literally, as
// PyTorch's math does (−inf removes a key): a finite finfo.min row is averaged, not removed.
inline float plain_fp32_row(const Case<float>& c, const detail::MaskRule& rule, float scale, int64_t b,
                            int64_t h, int64_t i, std::vector<float>& p) {
  const CaseSpec& s = c.spec;
  const int64_t kh = h / (s.q_heads / s.kv_heads);
  float max = -std::numeric_limits<float>::infinity();
  std::vector<bool> seen(s.k_len, false);
  for (int64_t j = 0; j < rule.key_end(b, i); ++j) {
    const auto& mask = c.options.mask;
    if (!mask.keep.empty() && broadcast_at(mask.keep, b, h, i, j) == 0) continue;
    const float bias = mask.bias.empty() ? 0.0f : broadcast_at(mask.bias, b, h, i, j);
    if (bias == -INFINITY) continue;
    float dot = 0.0f;
    for (int64_t x = 0; x < s.head_dim; ++x) dot += c.q(b, i, h, x) * c.k(b, j, kh, x);
    p[j] = dot * scale + bias;
    seen[j] = true;
    max = std::max(max, p[j]);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < s.k_len; ++j) {
    p[j] = seen[j] ? std::exp(p[j] - max) : 0.0f;
    sum += p[j];
  }
  for (int64_t j = 0; j < s.k_len; ++j) p[j] = sum > 0.0f ? p[j] / sum : 0.0f;
  return sum > 0.0f ? max + std::log(sum) : -INFINITY;
}

// Computes out (and, given dout, the gradients) in float, loop by loop, from the rows
// of plain_fp32_row.
inline PlainResult plain_fp32(const Case<float>& c, const Tensor<float, 4>* dout) {
  const CaseSpec& s = c.spec;
  const float scale = plain_scale(s);
  const int64_t group = s.q_heads / s.kv_heads;
  PlainResult r{Tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}), Tensor<float, 4>(c.q.shape()),
                Tensor<float, 4>(c.k.shape()), Tensor<float, 4>(c.v.shape()),
                Tensor<float, 3>({s.batch, s.q_heads, s.q_len})};
  const detail::MaskRule rule = plain_rule(c);
  std::vector<float> p(s.k_len), dp(s.k_len);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t i = 0; i < s.q_len; ++i) {
        const int64_t kh = h / group;
        r.lse(b, h, i) = plain_fp32_row(c, rule, scale, b, h, i, p);
        for (int64_t x = 0; x < s.v_dim; ++x) {
          float acc = 0.0f;
          for (int64_t j = 0; j < s.k_len; ++j) acc += p[j] * c.v(b, j, kh, x);
          r.out(b, i, h, x) = acc;
        }
        if (dout == nullptr) continue;
        float pdp = 0.0f;
        for (int64_t j = 0; j < s.k_len; ++j) {
          float dot = 0.0f;
          for (int64_t x = 0; x < s.v_dim; ++x) dot += (*dout)(b, i, h, x) * c.v(b, j, kh, x);
          dp[j] = dot;
          pdp += p[j] * dot;
        }
        for (int64_t j = 0; j < s.k_len; ++j) {
          if (p[j] == 0.0f) continue;
          const float ds = p[j] * (dp[j] - pdp) * scale;
          for (int64_t x = 0; x < s.head_dim; ++x) {
            r.dq(b, i, h, x) += ds * c.k(b, j, kh, x);
            r.dk(b, j, kh, x) += ds * c.q(b, i, h, x);
          }
          for (int64_t x = 0; x < s.v_dim; ++x) r.dv(b, j, kh, x) += p[j] * (*dout)(b, i, h, x);
        }
      }
  return r;
}

}  // namespace qkv::test
