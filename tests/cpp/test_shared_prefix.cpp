// qkv::BatchPlan with shared prefixes (layout.share_prefixes; qkv/batch_plan.hpp, "Shared
// prefixes").
//   - A step whose sequences share pool blocks (a system prompt all share, longer runs
//     pairs share, a prefill chunk, a draft tree, an empty sequence and sequences that
//     share nothing among them) over a shuffled pool of every storage type, against an
//     fp64 oracle written here over the stored values (every row past a sequence's keys is
//     NaN, so a pass that reads past its keys shows), on every compiled SIMD target.
//   - Tolerance, test_decode.cpp's rule with the plain plan as the yardstick: max |shared −
//     oracle64| ≤ 2·max |plain − oracle64| + 8·ε₃₂·max(1, max |oracle64|), plain the same
//     plan without share_prefixes. The shared run sums a partition of each row's keys and
//     merges the parts by LSE; it may round differently, not worse.
//   - Threads 1, 2 and 3 give the same bits; lse asked for or not, the same out; rows of
//     sequences in no group are bitwise the plain plan's.
//   - The groups found: the grouping that saves the most block reads, whole blocks only,
//     never a member's new tokens.
//   - A NaN in a member's own keys reaches only that member's rows; errors name the
//     argument and write nothing.
#include <gtest/gtest.h>

#include <qkv/batch_plan.hpp>
#include <qkv/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "simd_targets.hpp"
#include "step_options.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

using test::expect_error;
using test::same_bits;
using test::sink_logits;

// A sequence: the shared runs of blocks its table starts with (indices into Step's
// `runs`, in order), then `own` keys of its own — its new tokens the last `queries` of them.
struct SeqSpec {
  int64_t queries = 1;
  std::vector<int> runs;
  int64_t own = 1;
  bool tree = false;
};

struct Spec {
  std::vector<int64_t> runs;  // blocks in each shared run
  std::vector<SeqSpec> seqs;
  int64_t block_size = 16;
  int64_t q_heads = 8, kv_heads = 2, head_dim = 64, v_dim = 48;
  float softcap = 0.0f;
  bool sinks = false;
  std::uint64_t seed = 11;
};

template <class T>
T stored(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return T(x);
}

template <class T>
struct Step {
  static constexpr bool kScaled = std::is_same_v<T, std::int8_t> || is_float8(storage_type_of<T>);
  Spec spec;
  std::vector<int64_t> cu{0}, lengths, tree_offsets;
  std::vector<std::uint8_t> trees;
  Tensor<float, 3> q;
  Tensor<T, 4> k, v;
  Tensor<float, 3> k_scale, v_scale;
  Tensor<int32_t, 2> table;

  explicit Step(const Spec& s) : spec(s) {
    std::mt19937 rng(static_cast<unsigned>(s.seed));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const auto batch = static_cast<int64_t>(s.seqs.size());
    const int64_t shared_blocks = std::accumulate(s.runs.begin(), s.runs.end(), int64_t{0});
    int64_t own_blocks = 0, max_blocks = 1;
    for (const SeqSpec& seq : s.seqs) {
      int64_t blocks = (seq.own + s.block_size - 1) / s.block_size;
      own_blocks += blocks;
      for (const int r : seq.runs) blocks += s.runs[r];
      max_blocks = std::max(max_blocks, blocks);
    }
    const int64_t pool = shared_blocks + own_blocks + 2;  // 2 blocks nobody uses
    std::vector<int32_t> ids(static_cast<std::size_t>(pool));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int64_t> run_first(s.runs.size());
    int64_t next = 0;
    for (std::size_t r = 0; r < s.runs.size(); ++r) {
      run_first[r] = next;
      next += s.runs[r];
    }
    table = Tensor<int32_t, 2>({batch, max_blocks});
    std::fill(table.data(), table.data() + table.size(), -1);
    for (int64_t b = 0; b < batch; ++b) {
      const SeqSpec& seq = s.seqs[b];
      int64_t j = 0;
      for (const int r : seq.runs)
        for (int64_t x = 0; x < s.runs[r]; ++x) table(b, j++) = ids[run_first[r] + x];
      for (int64_t x = 0; x < (seq.own + s.block_size - 1) / s.block_size; ++x) table(b, j++) = ids[next++];
      lengths.push_back((j - (seq.own + s.block_size - 1) / s.block_size) * s.block_size + seq.own);
      cu.push_back(cu.back() + seq.queries);
      if (!seq.tree) {
        tree_offsets.push_back(-1);
        continue;
      }
      tree_offsets.push_back(static_cast<int64_t>(trees.size()));
      for (int64_t i = 0; i < seq.queries; ++i)  // a chain with a side branch at every other node
        for (int64_t x = 0; x < seq.queries; ++x) trees.push_back(x == i || (x < i && x % 2 == 0) ? 1 : 0);
    }
    q = Tensor<float, 3>({cu.back(), s.q_heads, s.head_dim});
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = normal(rng);
    k = Tensor<T, 4>({pool, s.block_size, s.kv_heads, s.head_dim});
    v = Tensor<T, 4>({pool, s.block_size, s.kv_heads, s.v_dim});
    k_scale = Tensor<float, 3>({pool, s.block_size, s.kv_heads});
    v_scale = Tensor<float, 3>({pool, s.block_size, s.kv_heads});
    const T poison = std::is_same_v<T, std::int8_t> ? T{} : stored<T>(std::nanf(""));
    std::fill(k.data(), k.data() + k.size(), poison);
    std::fill(v.data(), v.data() + v.size(), poison);
    std::fill(k_scale.data(), k_scale.data() + k_scale.size(), std::is_same_v<T, std::int8_t> ? std::nanf("") : 0.5f);
    std::fill(v_scale.data(), v_scale.data() + v_scale.size(), std::is_same_v<T, std::int8_t> ? std::nanf("") : 0.5f);
    std::vector<float> row(static_cast<std::size_t>(std::max(s.head_dim, s.v_dim)));
    for (int64_t b = 0; b < batch; ++b)  // shared rows are written once per sharer: the same values
      for (int64_t j = 0; j < lengths[b]; ++j)
        for (int64_t h = 0; h < s.kv_heads; ++h)
          for (const bool keys : {true, false}) {
            const int64_t dim = keys ? s.head_dim : s.v_dim;
            std::mt19937 row_rng(static_cast<unsigned>((table(b, j / s.block_size) * 131 + j % s.block_size) * 7 + h * 2 + keys));
            for (int64_t c = 0; c < dim; ++c) row[c] = normal(row_rng);
            const int64_t block = table(b, j / s.block_size), at = j % s.block_size;
            store_row(row.data(), dim, keys ? &k(block, at, h, 0) : &v(block, at, h, 0),
                      keys ? &k_scale(block, at, h) : &v_scale(block, at, h));
          }
  }

  // int8: one scale per row, max|x|/127 (as KVCache quantizes); float8: x / 0.5 rounded.
  static void store_row(const float* x, int64_t n, T* to, float* scale) {
    if constexpr (std::is_same_v<T, std::int8_t>) {
      float largest = 0.0f;
      for (int64_t c = 0; c < n; ++c) largest = std::max(largest, std::abs(x[c]));
      *scale = largest / 127.0f;
      for (int64_t c = 0; c < n; ++c) to[c] = static_cast<std::int8_t>(std::nearbyint(x[c] / *scale));
    } else if constexpr (kScaled) {
      for (int64_t c = 0; c < n; ++c) to[c] = T(x[c] / *scale);
    } else {
      for (int64_t c = 0; c < n; ++c) to[c] = stored<T>(x[c]);
    }
  }

  // Element c of key (or value) j of sequence b, head h, as the kernels read it.
  double element(bool keys, int64_t b, int64_t j, int64_t h, int64_t c) const {
    const int64_t block = table(b, j / spec.block_size), at = j % spec.block_size;
    const T x = keys ? k(block, at, h, c) : v(block, at, h, c);
    if constexpr (kScaled)
      return static_cast<double>(static_cast<float>(x) * (keys ? k_scale : v_scale)(block, at, h));
    else return static_cast<double>(static_cast<float>(x));
  }

  bool sees(int64_t b, int64_t i, int64_t j) const {
    const int64_t n = cu[b + 1] - cu[b], first_new = lengths[b] - n;
    if (tree_offsets[b] < 0) return j <= first_new + i;
    return j < first_new || trees[static_cast<std::size_t>(tree_offsets[b] + i * n + (j - first_new))] != 0;
  }

  BatchLayout layout(bool share) const {
    BatchLayout l;
    l.cu_seqlens_q = std::span<const int64_t>(cu);
    l.cache_lengths = std::span<const int64_t>(lengths);
    l.block_table = table.cview();
    l.block_size = spec.block_size;
    l.num_heads = spec.q_heads;
    l.num_kv_heads = spec.kv_heads;
    l.head_dim = spec.head_dim;
    l.v_dim = spec.v_dim;
    l.storage = storage_type_of<T>;
    if (!trees.empty()) {
      l.tree_mask = trees;
      l.tree_mask_offsets = std::span<const int64_t>(tree_offsets);
    }
    l.share_prefixes = share;
    return l;
  }
};

AttentionOptions options_for(const Spec& s, int threads = 2) {
  return test::step_options(s.softcap, s.sinks, s.q_heads, threads);
}

struct Results {
  Tensor<float, 3> out;
  Tensor<float, 2> lse;
};

template <class T>
Results run_plan(const Step<T>& step, bool share, const AttentionOptions& options, bool with_lse = true) {
  Results r{Tensor<float, 3>({step.cu.back(), step.spec.q_heads, step.spec.v_dim}),
            Tensor<float, 2>({step.spec.q_heads, step.cu.back()})};
  std::fill(r.out.data(), r.out.data() + r.out.size(), -7.0f);
  const BatchPlan plan(step.layout(share), options);
  BatchArgs<T> a;
  a.q = step.q.cview();
  a.k_cache = step.k.cview();
  a.v_cache = step.v.cview();
  a.out = r.out.view();
  if (with_lse) a.lse = r.lse.view();
  if constexpr (Step<T>::kScaled) {
    a.k_scale = step.k_scale.cview();
    a.v_scale = step.v_scale.cview();
  }
  plan.run(a);
  return r;
}

// Attention over the stored values in fp64 (the oracle).
template <class T>
Results oracle_of(const Step<T>& step, Tensor<double, 3>& out, Tensor<double, 2>& lse) {
  const Spec& s = step.spec;
  const int64_t group = s.q_heads / s.kv_heads;
  const std::vector<float> sinks = sink_logits(s.q_heads);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  for (std::size_t b = 0; b + 1 < step.cu.size(); ++b) {
    const auto seq = static_cast<int64_t>(b);
    const int64_t n = step.cu[b + 1] - step.cu[b], length = step.lengths[b];
    std::vector<double> logits(static_cast<std::size_t>(length));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < s.q_heads; ++h) {
        const int64_t row = step.cu[b] + i, g = h / group;
        double m = s.sinks ? sinks[h] : -INFINITY;
        for (int64_t j = 0; j < length; ++j) {
          if (!step.sees(seq, i, j)) continue;
          double dot = 0.0;
          for (int64_t c = 0; c < s.head_dim; ++c) dot += static_cast<double>(step.q(row, h, c)) * step.element(true, seq, j, g, c);
          double logit = scale * dot;
          if (s.softcap > 0.0f) logit = s.softcap * std::tanh(logit / s.softcap);
          logits[j] = logit;
          m = std::max(m, logit);
        }
        double l = s.sinks ? std::exp(sinks[h] - m) : 0.0;
        std::vector<double> acc(static_cast<std::size_t>(s.v_dim), 0.0);
        for (int64_t j = 0; j < length; ++j) {
          if (!step.sees(seq, i, j)) continue;
          const double p = std::exp(logits[j] - m);
          l += p;
          for (int64_t c = 0; c < s.v_dim; ++c) acc[c] += p * step.element(false, seq, j, g, c);
        }
        for (int64_t c = 0; c < s.v_dim; ++c) out(row, h, c) = acc[c] / l;
        lse(h, row) = m + std::log(l);
      }
  }
  return {};
}

template <int R>
double largest(const Tensor<double, R>& t) {
  double m = 0.0;
  for (std::size_t i = 0; i < t.size(); ++i) m = std::max(m, std::abs(t[i]));
  return m;
}

// Runs 0 (2 blocks) all of 0..5 share; runs 1 (9 blocks) 0 and 1 share after it, run 2 (9)
// 2 and 3: sharing 9 more blocks pairwise saves more reads than the 2 all share, so the
// groups are {0, 1} and {2, 3} (11 blocks each), and 4, 5 share run 0 with nobody left.
// Sequence 4 is a 40-query prefill chunk, 1 a 9-token draft tree; 6 is empty; 7 shares
// nothing; 8 and 9 share run 3 (3 blocks), 9's own keys start on a partial block.
Spec mixed_spec(std::uint64_t seed = 11) {
  return Spec{.runs = {2, 9, 9, 3},
              .seqs = {{1, {0, 1}, 40},
                       {9, {0, 1}, 30, true},
                       {1, {0, 2}, 200},
                       {3, {0, 2}, 3},
                       {40, {0}, 100},
                       {1, {0}, 17},
                       {0, {0, 1}, 5},
                       {1, {}, 700},
                       {2, {3}, 16},
                       {1, {3}, 9}},
              .seed = seed};
}

template <class T>
void check_storage(const Spec& spec) {
  SCOPED_TRACE(std::string("storage ") + storage_name(storage_type_of<T>));
  const Step<T> step(spec);
  const int64_t total = step.cu.back();
  Tensor<double, 3> oracle_out({total, spec.q_heads, spec.v_dim});
  Tensor<double, 2> oracle_lse({spec.q_heads, total});
  oracle_of(step, oracle_out, oracle_lse);
  const double eps = std::numeric_limits<float>::epsilon();
  test::for_each_simd_target([&](int64_t) {
    const Results plain = run_plan(step, false, options_for(spec));
    const Results shared = run_plan(step, true, options_for(spec));
    const double plain_out = test::max_abs_diff(plain.out, oracle_out), plain_lse = test::max_abs_diff(plain.lse, oracle_lse);
    EXPECT_LE(test::max_abs_diff(shared.out, oracle_out), 2.0 * plain_out + 8.0 * eps * std::max(1.0, largest(oracle_out)))
        << "plain error " << plain_out;
    EXPECT_LE(test::max_abs_diff(shared.lse, oracle_lse), 2.0 * plain_lse + 8.0 * eps * std::max(1.0, largest(oracle_lse)))
        << "plain error " << plain_lse;
    // The merge changed the grouped rows (else this test would not test it); sequence 7,
    // in no group, keeps the plain plan's bits.
    EXPECT_FALSE(same_bits(plain.out, shared.out));
    for (int64_t row = step.cu[7]; row < step.cu[8]; ++row)
      for (int64_t h = 0; h < spec.q_heads; ++h) {
        EXPECT_EQ(std::memcmp(&plain.out(row, h, 0), &shared.out(row, h, 0), sizeof(float) * spec.v_dim), 0);
        EXPECT_EQ(plain.lse(h, row), shared.lse(h, row));
      }
    const Results one = run_plan(step, true, options_for(spec, 1)), three = run_plan(step, true, options_for(spec, 3));
    EXPECT_TRUE(same_bits(one.out, shared.out) && same_bits(one.lse, shared.lse)) << "threads 1 vs 2";
    EXPECT_TRUE(same_bits(three.out, shared.out) && same_bits(three.lse, shared.lse)) << "threads 3 vs 2";
    const Results no_lse = run_plan(step, true, options_for(spec), /*with_lse=*/false);
    EXPECT_TRUE(same_bits(no_lse.out, shared.out)) << "lse not asked for";
  });
}

TEST(SharedPrefix, GroupsSaveTheMostBlockReads) {
  const Step<float> step(mixed_spec());
  const BatchPlan plan(step.layout(true), options_for(step.spec));
  const std::vector<PrefixGroup> groups = plan.prefix_groups();
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups[0].sequences, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(groups[0].keys, 11 * 16);
  EXPECT_EQ(groups[1].sequences, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(groups[1].keys, 11 * 16);
  EXPECT_EQ(groups[2].sequences, (std::vector<int64_t>{8, 9}));
  EXPECT_EQ(groups[2].keys, 3 * 16);
  EXPECT_TRUE(BatchPlan(step.layout(false), options_for(step.spec)).prefix_groups().empty());

  // Everyone on one long run: one group of all, over the whole run.
  Spec one{.runs = {12}, .seqs = {{1, {0}, 1}, {5, {0}, 5}, {1, {0}, 20}}};
  const Step<float> all(one);
  const std::vector<PrefixGroup> single = BatchPlan(all.layout(true), options_for(one)).prefix_groups();
  ASSERT_EQ(single.size(), 1u);
  EXPECT_EQ(single[0].sequences, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(single[0].keys, 12 * 16);
  // A new token inside the shared blocks (a 20-query chunk whose cache is the shared run
  // plus 4 keys): only the blocks wholly before its first new token are shared.
  Spec early{.runs = {4}, .seqs = {{20, {0}, 4}, {1, {0}, 3}}};
  const Step<float> cut(early);
  const std::vector<PrefixGroup> partial = BatchPlan(cut.layout(true), options_for(early)).prefix_groups();
  ASSERT_EQ(partial.size(), 1u);
  EXPECT_EQ(partial[0].keys, 3 * 16);
}

TEST(SharedPrefix, MatchesThePlainStepForEveryStorage) {
  check_storage<float>(mixed_spec());
  check_storage<bfloat16>(mixed_spec());
  check_storage<float16>(mixed_spec());
  check_storage<std::int8_t>(mixed_spec());
  check_storage<float8_e4m3fn>(mixed_spec());
}

TEST(SharedPrefix, SoftcapSinksAndOtherShapes) {
  Spec spec = mixed_spec(5);
  spec.softcap = 2.0f;
  spec.sinks = true;
  check_storage<float>(spec);
  check_storage<bfloat16>(spec);
  Spec odd = mixed_spec(6);  // head sizes that are not whole vectors, MHA, blocks of 5
  odd.q_heads = 4;
  odd.kv_heads = 4;
  odd.head_dim = 59;
  odd.v_dim = 13;
  odd.block_size = 5;
  check_storage<float>(odd);
}

// A NaN in a member's own keys reaches that member's rows only: the shared pass reads the
// shared blocks, never a member's own.
TEST(SharedPrefix, ANaNInOneMembersOwnKeysStaysThere) {
  Step<float> step(mixed_spec());
  const int64_t own_block = step.table(0, 11);  // sequence 0's first own block
  step.k(own_block, 0, 0, 3) = std::nanf("");
  const Results r = run_plan(step, true, options_for(step.spec));
  const int64_t group = step.spec.q_heads / step.spec.kv_heads;
  for (int64_t row = 0; row < step.cu.back(); ++row)
    for (int64_t h = 0; h < step.spec.q_heads; ++h) {
      const bool reached = std::isnan(r.out(row, h, 0));
      EXPECT_EQ(reached, row == step.cu[0] && h < group) << "row " << row << " head " << h;
    }
}

TEST(SharedPrefix, RefusedByName) {
  const Step<float> step(mixed_spec());
  const Spec& spec = step.spec;
  BatchLayout contiguous = step.layout(true);
  contiguous.block_table = {};
  contiguous.block_size = 0;
  expect_error([&] { BatchPlan(contiguous, options_for(spec)); }, "layout.share_prefixes: expected a paged layout");
  AttentionOptions top_left = options_for(spec);
  top_left.causal = Causal::top_left;
  BatchLayout no_trees = step.layout(true);
  no_trees.tree_mask = {};
  no_trees.tree_mask_offsets = {};
  expect_error([&] { BatchPlan(no_trees, top_left); }, "options.causal: expected none or bottom_right with layout.share_prefixes");
  AttentionOptions window = options_for(spec);
  window.window = Window{8, 0};
  expect_error([&] { BatchPlan(no_trees, window); }, "options.window: not with layout.share_prefixes");
  const std::vector<float> slopes(8, 0.25f);
  AttentionOptions alibi = options_for(spec);
  alibi.alibi_slopes = slopes;
  expect_error([&] { BatchPlan(no_trees, alibi); }, "options.alibi_slopes: not with layout.share_prefixes");
  AttentionOptions fixed = options_for(spec);
  fixed.execution.fixed_key_split = true;
  expect_error([&] { BatchPlan(step.layout(true), fixed); }, "options.execution.fixed_key_split: not with layout.share_prefixes");

  // Key lists at run: refused, out untouched.
  const BatchPlan plan(no_trees, options_for(spec));
  Tensor<float, 3> out({step.cu.back(), spec.q_heads, spec.v_dim});
  std::fill(out.data(), out.data() + out.size(), -7.0f);
  const std::vector<int32_t> lists(static_cast<std::size_t>(step.cu.back()), 0);
  BatchArgs<float> a;
  a.q = step.q.cview();
  a.k_cache = step.k.cview();
  a.v_cache = step.v.cview();
  a.out = out.view();
  a.indices = KeyIndices(TensorView<const int32_t, 2>(lists.data(), {step.cu.back(), 1}, {1, 1}));
  expect_error([&] { plan.run(a); }, "indices: not with a plan whose sequences share prefixes");
  EXPECT_TRUE(std::all_of(out.data(), out.data() + out.size(), [](float x) { return x == -7.0f; }));

  // The reference backend computes the plain step: no groups, the oracle's results.
  AttentionOptions reference = options_for(spec);
  reference.execution.backend = Backend::reference;
  EXPECT_TRUE(BatchPlan(step.layout(true), reference).prefix_groups().empty());
}

}  // namespace
}  // namespace qkv
