// The cpu backend on bfloat16 / float16 storage against the fp64 reference on the very
// same (exactly widened) inputs: the half-precision error contract.
//
// For each output X (out, dq, dk, dv, rounded once to T by the kernel):
//   max |X_cpu − X_ref64| ≤ max |round_T(X_ref64) − X_ref64|     (what storing costs)
//                          + u_T · max |X_ref64|                  (one unit roundoff of T)
//                          + 2·err(plain fp32) + floor            (the fp32 contract)
// u_T = 2⁻⁸ (bfloat16), 2⁻¹¹ (float16). Why it holds: the kernel rounds its fp32 result x
// once, so |T(x) − ref| ≤ u_T·|x| + |x − ref|, and |x − ref| is the fp32 kernel's error.
// lse stays float and keeps the fp32 rule itself (2·err(plain fp32) + floor).
//
// Precision::fast with bfloat16 dot products (cpu/bf16_dot.hpp, cpu/amx_dot.hpp) rounds
// each weight P_ij to bfloat16 once for P·V (Q·Kᵀ's products stay exact), as PyTorch does:
// the out bound adds u_bf16 · max_i (P·|V|)_i, what one bf16 rounding of every weight
// can cost.
//
// The backward's dot products (the same switch) round P_ij and dS_ij = P_ij·(dP_ij − D_i)
// to bfloat16 once each (S and dP are products of bf16 values, exact either way): dv's
// bound adds u_bf16·max Σ_i P_ij·|dO_i|, dk's u_bf16·scale·max Σ_i |dS_ij|·|q_i| and dq's
// u_bf16·scale·max Σ_j |dS_ij|·|k_j| (GradientWeightRounding).
//
// For the gradients, X_ref64 is the exact backward *of the stored out*. The backward
// takes out as an input and uses it only through D_i = ⟨dO_i, O_i⟩ (FlashAttention's,
// PyTorch's and qkv's backward alike); an out rounded to T moves D_i by
// ΔD_i = ⟨dO_i, O_T,i − O_i⟩, hence dS_ij by −P_ij·ΔD_i, dq and dk by the amounts
// out_rounding_effect computes in fp64 (dv does not depend on D). The kernel cannot
// undo a rounding that happened before it was called.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu/dot_products.hpp"
#include "cpu_check.hpp"

namespace qkv::test {

// Forces one of cpu/dot_products.hpp's switches on or off for one scope; the
// environment's choice comes back even when an ASSERT returns early.
template <void (*kSet)(std::optional<bool>)>
class ForcedSwitch {
 public:
  explicit ForcedSwitch(bool on) { kSet(on); }
  ForcedSwitch(const ForcedSwitch&) = delete;
  ForcedSwitch& operator=(const ForcedSwitch&) = delete;
  ~ForcedSwitch() { kSet(std::nullopt); }
};

// The dot products (QKV_DOT_PRODUCTS), and the AMX tiles (QKV_AMX: on forces them, off
// keeps the bf16 dot products on vdpbf16ps).
using ForcedDotProducts = ForcedSwitch<cpu::set_dot_products_for_test>;
using ForcedAmx = ForcedSwitch<cpu::set_amx_for_test>;

// The bfloat16 dot-product units this CPU has, each forced in turn by ForcedBf16Unit.
inline std::vector<cpu::Bf16Unit> bf16_units_here() {
  std::vector<cpu::Bf16Unit> units;
  if (cpu::cpu_has_bf16_dot()) units.push_back(cpu::Bf16Unit::avx512_bf16);
  if (cpu::cpu_has_amx_bf16()) units.push_back(cpu::Bf16Unit::amx);
  return units;
}

inline const char* unit_name(cpu::Bf16Unit unit) {
  return unit == cpu::Bf16Unit::amx ? "AMX tiles" : unit == cpu::Bf16Unit::avx512_bf16 ? "vdpbf16ps" : "fp32 FMAs";
}

// Precision::fast on one unit for a scope: the dot products forced on, the tiles on or off.
class ForcedBf16Unit {
 public:
  explicit ForcedBf16Unit(cpu::Bf16Unit unit) : dots_(true), amx_(unit == cpu::Bf16Unit::amx) {}

 private:
  ForcedDotProducts dots_;
  ForcedAmx amx_;
};

template <class T>
constexpr double unit_roundoff() {
  return std::is_same_v<T, bfloat16> ? 0x1p-8 : 0x1p-11;
}

template <class T>
constexpr const char* storage_label() {
  return std::is_same_v<T, bfloat16> ? "bfloat16" : "float16";
}

// Rounds every element of a float tensor to T in place (so that T holds it exactly).
template <class T, int R>
void round_to(Tensor<float, R>& t) {
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<float>(T(t[i]));
}

template <class T, int R>
Tensor<T, R> narrow(const Tensor<float, R>& t) {
  Tensor<T, R> out(t.shape());
  for (std::size_t i = 0; i < t.size(); ++i) out[i] = T(t[i]);
  return out;
}

template <class T, int R>
Tensor<float, R> widened(const Tensor<T, R>& t) {
  Tensor<float, R> out(t.shape());
  for (std::size_t i = 0; i < t.size(); ++i) out[i] = static_cast<float>(t[i]);
  return out;
}

// A case whose q, k, v (and the dout it returns) are exactly representable in T.
template <class T>
Case<float> half_case(const CaseSpec& spec, std::uint64_t seed, Tensor<float, 4>& dout) {
  Case<float> c(spec, seed);
  round_to<T>(c.q);
  round_to<T>(c.k);
  round_to<T>(c.v);
  dout = random_tensor<float, 4>({spec.batch, spec.q_len, spec.q_heads, spec.v_dim}, seed + 50);
  round_to<T>(dout);
  return c;
}

// Forward (and backward, given dout) on the cpu backend in storage T; results widened.
// bhsd: q, k, v, out and the gradients in PyTorch's memory order (strided views).
template <class T>
Results run_cpu_half(const Case<float>& c, const Tensor<float, 4>* dout, int threads,
                     bool bhsd = false, Precision precision = Precision::exact) {
  const CaseSpec& s = c.spec;
  AttentionOptions options = c.options;
  options.precision = precision;
  options.execution.backend = Backend::cpu;
  options.execution.threads = threads;
  auto view = [&](Tensor<T, 4>& t) {
    if (!bhsd) return t.view();
    const auto& sh = t.shape();  // allocated as [B, H, S, D]
    return View4<T>::from_bhsd(t.data(), sh[0], sh[1], sh[2], sh[3]);
  };
  auto make = [&](const Tensor<float, 4>& like_bshd) {
    Tensor<T, 4> t = narrow<T>(bhsd ? to_bhsd(like_bshd) : like_bshd);
    return t;
  };
  auto back = [&](Tensor<T, 4>& t) {
    Tensor<float, 4> wide = widened(t);
    if (!bhsd) return wide;
    const auto& sh = wide.shape();
    Tensor<float, 4> out({sh[0], sh[2], sh[1], sh[3]});
    for (int64_t b = 0; b < sh[0]; ++b)
      for (int64_t h = 0; h < sh[1]; ++h)
        for (int64_t i = 0; i < sh[2]; ++i)
          for (int64_t x = 0; x < sh[3]; ++x) out(b, i, h, x) = wide(b, h, i, x);
    return out;
  };
  Tensor<T, 4> q = make(c.q), k = make(c.k), v = make(c.v);
  Tensor<T, 4> out = make(Tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}));
  Tensor<float, 3> lse({s.batch, s.q_heads, s.q_len});
  attention_forward({.q = view(q), .k = view(k), .v = view(v), .out = view(out), .lse = lse.view()},
                    options);
  Results r{back(out), Tensor<float, 4>(c.q.shape()), Tensor<float, 4>(c.k.shape()),
            Tensor<float, 4>(c.v.shape()), lse};
  if (dout == nullptr) return r;
  Tensor<T, 4> g = make(*dout), dq = make(c.q), dk = make(c.k), dv = make(c.v);
  attention_backward({.q = view(q), .k = view(k), .v = view(v), .out = view(out), .lse = lse.cview(),
                      .dout = view(g), .dq = view(dq), .dk = view(dk), .dv = view(dv)},
                     options);
  r.dq = back(dq);
  r.dk = back(dk);
  r.dv = back(dv);
  return r;
}

// max |round_T(ref) − ref| over the finite entries of ref.
template <class T, int R>
double storage_rounding_error(const Tensor<double, R>& ref) {
  double worst = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(ref[i])) continue;
    const double stored = static_cast<float>(T(static_cast<float>(ref[i])));
    worst = std::max(worst, std::abs(stored - ref[i]));
  }
  return worst;
}

// dq and dk of the exact backward with D computed from `out_stored` instead of the
// exact out, minus those with the exact out (see above). P from the reference backend.
struct OutRoundingEffect {
  Tensor<double, 4> dq, dk;
};

// The case's attention weights P [B, Hq, Nq, Nk] from the fp64 reference.
inline Tensor<double, 4> reference_weights(const Case<float>& c) {
  const CaseSpec& s = c.spec;
  const auto q = widen<double>(c.q), k = widen<double>(c.k), v = widen<double>(c.v);
  Tensor<double, 4> out({s.batch, s.q_len, s.q_heads, s.v_dim});
  Tensor<double, 4> weights({s.batch, s.q_heads, s.q_len, s.k_len});
  AttentionOptions options = c.options;
  options.execution.backend = Backend::reference;
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                     .weights = weights.view()},
                    options);
  return weights;
}

inline OutRoundingEffect out_rounding_effect(const Case<float>& c, const Tensor<float, 4>& dout,
                                             const Tensor<float, 4>& out_stored,
                                             const Reference& ref) {
  const CaseSpec& s = c.spec;
  const auto q = widen<double>(c.q), k = widen<double>(c.k);
  const Tensor<double, 4> weights = reference_weights(c);
  const double scale = s.scale ? *s.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  const int64_t group = s.q_heads / s.kv_heads;
  OutRoundingEffect effect{Tensor<double, 4>(c.q.shape()), Tensor<double, 4>(c.k.shape())};
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t i = 0; i < s.q_len; ++i) {
        double delta = 0.0;  // ΔD_i
        for (int64_t x = 0; x < s.v_dim; ++x)
          delta += double{dout(b, i, h, x)} * (double{out_stored(b, i, h, x)} - ref.out(b, i, h, x));
        for (int64_t j = 0; j < s.k_len; ++j) {
          const double ds = -scale * weights(b, h, i, j) * delta;  // scale·ΔdS_ij
          if (ds == 0.0) continue;
          for (int64_t x = 0; x < s.head_dim; ++x) {
            effect.dq(b, i, h, x) += ds * k(b, j, h / group, x);
            effect.dk(b, j, h / group, x) += ds * q(b, i, h, x);
          }
        }
      }
  return effect;
}

// max over rows and columns of Σ_j P_ij·|v_j| (P from the reference, fp64): what rounding
// every weight to bfloat16 can move out by, in units of u.
inline double max_weighted_abs_value(const Case<float>& c) {
  const CaseSpec& s = c.spec;
  const auto v = widen<double>(c.v);
  const Tensor<double, 4> weights = reference_weights(c);
  const int64_t group = s.q_heads / s.kv_heads;
  double worst = 0.0;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t i = 0; i < s.q_len; ++i)
        for (int64_t x = 0; x < s.v_dim; ++x) {
          double sum = 0.0;
          for (int64_t j = 0; j < s.k_len; ++j) sum += weights(b, h, i, j) * std::abs(v(b, j, h / group, x));
          worst = std::max(worst, sum);
        }
  return worst;
}

// What rounding every P_ij and dS_ij to bfloat16 can move dv, dk and dq by, in units of u
// (see the top of this file): fp64, P from the reference, D_i from the stored out (as the
// kernel computes it).
struct GradientWeightRounding {
  double dq = 0.0, dk = 0.0, dv = 0.0;
};

inline GradientWeightRounding gradient_weight_rounding(const Case<float>& c, const Tensor<float, 4>& dout,
                                                       const Tensor<float, 4>& out_stored) {
  const CaseSpec& s = c.spec;
  const auto q = widen<double>(c.q), k = widen<double>(c.k), v = widen<double>(c.v);
  const Tensor<double, 4> weights = reference_weights(c);
  const double scale = s.scale ? *s.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  const int64_t group = s.q_heads / s.kv_heads;
  Tensor<double, 4> dq_sum(c.q.shape()), dk_sum(c.k.shape()), dv_sum(c.v.shape());
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.q_heads; ++h)
      for (int64_t i = 0; i < s.q_len; ++i) {
        double delta = 0.0;  // D_i
        for (int64_t x = 0; x < s.v_dim; ++x) delta += double{dout(b, i, h, x)} * double{out_stored(b, i, h, x)};
        for (int64_t j = 0; j < s.k_len; ++j) {
          const double p = weights(b, h, i, j);
          if (p == 0.0) continue;
          double dp = 0.0;
          for (int64_t x = 0; x < s.v_dim; ++x) {
            dp += double{dout(b, i, h, x)} * v(b, j, h / group, x);
            dv_sum(b, j, h / group, x) += p * std::abs(double{dout(b, i, h, x)});
          }
          const double ds = std::abs(p * (dp - delta));
          for (int64_t x = 0; x < s.head_dim; ++x) {
            dk_sum(b, j, h / group, x) += ds * std::abs(q(b, i, h, x));
            dq_sum(b, i, h, x) += ds * std::abs(k(b, j, h / group, x));
          }
        }
      }
  return {scale * max_abs(dq_sum), scale * max_abs(dk_sum), max_abs(dv_sum)};
}

template <int R>
Tensor<double, R> plus(const Tensor<double, R>& a, const Tensor<double, R>& b) {
  Tensor<double, R> out(a.shape());
  for (std::size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
  return out;
}

// `exact` is the reference on the kernel's inputs (for gradients, with the stored out);
// the fp32 allowance is the plain fp32 loop's error against the true reference `ref`.
template <class T, int R>
void expect_half_contract(const char* name, const Tensor<float, R>& cpu,
                          const Tensor<float, R>& plain, const Tensor<double, R>& exact,
                          const Tensor<double, R>& ref, double extra = 0.0) {
  const double floor = 8.0 * std::numeric_limits<float>::epsilon() * std::max(1.0, max_abs(ref));
  const double fp32_allowance = 2.0 * error(plain, ref) + floor;
  const double storing = storage_rounding_error<T>(exact);
  const double bound = storing + unit_roundoff<T>() * max_abs(exact) + fp32_allowance + extra;
  const double cpu_error = error(cpu, exact);
  EXPECT_LE(cpu_error, bound) << storage_label<T>() << " " << name << ": cpu error " << cpu_error
                              << ", storage rounding " << storing << ", max |exact| "
                              << max_abs(exact) << ", fp32 allowance " << fp32_allowance;
}

// Forward and (when affordable) backward of one case in storage T, against the contract.
template <class T>
void check_half_case(const CaseSpec& spec, int threads = 2, bool bhsd = false,
                     std::uint64_t seed = 1234, Precision precision = Precision::exact) {
  Tensor<float, 4> dout;
  const Case<float> c = half_case<T>(spec, seed, dout);
  const bool backward = backward_affordable(spec);
  const Results cpu = run_cpu_half<T>(c, backward ? &dout : nullptr, threads, bhsd, precision);
  const PlainResult plain = plain_fp32(c, backward ? &dout : nullptr);
  const Reference ref = run_reference(c, backward ? &dout : nullptr);
  const bool rounds_weights = std::is_same_v<T, bfloat16> && precision == Precision::fast;
  const double weight_rounding = rounds_weights ? unit_roundoff<T>() * max_weighted_abs_value(c) : 0.0;
  expect_half_contract<T>("out", cpu.out, plain.out, ref.out, ref.out, weight_rounding);
  expect_within_rule("lse", cpu.lse, plain.lse, ref.lse);
  if (!backward) return;
  const OutRoundingEffect effect = out_rounding_effect(c, dout, cpu.out, ref);
  const GradientWeightRounding rounding =
      rounds_weights ? gradient_weight_rounding(c, dout, cpu.out) : GradientWeightRounding{};
  const double u = unit_roundoff<T>();
  expect_half_contract<T>("dq", cpu.dq, plain.dq, plus(ref.dq, effect.dq), ref.dq, u * rounding.dq);
  expect_half_contract<T>("dk", cpu.dk, plain.dk, plus(ref.dk, effect.dk), ref.dk, u * rounding.dk);
  expect_half_contract<T>("dv", cpu.dv, plain.dv, ref.dv, ref.dv, u * rounding.dv);
}

}  // namespace qkv::test
