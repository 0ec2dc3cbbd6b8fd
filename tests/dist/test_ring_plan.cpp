// The ring schedule and the LSE merge, without MPI: sharding partitions the sequence,
// the block calls of all steps cover every visible (batch, query, key) triple exactly
// once and nothing else, zigzag balances causal work, merge_partials is exact.
#include <gtest/gtest.h>

#include <qkv/dist/ring_plan.hpp>
#include <qkv/merge.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "test_support.hpp"

namespace qkv::dist {
namespace {

constexpr Sharding kShardings[] = {Sharding::zigzag, Sharding::contiguous};

// Global row of each local row of rank r.
std::vector<int64_t> global_rows(int64_t length, int world, int rank, Sharding sharding) {
  std::vector<int64_t> rows;
  for (const Segment& s : shard_segments(length, world, rank, sharding))
    for (int64_t i = 0; i < s.length; ++i) rows.push_back(s.global_begin + i);
  return rows;
}

TEST(ShardSegments, PartitionTheSequence) {
  for (Sharding sharding : kShardings) {
    for (int world = 1; world <= 6; ++world) {
      for (int64_t length : {0, 1, 2, 5, 11, 12, 13, 100}) {
        std::vector<int> seen(static_cast<std::size_t>(length), 0);
        int64_t largest = 0, smallest = length;
        for (int rank = 0; rank < world; ++rank) {
          const auto rows = global_rows(length, world, rank, sharding);
          EXPECT_EQ(static_cast<int64_t>(rows.size()), shard_length(length, world, rank, sharding));
          for (int64_t row : rows) ++seen[static_cast<std::size_t>(row)];
          largest = std::max<int64_t>(largest, static_cast<int64_t>(rows.size()));
          smallest = std::min<int64_t>(smallest, static_cast<int64_t>(rows.size()));
        }
        for (int count : seen) EXPECT_EQ(count, 1) << "length " << length << " world " << world;
        EXPECT_LE(largest - smallest, sharding == Sharding::zigzag ? 2 : 1);
      }
    }
  }
}

TEST(ShardSegments, ZigzagHoldsChunksRAndMirror) {
  // 16 rows, 2 ranks → 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  const auto zero = shard_segments(16, 2, 0, Sharding::zigzag);
  ASSERT_EQ(zero.size(), 2u);
  EXPECT_EQ(zero[0].global_begin, 0);
  EXPECT_EQ(zero[1].global_begin, 12);
  EXPECT_EQ(zero[1].local_begin, 4);
  const auto one = shard_segments(16, 2, 1, Sharding::zigzag);
  EXPECT_EQ(one[0].global_begin, 4);
  EXPECT_EQ(one[1].global_begin, 8);
}

TEST(RingKvOwner, WalksBackwardsAroundTheRing) {
  EXPECT_EQ(ring_kv_owner(4, 1, 0), 1);
  EXPECT_EQ(ring_kv_owner(4, 1, 1), 0);
  EXPECT_EQ(ring_kv_owner(4, 1, 2), 3);
  EXPECT_EQ(ring_kv_owner(4, 1, 3), 2);
}

bool visible(const RingProblem& p, int64_t b, int64_t i, int64_t j) {
  const int64_t limit = p.key_lengths.empty() ? p.k_len : p.key_lengths[static_cast<std::size_t>(b)];
  if (j >= limit) return false;
  if (p.causal == Causal::top_left) return j <= i;
  if (p.causal == Causal::bottom_right) return j <= i + limit - p.q_len;
  return true;
}

// Every visible triple covered once, no other; every call's rows see a key. With
// max_rows > 0, each call is first cut by split_queries.
void expect_exact_cover(const RingProblem& p, int64_t max_rows = 0) {
  std::vector<int> cover(static_cast<std::size_t>(p.batch * p.q_len * p.k_len), 0);
  for (int rank = 0; rank < p.world; ++rank) {
    const auto q_rows = global_rows(p.q_len, p.world, rank, p.sharding);
    for (int step = 0; step < p.world; ++step) {
      const int owner = ring_kv_owner(p.world, rank, step);
      const auto k_rows = global_rows(p.k_len, p.world, owner, p.sharding);
      std::vector<BlockCall> calls;
      for (const BlockCall& whole : ring_block_calls(p, rank, owner)) {
        if (max_rows == 0) {
          calls.push_back(whole);
        } else {
          for (const BlockCall& piece : split_queries(whole, max_rows)) calls.push_back(piece);
        }
      }
      for (const BlockCall& c : calls) {
        ASSERT_LT(c.batch_begin, c.batch_end);
        ASSERT_LT(c.q_begin, c.q_end);
        ASSERT_LT(c.k_begin, c.k_end);
        const int64_t offset = (c.k_end - c.k_begin) - (c.q_end - c.q_begin);
        for (int64_t b = c.batch_begin; b < c.batch_end; ++b) {
          for (int64_t i = c.q_begin; i < c.q_end; ++i) {
            int seen = 0;
            for (int64_t j = c.k_begin; j < c.k_end; ++j) {
              const bool in_call = c.causal == Causal::none || j - c.k_begin <= i - c.q_begin + offset;
              if (!in_call) continue;
              ++seen;
              const int64_t gi = q_rows[static_cast<std::size_t>(i)], gj = k_rows[static_cast<std::size_t>(j)];
              ++cover[static_cast<std::size_t>((b * p.q_len + gi) * p.k_len + gj)];
            }
            EXPECT_GT(seen, 0) << "a call holds a query row that sees no key";
          }
        }
      }
    }
  }
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t i = 0; i < p.q_len; ++i)
      for (int64_t j = 0; j < p.k_len; ++j)
        ASSERT_EQ(cover[static_cast<std::size_t>((b * p.q_len + i) * p.k_len + j)], visible(p, b, i, j) ? 1 : 0)
            << "b " << b << " i " << i << " j " << j << " world " << p.world << " q_len " << p.q_len
            << " k_len " << p.k_len << " causal " << static_cast<int>(p.causal);
}

TEST(RingBlockCalls, CoverEveryVisiblePairExactlyOnce) {
  std::mt19937 rng(7);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int trial = 0; trial < 400; ++trial) {
    RingProblem p;
    p.world = pick(1, 5);
    p.sharding = kShardings[pick(0, 1)];
    p.batch = pick(1, 3);
    p.q_len = pick(0, 25);
    p.k_len = pick(0, 25);
    p.causal = static_cast<Causal>(pick(0, 2));
    std::vector<int64_t> lengths;
    if (pick(0, 1)) {
      for (int64_t b = 0; b < p.batch; ++b) lengths.push_back(pick(0, static_cast<int>(p.k_len)));
      p.key_lengths = lengths;
    }
    expect_exact_cover(p);
    expect_exact_cover(p, pick(1, 4));  // the same pairs after cutting calls into pieces
    if (HasFatalFailure()) return;
  }
}

// Causal work (visible pairs) per rank: zigzag is balanced, contiguous is not.
TEST(RingBlockCalls, ZigzagBalancesCausalWork) {
  for (Sharding sharding : kShardings) {
    const RingProblem p{.world = 4, .sharding = sharding, .batch = 1, .q_len = 4096, .k_len = 4096,
                        .causal = Causal::top_left};
    std::vector<double> work;
    for (int rank = 0; rank < p.world; ++rank) {
      double pairs = 0;
      for (int step = 0; step < p.world; ++step) {
        for (const BlockCall& c : ring_block_calls(p, rank, ring_kv_owner(p.world, rank, step))) {
          const double nq = static_cast<double>(c.q_end - c.q_begin), nk = static_cast<double>(c.k_end - c.k_begin);
          // bottom_right: row i sees i + (nk − nq) + 1 keys.
          pairs += c.causal == Causal::none ? nq * nk : nq * (nk - nq + 1) + nq * (nq - 1) / 2.0;
        }
      }
      work.push_back(pairs);
    }
    const double ratio = *std::max_element(work.begin(), work.end()) / *std::min_element(work.begin(), work.end());
    if (sharding == Sharding::zigzag) {
      EXPECT_LT(ratio, 1.01);
    } else {
      EXPECT_GT(ratio, 5.0);  // the last rank sees 7x the first rank's keys
    }
  }
}

TEST(RingBlockCalls, BadProblemsThrowNamingTheField) {
  const std::vector<int64_t> lengths{3, 9};
  RingProblem p{.world = 2, .batch = 2, .q_len = 8, .k_len = 8, .key_lengths = lengths};
  EXPECT_THROW(
      {
        try {
          ring_block_calls(p, 0, 0);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("key_lengths[1]"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  p.key_lengths = {};
  EXPECT_THROW(ring_block_calls(p, 2, 0), Error);
  EXPECT_THROW(ring_block_calls(p, 0, -1), Error);
  EXPECT_THROW(shard_segments(-1, 2, 0, Sharding::zigzag), Error);
  EXPECT_THROW(shard_segments(4, 0, 0, Sharding::zigzag), Error);
}

TEST(ShardInto, RoundTrips) {
  const auto global = test::random_tensor<float, 4>({2, 13, 3, 5}, 1);
  Tensor<float, 4> back({2, 13, 3, 5});
  for (Sharding sharding : kShardings) {
    test::fill(back, 0.0f);
    for (int rank = 0; rank < 3; ++rank) {
      Tensor<float, 4> local({2, shard_length(13, 3, rank, sharding), 3, 5});
      shard_into(global.cview(), local.view(), 3, rank, sharding);
      unshard_into(local.cview(), back.view(), 3, rank, sharding);
    }
    EXPECT_EQ(test::max_abs_diff(global, back), 0.0);
  }
  Tensor<float, 4> wrong({2, 4, 3, 5});
  EXPECT_THROW(shard_into(global.cview(), wrong.view(), 3, 0, Sharding::zigzag), Error);
}

// Attention over keys [0, split) merged with attention over [split, N) equals attention
// over all N keys, to the rounding of the fp32 partials.
TEST(MergePartials, TwoKeyRangesMakeTheWhole) {
  const int64_t B = 2, N = 40, Nk = 70, H = 3, d = 16, split = 23;
  const auto q = test::random_tensor<float, 4>({B, N, H, d}, 11);
  const auto k = test::random_tensor<float, 4>({B, Nk, H, d}, 12);
  const auto v = test::random_tensor<float, 4>({B, Nk, H, d}, 13);
  auto keys = [&](const Tensor<float, 4>& t, int64_t begin, int64_t end) {
    const auto view = t.cview();
    return View4<const float>(view.data + begin * view.strides[1], {B, end - begin, H, d}, view.strides);
  };
  Tensor<float, 4> whole({B, N, H, d}), part_a({B, N, H, d}), part_b({B, N, H, d});
  Tensor<float, 3> whole_lse({B, H, N}), lse_a({B, H, N}), lse_b({B, H, N});
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = whole.view(), .lse = whole_lse.view()});
  attention_forward({.q = q.cview(), .k = keys(k, 0, split), .v = keys(v, 0, split), .out = part_a.view(),
                     .lse = lse_a.view()});
  attention_forward({.q = q.cview(), .k = keys(k, split, Nk), .v = keys(v, split, Nk), .out = part_b.view(),
                     .lse = lse_b.view()});
  merge_partials(part_a.view(), lse_a.view(), part_b.cview(), lse_b.cview());
  // Each weight exp(lse_x − lse) carries the fp32 rounding of lse_x, a relative error of
  // a few eps·|lse|, on outputs of size up to max|v|; both sides carry the kernel's own
  // rounding (a few eps·max|v|) too.
  double max_lse = 1.0, max_v = 0.0;
  for (std::size_t i = 0; i < whole_lse.size(); ++i) max_lse = std::max<double>(max_lse, std::abs(whole_lse[i]));
  for (std::size_t i = 0; i < v.size(); ++i) max_v = std::max<double>(max_v, std::abs(v[i]));
  const double eps = std::numeric_limits<float>::epsilon();
  EXPECT_LE(test::max_abs_diff(part_a, whole), 8 * eps * max_lse * max_v);
  EXPECT_LE(test::max_abs_diff(lse_a, whole_lse), 8 * eps * max_lse);
}

TEST(MergePartials, EmptyPartsAndNaN) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  Tensor<float, 4> out({1, 3, 1, 2}), part({1, 3, 1, 2});
  Tensor<float, 3> lse({1, 1, 3}), part_lse({1, 1, 3});
  // Row 0: accumulator empty, part has keys. Row 1: part empty. Row 2: part NaN.
  lse[0] = -inf, lse[1] = 0.5f, lse[2] = 0.0f;
  part_lse[0] = 1.0f, part_lse[1] = -inf, part_lse[2] = std::nanf("");
  out(0, 1, 0, 0) = 3.0f, out(0, 1, 0, 1) = 4.0f;
  part(0, 0, 0, 0) = 5.0f, part(0, 0, 0, 1) = 6.0f;
  merge_partials(out.view(), lse.view(), part.cview(), part_lse.cview());
  EXPECT_EQ(lse[0], 1.0f);
  EXPECT_EQ(out(0, 0, 0, 0), 5.0f);
  EXPECT_EQ(out(0, 0, 0, 1), 6.0f);
  EXPECT_EQ(lse[1], 0.5f);
  EXPECT_EQ(out(0, 1, 0, 0), 3.0f);
  EXPECT_TRUE(std::isnan(lse[2]));
  EXPECT_TRUE(std::isnan(out(0, 2, 0, 0)));
  // Both empty: stays 0 and −inf.
  Tensor<float, 4> zero({1, 1, 1, 2}), empty_part({1, 1, 1, 2});
  Tensor<float, 3> none({1, 1, 1}), none_part({1, 1, 1});
  none[0] = -inf, none_part[0] = -inf;
  merge_partials(zero.view(), none.view(), empty_part.cview(), none_part.cview());
  EXPECT_EQ(none[0], -inf);
  EXPECT_EQ(zero[0], 0.0f);
}

TEST(MergePartials, ShapeMismatchThrowsBeforeWriting) {
  Tensor<float, 4> out({1, 3, 2, 4}), part({1, 3, 2, 5});
  Tensor<float, 3> lse({1, 2, 3}), part_lse({1, 2, 3});
  try {
    merge_partials(out.view(), lse.view(), part.cview(), part_lse.cview());
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("part_out.shape[3]"), std::string::npos) << e.what();
  }
  Tensor<float, 3> wrong_lse({1, 3, 2});
  EXPECT_THROW(merge_partials(out.view(), wrong_lse.view(), out.cview(), lse.cview()), Error);
}

}  // namespace
}  // namespace qkv::dist
