// qkv::BlockSparseMask (qkv/block_sparse.hpp), FlexAttention's block mask: the cpu
// kernels against the fp64 reference, forward and backward, for blocks of every kind
// (empty, full, partial) at block sizes that do and do not divide the 64-wide tiles,
// broadcast over batch and heads or not; against the same mask given densely
// (mask.keep); and its checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "modifier_check.hpp"
#include "qkv/block_sparse.hpp"

namespace qkv {
namespace {

using test::Case;
using test::CaseSpec;
using namespace test::modifiers;

// A random block mask over [batch, heads, Nq, Nk] (batch, heads: 1 to broadcast) and the
// same mask as a dense keep mask [batch, heads, Nq, Nk].
struct RandomBlocks {
  Tensor<std::uint8_t, 4> state, dense;
  Tensor<int32_t, 4> slot;
  Tensor<std::uint8_t, 3> bytes;
  BlockSparseView view;

  RandomBlocks(int64_t batch, int64_t heads, int64_t q_len, int64_t k_len, int64_t bq,
               int64_t bk, std::uint64_t seed) {
    const int64_t qbs = (q_len + bq - 1) / bq, kbs = (k_len + bk - 1) / bk;
    state = Tensor<std::uint8_t, 4>({batch, heads, qbs, kbs});
    slot = Tensor<int32_t, 4>({batch, heads, qbs, kbs});
    std::mt19937_64 rng(seed);
    int32_t partial = 0;
    for (std::size_t n = 0; n < state.size(); ++n) {
      state[n] = static_cast<std::uint8_t>(rng() % 3);
      slot[n] = state[n] == BlockSparseMask::kPartial ? partial++ : -1;
    }
    bytes = Tensor<std::uint8_t, 3>({std::max<int32_t>(partial, 1), bk, bq});
    for (std::size_t n = 0; n < bytes.size(); ++n) bytes[n] = rng() % 3 != 0;
    dense = Tensor<std::uint8_t, 4>({batch, heads, q_len, k_len});
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < q_len; ++i)
          for (int64_t j = 0; j < k_len; ++j) {
            const std::uint8_t kind = state(b, h, i / bq, j / bk);
            dense(b, h, i, j) = kind == BlockSparseMask::kFull ||
                                (kind == BlockSparseMask::kPartial &&
                                 bytes(slot(b, h, i / bq, j / bk), j % bk, i % bq) != 0);
          }
    view = {.block_q = bq, .block_k = bk, .state = state.cview(), .slot = slot.cview(),
            .bytes = bytes.cview()};
  }
};

// Largest |a − b|, equal values (the −inf LSE of a row with no key) counting 0.
template <int R>
double diff(const Tensor<float, R>& a, const Tensor<float, R>& b) {
  double worst = 0.0;
  for (std::size_t n = 0; n < a.size(); ++n)
    if (a[n] != b[n]) worst = std::max(worst, std::fabs(static_cast<double>(a[n]) - b[n]));
  return worst;
}

struct Layout {
  int64_t batch, heads, block_q, block_k;
};

class BlockSparse : public ::testing::TestWithParam<Layout> {};

TEST_P(BlockSparse, MatchesTheReferenceAndTheDenseMask) {
  const Layout l = GetParam();
  CaseSpec spec = kShape;
  spec.causal = Causal::top_left;
  const int64_t heads = l.heads == 1 ? 1 : spec.q_heads, batch = l.batch == 1 ? 1 : spec.batch;
  RandomBlocks blocks(batch, heads, spec.q_len, spec.k_len, l.block_q, l.block_k, 7);
  const BlockSparseMask mask(blocks.view);
  Case<float> sparse(spec, 21), dense(spec, 21);
  sparse.options.modifiers.mask = mask;
  dense.options.mask.keep = blocks.dense.cview();
  expect_near_reference(sparse);
  const test::Results a = run(sparse), b = run(dense);
  EXPECT_LE(diff(a.out, b.out), 1e-6);
  EXPECT_LE(diff(a.lse, b.lse), 1e-6);
  EXPECT_LE(diff(a.dq, b.dq), 1e-5);
  EXPECT_LE(diff(a.dk, b.dk), 1e-5);
  EXPECT_LE(diff(a.dv, b.dv), 1e-5);
  EXPECT_TRUE(same_results(a, run(sparse, 1)));  // any thread count, the same bits
}

INSTANTIATE_TEST_SUITE_P(Layouts, BlockSparse,
                         ::testing::Values(Layout{1, 1, 128, 128}, Layout{2, 4, 64, 64},
                                           Layout{2, 1, 16, 48}, Layout{1, 4, 100, 30}));

TEST(BlockSparse, RefusesAnInconsistentView) {
  RandomBlocks blocks(1, 1, 40, 40, 16, 16, 3);
  BlockSparseView bad = blocks.view;
  bad.block_k = 0;
  EXPECT_THROW(BlockSparseMask{bad}, Error);
  bad = blocks.view;
  bad.bytes.shape[1] = 8;
  EXPECT_THROW(BlockSparseMask{bad}, Error);
  blocks.state[0] = BlockSparseMask::kPartial;
  blocks.slot[0] = 1 << 20;
  EXPECT_THROW(BlockSparseMask{blocks.view}, Error);
  blocks.state[0] = 3;
  EXPECT_THROW(BlockSparseMask{blocks.view}, Error);
}

}  // namespace
}  // namespace qkv
