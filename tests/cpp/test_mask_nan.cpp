// A NaN in an additive mask, as PyTorch treats it: the row whose bias holds the NaN is NaN
// (output, LSE, that query's dq, and the dk and dv of every key the row sees), on every
// backend alike; a NaN behind a
// key that something else removes (a false bool entry, key_lengths, causality) is never
// read; every other row is untouched. The cpu backend against the reference, forward and
// backward, over tile shapes (one tile, several, a shared per-call tile for heads that
// broadcast) and layouts.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/problem.hpp"
#include "cpu_check.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;
using test::CpuCase;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct NanSpot {
  int64_t head, query, key;
};

// Whether query row (b, i, h) of a [B, N, H, x] tensor is all NaN, or all finite.
template <class T>
bool row_is(const Tensor<T, 4>& t, int64_t b, int64_t i, int64_t h, bool nan) {
  for (int64_t x = 0; x < t.shape()[3]; ++x)
    if (std::isnan(static_cast<double>(t(b, i, h, x))) != nan) return false;
  return true;
}

// The same NaN pattern (by element) in the cpu result as in the reference, and the finite
// elements within the usual rule.
template <int R>
void expect_same_nans(const char* what, const Tensor<float, R>& cpu, const Tensor<double, R>& ref) {
  int64_t mismatched = 0, nans = 0;
  for (std::size_t e = 0; e < cpu.size(); ++e) {
    mismatched += std::isnan(cpu[e]) != std::isnan(ref[e]);
    nans += std::isnan(ref[e]);
  }
  EXPECT_EQ(mismatched, 0) << what << ": NaN elements differ from the reference (" << nans << " NaN there)";
}

template <int R>
void expect_finite_close(const char* what, const Tensor<float, R>& cpu, const Tensor<double, R>& ref) {
  double worst = 0.0, largest = 0.0;
  for (std::size_t e = 0; e < cpu.size(); ++e) {
    if (!std::isfinite(ref[e]) || !std::isfinite(cpu[e])) continue;  // NaN patterns: checked apart
    worst = std::max(worst, std::abs(static_cast<double>(cpu[e]) - ref[e]));
    largest = std::max(largest, std::abs(ref[e]));
  }
  EXPECT_LE(worst, 1e-5 * std::max(1.0, largest)) << what;
}

void check(const CaseSpec& spec, const std::vector<NanSpot>& spots, bool bhsd, const std::string& label) {
  SCOPED_TRACE(label);
  Case<float> c(spec, 77);
  ASSERT_GT(c.bias.size(), 0u);
  // The case's bias is [1, Hq, Nq, Nk]; a head-broadcast bias is made here when asked.
  for (const NanSpot& s : spots) c.bias(0, s.head, s.query, s.key) = kNaN;
  const auto dout = test::random_tensor<float, 4>({spec.batch, spec.q_len, spec.q_heads, spec.v_dim}, 5);
  const test::Results cpu = test::run_cpu(c, CpuCase{.spec = spec, .bhsd = bhsd}, &dout);
  const test::Reference ref = test::run_reference(c, &dout);
  for (const NanSpot& s : spots)
    for (int64_t b = 0; b < spec.batch; ++b) {
      EXPECT_TRUE(row_is(ref.out, b, s.query, s.head, true)) << "reference row " << s.query << " not NaN";
      EXPECT_TRUE(row_is(cpu.out, b, s.query, s.head, true)) << "cpu row " << s.query << " not NaN";
      EXPECT_TRUE(std::isnan(cpu.lse(b, s.head, s.query))) << "cpu lse of row " << s.query;
    }
  expect_same_nans("out", cpu.out, ref.out);
  expect_same_nans("lse", cpu.lse, ref.lse);
  expect_same_nans("dq", cpu.dq, ref.dq);
  // dK and dV: NaN for every key that takes part in a NaN row, as in PyTorch (whose
  // gradients of the keys such a row does not see are NaN too; qkv's are unspecified).
  const int64_t group = spec.q_heads / spec.kv_heads;
  for (const NanSpot& s : spots)
    for (int64_t b = 0; b < spec.batch; ++b)
      for (int64_t j = 0; j < spec.k_len; ++j) {
        if (c.bias(0, s.head, s.query, j) == -INFINITY) continue;
        const int64_t kv = s.head / group;
        EXPECT_TRUE(row_is(cpu.dk, b, j, kv, true) && row_is(cpu.dv, b, j, kv, true)) << "cpu dk/dv of key " << j;
        EXPECT_TRUE(row_is(ref.dk, b, j, kv, true) && row_is(ref.dv, b, j, kv, true)) << "reference dk/dv of key " << j;
      }
  expect_finite_close("out", cpu.out, ref.out);
  expect_finite_close("dq", cpu.dq, ref.dq);
  expect_finite_close("dk", cpu.dk, ref.dk);
  expect_finite_close("dv", cpu.dv, ref.dv);
}

TEST(MaskNaN, NaNBiasMakesItsRowNaNOnEveryBackend) {
  const CaseSpec one_tile{.name = "one_tile", .batch = 2, .q_len = 20, .k_len = 30, .q_heads = 2,
                          .kv_heads = 1, .head_dim = 8, .v_dim = 8, .bias_mask = true};
  const CaseSpec tiles{.name = "several_tiles", .batch = 1, .q_len = 130, .k_len = 150, .q_heads = 2,
                       .kv_heads = 2, .head_dim = 16, .v_dim = 16, .bias_mask = true};
  const CaseSpec decode_shaped{.name = "decode_shaped", .batch = 1, .q_len = 3, .k_len = 40, .q_heads = 1,
                               .kv_heads = 1, .head_dim = 8, .v_dim = 8, .bias_mask = true};
  for (const bool bhsd : {false, true}) {
    check(one_tile, {{0, 3, 7}}, bhsd, "one tile");
    check(tiles, {{1, 0, 149}, {0, 70, 64}, {1, 129, 0}}, bhsd, "several tiles");
    check(decode_shaped, {{0, 2, 39}}, bhsd, "three queries");
  }
}

TEST(MaskNaN, NaNBehindARemovedKeyIsNeverRead) {
  // Causal: query 3 of a top-left causal call never sees key 10, so its NaN stays out.
  CaseSpec spec{.name = "causal", .batch = 1, .q_len = 20, .k_len = 20, .q_heads = 1, .kv_heads = 1,
                .head_dim = 8, .v_dim = 8, .causal = Causal::top_left, .bias_mask = true};
  Case<float> c(spec, 3);
  c.bias(0, 0, 3, 10) = kNaN;
  const auto dout = test::random_tensor<float, 4>({1, 20, 1, 8}, 5);
  const test::Results cpu = test::run_cpu(c, CpuCase{.spec = spec}, &dout);
  const test::Reference ref = test::run_reference(c, &dout);
  EXPECT_TRUE(row_is(cpu.out, 0, 3, 0, false));
  expect_same_nans("out", cpu.out, ref.out);
  expect_same_nans("dq", cpu.dq, ref.dq);
  expect_finite_close("out", cpu.out, ref.out);
}

}  // namespace
}  // namespace qkv
