// Masks at full speed: the tile plan's classes (core/tile_plan.hpp) for every mask
// source, and the cpu backend against the reference on the structures real callers send
// (dense padding masks, finfo.min float masks, causal + padding, per-head masks, rows
// that a mask removes entirely, "degenerate" finfo.min rows).
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <vector>

#include "core/tile_plan.hpp"
#include "cpu_check.hpp"

namespace qkv {
namespace {

using detail::Tile;
using test::Case;
using test::CaseSpec;
using test::CpuCase;

constexpr float kFinfoMin = std::numeric_limits<float>::lowest();  // torch.finfo(float32).min

// A mask rule over a dense call, as validation would build it (broadcast axes stride 0).
detail::MaskRule dense_rule(int64_t batch, int64_t q_len, int64_t k_len, Causal causal = Causal::none) {
  detail::MaskRule rule;
  rule.causal = causal;
  rule.sequences = {.count = batch, .dense_q_len = q_len, .dense_k_len = k_len};
  return rule;
}

template <class T>
View4<const T> broadcast(const Tensor<T, 4>& t, int64_t batch, int64_t heads, int64_t q_len) {
  View4<const T> v = t.cview();
  const int64_t full[3] = {batch, heads, q_len};
  for (int axis = 0; axis < 3; ++axis) {
    if (v.shape[axis] == 1 && full[axis] != 1) v.strides[axis] = 0;
    v.shape[axis] = full[axis];
  }
  return v;
}

detail::Extents extents(int64_t batch, int64_t q_len, int64_t k_len, int64_t heads = 1) {
  return {.batch = batch, .q_len = q_len, .k_len = k_len, .q_heads = heads, .kv_heads = heads,
          .head_dim = 8, .v_dim = 8};
}

TEST(TilePlan, CausalDiagonalIsPartialBelowFullAboveEmpty) {
  const auto rule = dense_rule(1, 192, 192, Causal::top_left);
  const detail::TilePlan plan(rule, extents(1, 192, 192), 64, 64, 1);
  for (int64_t qb = 0; qb < 3; ++qb)
    for (int64_t kb = 0; kb < 3; ++kb)
      EXPECT_EQ(plan.at(0, 0, qb, kb), kb < qb ? Tile::full : kb == qb ? Tile::partial : Tile::empty)
          << qb << "," << kb;
  EXPECT_EQ(plan.busy_key_blocks(0, 0, 2), 3);
  EXPECT_EQ(plan.first_key_block(0, 0, 1), 0);
  EXPECT_EQ(plan.last_key_block(0, 0, 1), 1);
}

TEST(TilePlan, KeyLengthsEmptyThePadding) {
  auto rule = dense_rule(2, 64, 200);
  const std::vector<int64_t> lengths{200, 70};
  rule.key_lengths = lengths;
  const detail::TilePlan plan(rule, extents(2, 64, 200), 64, 64, 1);
  const Tile entry1[4] = {Tile::full, Tile::partial, Tile::empty, Tile::empty};
  for (int64_t kb = 0; kb < 4; ++kb) {
    EXPECT_EQ(plan.at(0, 0, 0, kb), Tile::full) << kb;  // the short last block is full too
    EXPECT_EQ(plan.at(1, 0, 0, kb), entry1[kb]) << kb;
  }
  EXPECT_EQ(plan.busy_key_blocks(1, 0, 0), 2);
}

// A dense mask that is really key padding gives the classes of key_lengths, whatever its
// form: bool [B,1,N,N], bool [B,1,1,N], float [B,1,N,N] with finfo.min.
TEST(TilePlan, DensePaddingMasksClassifyAsKeyLengths) {
  const int64_t B = 2, N = 200;
  const std::vector<int64_t> lengths{200, 70};
  auto reference = dense_rule(B, N, N);
  reference.key_lengths = lengths;
  const detail::TilePlan expected(reference, extents(B, N, N), 64, 64, 1);

  Tensor<std::uint8_t, 4> keep_full({B, 1, N, N}), keep_row({B, 1, 1, N});
  Tensor<float, 4> bias({B, 1, N, N});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < N; ++j) {
      keep_row(b, 0, 0, j) = j < lengths[b];
      for (int64_t i = 0; i < N; ++i) {
        keep_full(b, 0, i, j) = j < lengths[b];
        bias(b, 0, i, j) = j < lengths[b] ? 0.0f : kFinfoMin;
      }
    }
  for (int form = 0; form < 3; ++form) {
    auto rule = dense_rule(B, N, N);
    if (form == 0) rule.keep = broadcast(keep_full, B, 4, N);
    if (form == 1) rule.keep = broadcast(keep_row, B, 4, N);
    if (form == 2) rule.bias = broadcast(bias, B, 4, N);
    const detail::TilePlan plan(rule, extents(B, N, N, 4), 64, 64, 2);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < 4; ++h)
        for (int64_t qb = 0; qb < 4; ++qb)
          for (int64_t kb = 0; kb < 4; ++kb)
            EXPECT_EQ(plan.at(b, h, qb, kb), expected.at(b, 0, qb, kb))
                << "form " << form << " at " << b << "," << h << "," << qb << "," << kb;
  }
}

TEST(TilePlan, CausalPlusPaddingAsOneDenseMask) {
  const int64_t N = 192, valid = 100;
  Tensor<std::uint8_t, 4> keep({1, 1, N, N});
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < N; ++j) keep(0, 0, i, j) = j <= i && j < valid;
  auto rule = dense_rule(1, N, N);
  rule.keep = broadcast(keep, 1, 1, N);
  const detail::TilePlan plan(rule, extents(1, N, N), 64, 64, 1);
  EXPECT_EQ(plan.at(0, 0, 0, 0), Tile::partial);
  EXPECT_EQ(plan.at(0, 0, 1, 0), Tile::full);
  EXPECT_EQ(plan.at(0, 0, 1, 1), Tile::partial);
  EXPECT_EQ(plan.at(0, 0, 2, 1), Tile::partial);  // padding edge at key 100
  EXPECT_EQ(plan.at(0, 0, 2, 2), Tile::empty);    // past the padding and the diagonal
  EXPECT_EQ(plan.at(0, 0, 0, 1), Tile::empty);
}

// A block that the mask removes entirely in one head but not in another.
TEST(TilePlan, PerHeadMasksClassifyPerHead) {
  const int64_t N = 128, H = 2;
  Tensor<std::uint8_t, 4> keep({1, H, N, N});
  test::fill(keep, std::uint8_t{1});
  for (int64_t i = 0; i < 64; ++i)
    for (int64_t j = 64; j < N; ++j) keep(0, 0, i, j) = 0;  // head 0: tile (0, 1) removed
  keep(0, 1, 70, 3) = 0;                                    // head 1: tile (1, 0) partial
  auto rule = dense_rule(1, N, N);
  rule.keep = keep.cview();
  const detail::TilePlan plan(rule, extents(1, N, N, H), 64, 64, 1);
  EXPECT_EQ(plan.at(0, 0, 0, 1), Tile::empty);
  EXPECT_EQ(plan.at(0, 1, 0, 1), Tile::full);
  EXPECT_EQ(plan.at(0, 0, 1, 0), Tile::full);
  EXPECT_EQ(plan.at(0, 1, 1, 0), Tile::partial);
  EXPECT_TRUE(plan.any_partial_in_key_block(0, 1, 0));
  EXPECT_FALSE(plan.any_partial_in_key_block(0, 0, 1));
}

TEST(TilePlan, NonZeroBiasIsPartialAllTrueBoolIsFull) {
  const int64_t N = 64;
  Tensor<std::uint8_t, 4> keep({1, 1, 1, N});
  test::fill(keep, std::uint8_t{1});
  Tensor<float, 4> bias({1, 1, N, N});
  bias(0, 0, 5, 7) = 0.5f;
  auto with_keep = dense_rule(1, N, N);
  with_keep.keep = broadcast(keep, 1, 1, N);
  EXPECT_EQ(detail::TilePlan(with_keep, extents(1, N, N), 64, 64, 1).at(0, 0, 0, 0), Tile::full);
  auto with_bias = dense_rule(1, N, N);
  with_bias.bias = bias.cview();
  EXPECT_EQ(detail::TilePlan(with_bias, extents(1, N, N), 64, 64, 1).at(0, 0, 0, 0), Tile::partial);
}

// finfo.min everywhere in a row: the row is degenerate (kept literally, as PyTorch
// does), so its tiles are not skipped; a row with one normal key is not degenerate.
TEST(TilePlan, FinfoMinRowsAreDegenerateAndNotSkipped) {
  const int64_t N = 128;
  Tensor<float, 4> bias({1, 1, N, N});
  test::fill(bias, kFinfoMin);
  for (int64_t i = 64; i < N; ++i) bias(0, 0, i, 100) = 0.0f;  // rows 64.. see key 100
  bias(0, 0, 3, 5) = -INFINITY;
  auto rule = dense_rule(1, N, N);
  rule.bias = bias.cview();
  const detail::TilePlan plan(rule, extents(1, N, N), 64, 64, 1);
  const float* shifts = plan.degenerate_rows(0, 0, 0);
  ASSERT_NE(shifts, nullptr);
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_EQ(shifts[i] != 0.0f, i < 64) << i;
    EXPECT_EQ(shifts[i] != 0.0f, rule.degenerate_row(0, 0, i)) << i;  // the reference's rule
    if (i < 64) {
      EXPECT_EQ(shifts[i], kFinfoMin) << i;
    }
  }
  EXPECT_EQ(plan.at(0, 0, 0, 0), Tile::partial);
  EXPECT_EQ(plan.at(0, 0, 0, 1), Tile::partial);
  EXPECT_EQ(plan.at(0, 0, 1, 0), Tile::empty);  // finfo.min removes keys of normal rows
  EXPECT_EQ(plan.at(0, 0, 1, 1), Tile::partial);
}

// ---- cpu against the reference on real mask structures ----------------------------

struct MaskCase {
  const char* name;
  CaseSpec spec;
  int form;  // see prepare()
};

std::ostream& operator<<(std::ostream& out, const MaskCase& m) { return out << m.name; }

// Replaces the case's masks by one of the structures transformers and PyTorch users send.
void prepare(Case<float>& c, int form) {
  const CaseSpec& s = c.spec;
  const int64_t B = s.batch, H = s.q_heads, Nq = s.q_len, Nk = s.k_len;
  auto length = [&](int64_t b) { return b == 0 ? Nk : std::max<int64_t>(0, Nk / 2 - 7 * b); };
  c.options.mask = {};
  switch (form) {
    case 0:  // bool [B,1,1,Nk] key padding
      c.keep = Tensor<std::uint8_t, 4>({B, 1, 1, Nk});
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < Nk; ++j) c.keep(b, 0, 0, j) = j < length(b);
      c.options.mask.keep = c.keep.cview();
      break;
    case 1:  // bool [B,1,Nq,Nk] key padding, expanded as transformers does
    case 2:  // the same plus causal (one dense mask for both)
      c.keep = Tensor<std::uint8_t, 4>({B, 1, Nq, Nk});
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Nq; ++i)
          for (int64_t j = 0; j < Nk; ++j) c.keep(b, 0, i, j) = j < length(b) && (form == 1 || j <= i);
      c.options.mask.keep = c.keep.cview();
      break;
    case 3:  // float [B,1,Nq,Nk], finfo.min at padding, plus causal: left-padded rows degenerate
      c.bias = Tensor<float, 4>({B, 1, Nq, Nk});
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Nq; ++i)
          for (int64_t j = 0; j < Nk; ++j) {
            const bool padding = j < Nk - length(b);  // left padding
            c.bias(b, 0, i, j) = padding || j > i ? kFinfoMin : 0.0f;
          }
      c.options.mask.bias = c.bias.cview();
      break;
    case 4:  // per-head bool mask: head 0 loses whole blocks, other heads single keys,
             // one row of head 1 loses every key
      c.keep = Tensor<std::uint8_t, 4>({B, H, Nq, Nk});
      test::fill(c.keep, std::uint8_t{1});
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Nq; ++i)
          for (int64_t j = 0; j < Nk; ++j) {
            if (j >= 64 && j < 128) c.keep(b, 0, i, j) = 0;
            if (H > 1 && (i + j) % 29 == 0) c.keep(b, 1, i, j) = 0;
            if (H > 1 && i == 3) c.keep(b, 1, i, j) = 0;
          }
      c.options.mask.keep = c.keep.cview();
      break;
    default:
      break;
  }
}

class CpuMasks : public ::testing::TestWithParam<MaskCase> {};

TEST_P(CpuMasks, WithinTwiceThePlainFp32Error) {
  const MaskCase& m = GetParam();
  Case<float> c(m.spec, 77);
  prepare(c, m.form);
  for (int threads : {1, 3}) test::check_prepared_case(c, {m.spec, false, false, threads});
}

std::vector<MaskCase> mask_cases() {
  std::vector<MaskCase> cases;
  const CaseSpec base{.name = "", .batch = 3, .q_len = 150, .k_len = 150, .q_heads = 2,
                      .kv_heads = 1, .head_dim = 32, .v_dim = 32};
  const char* names[] = {"bool_b11n_padding", "bool_b1nn_padding", "bool_causal_padding",
                         "float_finfo_min_left_padding_causal", "per_head_blocks_and_rows"};
  for (int form = 0; form < 5; ++form) cases.push_back({names[form], base, form});
  CaseSpec wide = base;
  wide.q_len = 70;
  wide.k_len = 260;
  cases.push_back({"bool_b1nn_padding_nq_lt_nk", wide, 1});
  cases.push_back({"per_head_nq_lt_nk", wide, 4});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Structures, CpuMasks, ::testing::ValuesIn(mask_cases()),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

// A dense padding mask and key_lengths describe the same keys: the same tiles are skipped
// and masked the same way, so the outputs are bitwise identical.
TEST(CpuMasks, PaddingMaskGivesTheBitsOfKeyLengths) {
  const CaseSpec spec{.name = "pad", .batch = 3, .q_len = 130, .k_len = 200, .q_heads = 2,
                      .kv_heads = 1, .head_dim = 64, .v_dim = 64, .key_padding = true};
  Case<float> with_lengths(spec, 3);
  Case<float> with_mask(spec, 3);
  with_mask.options.key_lengths = {};
  with_mask.keep = Tensor<std::uint8_t, 4>({3, 1, 130, 200});
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t i = 0; i < 130; ++i)
      for (int64_t j = 0; j < 200; ++j) with_mask.keep(b, 0, i, j) = j < with_lengths.key_lengths[b];
  with_mask.options.mask.keep = with_mask.keep.cview();
  const auto dout = test::random_tensor<float, 4>({3, 130, 2, 64}, 4);
  const test::Results a = test::run_cpu(with_lengths, {spec}, &dout);
  const test::Results b = test::run_cpu(with_mask, {spec}, &dout);
  auto same = [](const auto& x, const auto& y) {
    return std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same(a.out, b.out));
  EXPECT_TRUE(same(a.lse, b.lse));
  EXPECT_TRUE(same(a.dq, b.dq));
  EXPECT_TRUE(same(a.dk, b.dk));
  EXPECT_TRUE(same(a.dv, b.dv));
}

// The numerics contract (docs/numerics.md), kept by both backends: a removed key is not read. A −inf or
// finfo.min bias on a key whose K and V rows hold NaN leaves the row finite.
TEST(CpuMasks, RemovedKeysAreNotReadByEitherBackend) {
  const CaseSpec spec{.name = "nan", .q_len = 70, .k_len = 70, .head_dim = 16, .v_dim = 16};
  for (float removal : {-INFINITY, kFinfoMin}) {
    Case<float> c(spec, 8);
    c.bias = Tensor<float, 4>({1, 1, 70, 70});
    for (int64_t i = 0; i < 70; ++i) c.bias(0, 0, i, 66) = removal;
    c.options.mask.bias = c.bias.cview();
    c.k(0, 66, 0, 2) = std::nanf("");
    c.v(0, 66, 0, 5) = INFINITY;
    const auto dout = test::random_tensor<float, 4>({1, 70, 1, 16}, 9);
    const test::Results cpu = test::run_cpu(c, {spec}, &dout);
    const test::Reference ref = test::run_reference(c, &dout);
    EXPECT_TRUE(test::all_finite(cpu.out) && test::all_finite(cpu.dq) && test::all_finite(cpu.lse));
    EXPECT_TRUE(test::all_finite(ref.out) && test::all_finite(ref.dq) && test::all_finite(ref.lse));
    EXPECT_LE(test::error(cpu.out, ref.out), 1e-6);
    for (int64_t x = 0; x < 16; ++x) {
      EXPECT_EQ(cpu.dk(0, 66, 0, x), 0.0f);
      EXPECT_EQ(cpu.dv(0, 66, 0, x), 0.0f);
    }
  }
}

// A row whose every key has finfo.min keeps PyTorch's result: the plain average of the
// values (every logit rounds to ≈ finfo.min, so the softmax is uniform).
TEST(CpuMasks, DegenerateFinfoMinRowAveragesTheValues) {
  const CaseSpec spec{.name = "degenerate", .q_len = 5, .k_len = 70, .head_dim = 8, .v_dim = 4};
  Case<float> c(spec, 12);
  c.bias = Tensor<float, 4>({1, 1, 5, 70});
  for (int64_t i = 0; i < 5; ++i)
    for (int64_t j = 0; j < 70; ++j) c.bias(0, 0, i, j) = i == 2 || j % 2 ? kFinfoMin : 0.0f;
  c.options.mask.bias = c.bias.cview();
  const test::Results cpu = test::run_cpu(c, {spec}, nullptr);
  for (int64_t x = 0; x < 4; ++x) {
    double mean = 0.0;
    for (int64_t j = 0; j < 70; ++j) mean += c.v(0, j, 0, x);
    EXPECT_NEAR(cpu.out(0, 2, 0, x), mean / 70.0, 1e-6);
  }
  // The other rows take finfo.min as removal; the reference agrees on all of them.
  EXPECT_LE(test::error(cpu.out, test::run_reference(c, nullptr).out), 1e-6);
}

}  // namespace
}  // namespace qkv
