// The cpu backend against the fp64 reference, in one place for every cpu test file.
//
// Tolerance (the rule): max |cpu − ref64| ≤ 2·max |plain32 − ref64| + floor,
// where plain32 is an unfused fp32 implementation (plain_fp32.hpp) on the same inputs.
// floor = 8·ε₃₂·max(1, max |ref64|) ≈ 1e-6 for O(1) values: a few roundings that the
// plain loop may happen to avoid on tiny problems (e.g. N = 1, where it is exact).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "plain_fp32.hpp"

namespace qkv::test {

struct CpuCase {
  CaseSpec spec;
  bool bhsd = false;          // PyTorch memory layout
  bool strided_batch = false; // q lives in every other batch slot of a bigger buffer
  int threads = 2;
};

inline std::ostream& operator<<(std::ostream& out, const CpuCase& c) { return out << c.spec.name; }

struct Results {
  Tensor<float, 4> out, dq, dk, dv;
  Tensor<float, 3> lse;
};

template <class T>
inline Tensor<T, 4> widen(const Tensor<float, 4>& t) {
  Tensor<T, 4> w(t.shape());
  for (std::size_t i = 0; i < t.size(); ++i) w[i] = static_cast<T>(t[i]);
  return w;
}

// Runs forward (and backward when dout is given) on the cpu backend, in the case's layout.
inline Results run_cpu(const Case<float>& c, const CpuCase& how, const Tensor<float, 4>* dout,
                       std::span<float> dsinks = {}) {
  const CaseSpec& s = c.spec;
  AttentionOptions options = c.options;
  options.execution.backend = Backend::cpu;
  options.execution.threads = how.threads;
  Results r{Tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}), Tensor<float, 4>(c.q.shape()),
            Tensor<float, 4>(c.k.shape()), Tensor<float, 4>(c.v.shape()),
            Tensor<float, 3>({s.batch, s.q_heads, s.q_len})};
  if (how.bhsd) {
    auto q = test::to_bhsd(c.q), k = test::to_bhsd(c.k), v = test::to_bhsd(c.v);
    auto out = test::to_bhsd(r.out);
    attention_forward({.q = test::bhsd_view(q), .k = test::bhsd_view(k), .v = test::bhsd_view(v),
                       .out = test::bhsd_view(out), .lse = r.lse.view()},
                      options);
    // back to [B, S, H, D] for comparison
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t i = 0; i < s.q_len; ++i)
        for (int64_t h = 0; h < s.q_heads; ++h)
          for (int64_t x = 0; x < s.v_dim; ++x) r.out(b, i, h, x) = out(b, h, i, x);
    if (dout == nullptr) return r;
    auto go = test::to_bhsd(*dout), o = test::to_bhsd(r.out);
    auto dq = test::to_bhsd(r.dq), dk = test::to_bhsd(r.dk), dv = test::to_bhsd(r.dv);
    attention_backward({.q = test::bhsd_view(q), .k = test::bhsd_view(k), .v = test::bhsd_view(v),
                        .out = test::bhsd_view(o), .lse = r.lse.cview(), .dout = test::bhsd_view(go),
                        .dq = test::bhsd_view(dq), .dk = test::bhsd_view(dk), .dv = test::bhsd_view(dv)},
                       options);
    auto back = [](const Tensor<float, 4>& from, Tensor<float, 4>& to) {
      const auto& sh = to.shape();
      for (int64_t b = 0; b < sh[0]; ++b)
        for (int64_t i = 0; i < sh[1]; ++i)
          for (int64_t h = 0; h < sh[2]; ++h)
            for (int64_t x = 0; x < sh[3]; ++x) to(b, i, h, x) = from(b, h, i, x);
    };
    back(dq, r.dq);
    back(dk, r.dk);
    back(dv, r.dv);
    return r;
  }
  View4<const float> q = c.q.cview();
  Tensor<float, 4> wide;
  if (how.strided_batch) {  // same values, batch stride doubled
    wide = Tensor<float, 4>({2 * s.batch, s.q_len, s.q_heads, s.head_dim});
    const std::size_t per_batch = c.q.size() / static_cast<std::size_t>(s.batch);
    for (int64_t b = 0; b < s.batch; ++b)
      std::memcpy(wide.data() + 2 * b * per_batch, c.q.data() + b * per_batch, per_batch * sizeof(float));
    q.data = wide.data();
    q.strides[0] *= 2;
  }
  attention_forward({.q = q, .k = c.k.cview(), .v = c.v.cview(), .out = r.out.view(), .lse = r.lse.view()},
                    options);
  if (dout != nullptr) {
    attention_backward({.q = q, .k = c.k.cview(), .v = c.v.cview(), .out = r.out.cview(),
                        .lse = r.lse.cview(), .dout = dout->cview(), .dq = r.dq.view(),
                        .dk = r.dk.view(), .dv = r.dv.view(), .dsinks = dsinks},
                       options);
  }
  return r;
}

struct Reference {
  Tensor<double, 4> out, dq, dk, dv;
  Tensor<double, 3> lse;
};

inline Reference run_reference(const Case<float>& c, const Tensor<float, 4>* dout,
                               std::span<float> dsinks = {}) {
  const CaseSpec& s = c.spec;
  const auto q = widen<double>(c.q), k = widen<double>(c.k), v = widen<double>(c.v);
  Reference r{Tensor<double, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}), Tensor<double, 4>(c.q.shape()),
              Tensor<double, 4>(c.k.shape()), Tensor<double, 4>(c.v.shape()),
              Tensor<double, 3>({s.batch, s.q_heads, s.q_len})};
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = r.out.view(), .lse = r.lse.view()},
                    c.options);
  if (dout != nullptr) {
    const auto g = widen<double>(*dout);
    attention_backward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = r.out.cview(),
                        .lse = r.lse.cview(), .dout = g.cview(), .dq = r.dq.view(), .dk = r.dk.view(),
                        .dv = r.dv.view(), .dsinks = dsinks},
                       c.options);
  }
  return r;
}

template <int R>
inline double max_abs(const Tensor<double, R>& t) {
  double m = 0.0;
  for (std::size_t i = 0; i < t.size(); ++i)
    if (std::isfinite(t[i])) m = std::max(m, std::abs(t[i]));
  return m;
}

// relative·max(1, max |ref|): relative to the reference's size, but never tighter than
// `relative` itself (absolute for values below 1).
template <int R>
inline double relative_tolerance(double relative, const Tensor<double, R>& ref) {
  return relative * std::max(1.0, max_abs(ref));
}

// max |x − ref| treating equal infinities (−inf LSE of masked rows) as exact.
template <int R>
inline double error(const Tensor<float, R>& x, const Tensor<double, R>& ref) {
  double worst = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (std::isinf(ref[i]) && static_cast<double>(x[i]) == ref[i]) continue;
    const double e = std::abs(static_cast<double>(x[i]) - ref[i]);
    if (std::isnan(e)) return INFINITY;
    worst = std::max(worst, e);
  }
  return worst;
}

template <int R>
inline void expect_within_rule(const char* name, const Tensor<float, R>& cpu, const Tensor<float, R>& plain,
                        const Tensor<double, R>& ref) {
  const double floor = 8.0 * std::numeric_limits<float>::epsilon() * std::max(1.0, max_abs(ref));
  const double cpu_error = error(cpu, ref), plain_error = error(plain, ref);
  EXPECT_LE(cpu_error, 2.0 * plain_error + floor)
      << name << ": cpu error " << cpu_error << ", plain fp32 error " << plain_error;
}

// Reference backward builds an Nk×Nk Jacobian per query row: keep it affordable.
inline bool backward_affordable(const CaseSpec& s) {
  return static_cast<double>(s.batch * s.q_heads * s.q_len) * static_cast<double>(s.k_len * s.k_len) < 3e8;
}

// cpu forward (and backward when affordable) against the reference, within the rule.
inline void check_prepared_case(const Case<float>& c, const CpuCase& how) {
  const CaseSpec& s = c.spec;
  const bool backward = backward_affordable(s);
  const auto dout = test::random_tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}, 99);
  const Results cpu = run_cpu(c, how, backward ? &dout : nullptr);
  const test::PlainResult plain = test::plain_fp32(c, backward ? &dout : nullptr);
  const Reference ref = run_reference(c, backward ? &dout : nullptr);
  expect_within_rule("out", cpu.out, plain.out, ref.out);
  expect_within_rule("lse", cpu.lse, plain.lse, ref.lse);
  if (!backward) return;
  expect_within_rule("dq", cpu.dq, plain.dq, ref.dq);
  expect_within_rule("dk", cpu.dk, plain.dk, ref.dk);
  expect_within_rule("dv", cpu.dv, plain.dv, ref.dv);
}

inline void check_case(const CpuCase& how) { check_prepared_case(Case<float>(how.spec, 1234), how); }

}  // namespace qkv::test
