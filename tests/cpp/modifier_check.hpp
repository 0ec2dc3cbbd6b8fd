// The modifier tests' common ground: bitwise comparison of results, the cpu against the
// fp64 reference, and the shape most tests use.
//
// Tolerance, cpu vs reference (as test_variants.cpp): 4e-6·max(1, max|ref|) for out and
// LSE, 2e-5·max(1, max|ref|) for gradients: the fp32 kernels sum ≤ 200 terms blockwise
// (observed 1e-7 to 2e-6 on these O(1) values), while a modifier applied wrongly (a wrong
// index, a missing derivative) is off by O(0.1).
#pragma once

#include <gtest/gtest.h>

#include <cstring>

#include "cpu_check.hpp"

namespace qkv::test::modifiers {

template <class T, int R>
bool same_bits(const Tensor<T, R>& a, const Tensor<T, R>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

inline bool same_results(const test::Results& a, const test::Results& b) {
  return same_bits(a.out, b.out) && same_bits(a.lse, b.lse) && same_bits(a.dq, b.dq) &&
         same_bits(a.dk, b.dk) && same_bits(a.dv, b.dv);
}

// cpu (fp32, `threads`) against the reference (fp64) on the case's options.
inline void expect_near_reference(const Case<float>& c, int threads = 2) {
  const CaseSpec& s = c.spec;
  const auto dout = test::random_tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}, 4);
  const test::Results cpu = test::run_cpu(c, {s, false, false, threads}, &dout);
  const test::Reference ref = test::run_reference(c, &dout);
  EXPECT_LE(test::error(cpu.out, ref.out), test::relative_tolerance(4e-6, ref.out)) << "out";
  EXPECT_LE(test::error(cpu.lse, ref.lse), test::relative_tolerance(4e-6, ref.lse)) << "lse";
  EXPECT_LE(test::error(cpu.dq, ref.dq), test::relative_tolerance(2e-5, ref.dq)) << "dq";
  EXPECT_LE(test::error(cpu.dk, ref.dk), test::relative_tolerance(2e-5, ref.dk)) << "dk";
  EXPECT_LE(test::error(cpu.dv, ref.dv), test::relative_tolerance(2e-5, ref.dv)) << "dv";
}

inline test::Results run(const Case<float>& c, int threads = 2) {
  const CaseSpec& s = c.spec;
  const auto dout = test::random_tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}, 4);
  return test::run_cpu(c, {s, false, false, threads}, &dout);
}

// A shape past the decode kernel's query count (which takes no modifiers) and not a
// multiple of the 64-wide tiles.
inline const CaseSpec kShape{.name = "mods", .batch = 2, .q_len = 150, .k_len = 170, .q_heads = 4,
                             .kv_heads = 2, .head_dim = 32, .v_dim = 24};

}  // namespace qkv::test::modifiers
