// The tile plan built from mask_mod: tiles it empties are never scored, fully visible
// ones run without the mask, and per-head masks get per-head tile classes.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "core/tile_plan.hpp"
#include "modifier_check.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;
using namespace test::modifiers;

// ---------------------------------------------------------------------------------------
// The plan.

detail::MaskRule dense_rule(int64_t batch, int64_t q_len, int64_t k_len) {
  detail::MaskRule rule;
  rule.sequences = {.count = batch, .dense_q_len = q_len, .dense_k_len = k_len};
  return rule;
}

// A block-diagonal mask_mod: only the 64×64 tiles on the diagonal are non-empty, and full.
TEST(MaskModPlan, BlockDiagonalTilesAreFullAndTheRestEmpty) {
  const auto blocks = mask_mod(
      [](int64_t, int64_t, int64_t i, int64_t j) { return i / 64 == j / 64; });
  detail::MaskRule rule = dense_rule(1, 200, 200);
  rule.mask_mod = blocks;
  const detail::Extents e{.batch = 1, .q_len = 200, .k_len = 200, .q_heads = 2, .kv_heads = 1,
                          .head_dim = 8, .v_dim = 8};
  const detail::TilePlan plan(rule, e, 64, 64, 2);
  EXPECT_TRUE(plan.per_head());
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t qb = 0; qb < 4; ++qb) {
      EXPECT_EQ(plan.busy_key_blocks(0, h, qb), 1);
      for (int64_t kb = 0; kb < 4; ++kb)
        EXPECT_EQ(plan.at(0, h, qb, kb), qb == kb ? detail::Tile::full : detail::Tile::empty)
            << qb << ", " << kb;
    }
}

// Per-head masks give per-head classes; the plan evaluates only pairs the other masks
// leave (causality here), so a mask_mod that is false above the diagonal never matters.
TEST(MaskModPlan, PerHeadClassesAndOnlyVisiblePairsEvaluated) {
  std::atomic<int64_t> above_diagonal{0};
  const auto shifted = mask_mod([&above_diagonal](int64_t, int64_t h, int64_t i, int64_t j) {
    if (j > i) above_diagonal.fetch_add(1, std::memory_order_relaxed);
    return j <= i - 64 * h;  // head h sees keys at least 64·h behind
  });
  detail::MaskRule rule = dense_rule(1, 256, 256);
  rule.causal = Causal::top_left;
  rule.mask_mod = shifted;
  const detail::Extents e{.batch = 1, .q_len = 256, .k_len = 256, .q_heads = 2, .kv_heads = 2,
                          .head_dim = 8, .v_dim = 8};
  const detail::TilePlan plan(rule, e, 64, 64, 1);
  EXPECT_EQ(above_diagonal.load(), 0);
  for (int64_t qb = 0; qb < 4; ++qb) {
    EXPECT_EQ(plan.at(0, 0, qb, qb), detail::Tile::partial);  // head 0: plain causal
    if (qb > 0) {
      EXPECT_EQ(plan.at(0, 0, qb, qb - 1), detail::Tile::full);
      EXPECT_EQ(plan.at(0, 1, qb, qb), detail::Tile::empty);  // head 1: one block further back
      EXPECT_EQ(plan.at(0, 1, qb, qb - 1), detail::Tile::partial);
    }
  }
  EXPECT_EQ(plan.busy_key_blocks(0, 1, 0), 0);
}

// Every score_mod call of a block-diagonal mask lies in a diagonal tile: empty tiles are
// never scored. The forward scores each diagonal tile exactly once per (entry, head).
TEST(MaskModPlan, ScoreModNeverRunsOnAnEmptyTile) {
  std::atomic<int64_t> calls{0}, off_diagonal{0};
  const auto counting = score_mod(
      [&](float s, int64_t, int64_t, int64_t i, int64_t j) {
        calls.fetch_add(1, std::memory_order_relaxed);
        if (i / 64 != j / 64) off_diagonal.fetch_add(1, std::memory_order_relaxed);
        return s;
      },
      [](float, int64_t, int64_t, int64_t, int64_t) { return 1.0f; });
  const auto blocks = mask_mod([](int64_t, int64_t, int64_t i, int64_t j) { return i / 64 == j / 64; },
                               {.varies_with_head = false});
  const CaseSpec spec{.name = "blocks", .batch = 2, .q_len = 200, .k_len = 200, .q_heads = 3,
                      .kv_heads = 1, .head_dim = 16, .v_dim = 16};
  Case<float> c(spec, 15);
  c.options.modifiers = {.score = counting, .mask = blocks};
  Tensor<float, 4> out({2, 200, 3, 16});
  Tensor<float, 3> lse({2, 3, 200});
  AttentionOptions options = c.options;
  options.execution.backend = Backend::cpu;
  attention_forward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.view(),
                     .lse = lse.view()}, options);
  const int64_t per_head = 3 * 64 * 64 + 8 * 8;  // the diagonal tiles of 200 = 3·64 + 8
  EXPECT_EQ(calls.load(), 2 * 3 * per_head);
  EXPECT_EQ(off_diagonal.load(), 0);
  // The backward too (its schedule may score a tile twice, but never an empty one).
  calls = 0;
  const auto dout = test::random_tensor<float, 4>({2, 200, 3, 16}, 4);
  Tensor<float, 4> dq(c.q.shape()), dk(c.k.shape()), dv(c.v.shape());
  attention_backward({.q = c.q.cview(), .k = c.k.cview(), .v = c.v.cview(), .out = out.cview(),
                      .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view()}, options);
  EXPECT_GE(calls.load(), 2 * 3 * per_head);
  EXPECT_EQ(off_diagonal.load(), 0);
  // And the result is block-diagonal attention: the reference agrees.
  expect_near_reference(c);
}

}  // namespace
}  // namespace qkv
