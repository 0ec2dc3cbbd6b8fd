// qkv::BatchPlan with speculative-decoding trees (tree_mask; qkv/batch_plan.hpp, "Trees").
//   - Random draft trees (parent-pointer trees of ≤ 64 nodes and depth ≤ 6, as ancestor
//     masks), the same trees laid out out of topological order, and arbitrary masks
//     (random, diagonal set), mixed in one plan with sequences without a tree (decode
//     tokens, a prefill chunk, an empty sequence), over contiguous and shuffled paged
//     caches of every storage type, against a dense-mask oracle written here in fp64 over
//     the stored values (independent of the library's reference backend); on every
//     compiled SIMD target; threads 1, 2 and 3 give the same bits.
//   - Tolerance, test_decode.cpp's rule: max |plan − oracle64| ≤ 2·max |plain32 − oracle64|
//     + 8·ε₃₂·max(1, max |oracle64|), plain32 the same dense-mask loop in float on the same
//     values. The kernel may round differently from a naive fp32 loop (other summation
//     order, fused multiply-adds, its exp), not worse; the floor covers outputs where the
//     plain loop happens to be nearly exact.
//   - Backend::reference honours trees: within one float rounding (ε₃₂·max(1, |oracle|))
//     of the oracle, both being fp64 sums of the same terms.
//   - Batch invariance: a tree sequence's rows are bitwise those of a one-sequence plan of
//     it, contiguous or paged; causal none and bottom_right give the same bits (the tree
//     replaces causality); fixed_key_split too.
//   - A NaN in a new token's key and value reaches only the rows that see that token.
//   - Errors name the argument, index and sequence; nothing is written.
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

enum class Kind { none, tree, shuffled_tree, arbitrary };

struct SeqSpec {
  int64_t queries = 0;
  int64_t prefix = 0;  // cached keys before the new tokens
  Kind kind = Kind::none;
};

struct Spec {
  std::vector<SeqSpec> seqs;
  int64_t block_size = 0;  // 0: contiguous caches
  int64_t q_heads = 8, kv_heads = 2, head_dim = 64, v_dim = 48;
  float softcap = 0.0f;
  bool sinks = false;
  std::uint64_t seed = 7;
};

// A random draft tree of n nodes: node 0 the root, each later node a child of an earlier
// one less than 6 levels deep (so depth ≤ 6); row i of the mask marks i and its ancestors.
// `shuffled`: the same tree with its nodes in a random order (parents may come later).
std::vector<std::uint8_t> tree_mask_of(int64_t n, bool shuffled, std::mt19937& rng) {
  constexpr int kMaxDepth = 6;
  std::vector<int64_t> parent(static_cast<std::size_t>(n), -1), depth(static_cast<std::size_t>(n), 1);
  for (int64_t i = 1; i < n; ++i) {
    std::vector<int64_t> open;
    for (int64_t p = 0; p < i; ++p)
      if (depth[p] < kMaxDepth) open.push_back(p);
    parent[i] = open[std::uniform_int_distribution<std::size_t>(0, open.size() - 1)(rng)];
    depth[i] = depth[parent[i]] + 1;
  }
  std::vector<int64_t> place(static_cast<std::size_t>(n));
  std::iota(place.begin(), place.end(), 0);
  if (shuffled) std::shuffle(place.begin(), place.end(), rng);
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(n * n), 0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = i; j >= 0; j = parent[j]) mask[place[i] * n + place[j]] = 1;
  return mask;
}

std::vector<std::uint8_t> arbitrary_mask(int64_t n, std::mt19937& rng) {
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(n * n));
  for (auto& bit : mask) bit = static_cast<std::uint8_t>(rng() & 1u);
  for (int64_t i = 0; i < n; ++i) mask[i * n + i] = 1;
  return mask;
}

template <class T>
T stored(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return T(x);
}

// A step's inputs: packed queries, caches (contiguous, or a shuffled pool with blocks
// nobody uses; every row past a sequence's keys NaN), and the trees flattened with a few
// junk entries between them (so offsets matter).
template <class T>
struct TreeStep {
  static constexpr bool kInt8 = std::is_same_v<T, std::int8_t>;
  Spec spec;
  std::vector<int64_t> cu{0}, lengths, offsets;
  std::vector<std::uint8_t> mask;
  int64_t max_blocks = 0;
  Tensor<float, 3> q;
  Tensor<T, 4> k, v;
  Tensor<float, 3> k_scale, v_scale;
  Tensor<int32_t, 2> table;

  explicit TreeStep(const Spec& s) : spec(s) {
    std::mt19937 rng(static_cast<unsigned>(s.seed));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const auto batch = static_cast<int64_t>(s.seqs.size());
    for (const SeqSpec& seq : s.seqs) {
      cu.push_back(cu.back() + seq.queries);
      lengths.push_back(seq.prefix + seq.queries);
      if (seq.kind == Kind::none) {
        offsets.push_back(-1);
        continue;
      }
      mask.insert(mask.end(), 3, 1);  // junk between masks
      offsets.push_back(static_cast<int64_t>(mask.size()));
      const std::vector<std::uint8_t> m = seq.kind == Kind::arbitrary ? arbitrary_mask(seq.queries, rng)
                                                                      : tree_mask_of(seq.queries, seq.kind == Kind::shuffled_tree, rng);
      mask.insert(mask.end(), m.begin(), m.end());
    }
    const int64_t capacity = std::max<int64_t>(1, *std::max_element(lengths.begin(), lengths.end()));
    q = Tensor<float, 3>({cu.back(), s.q_heads, s.head_dim});
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = normal(rng);
    int64_t rows0 = batch, rows1 = capacity;
    if (s.block_size > 0) {
      max_blocks = (capacity + s.block_size - 1) / s.block_size;
      rows0 = batch * max_blocks + 2;
      rows1 = s.block_size;
      std::vector<int32_t> order(static_cast<std::size_t>(rows0));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(s.seed) + 3));  // values alike either way
      table = Tensor<int32_t, 2>({batch, max_blocks});
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t n = 0; n < max_blocks; ++n) table(b, n) = order[static_cast<std::size_t>(b * max_blocks + n)];
    }
    k = Tensor<T, 4>({rows0, rows1, s.kv_heads, s.head_dim});
    v = Tensor<T, 4>({rows0, rows1, s.kv_heads, s.v_dim});
    const T poison = kInt8 ? T{} : stored<T>(std::nanf(""));
    std::fill(k.data(), k.data() + k.size(), poison);
    std::fill(v.data(), v.data() + v.size(), poison);
    if constexpr (kInt8) {
      k_scale = Tensor<float, 3>({rows0, rows1, s.kv_heads});
      v_scale = Tensor<float, 3>({rows0, rows1, s.kv_heads});
      std::fill(k_scale.data(), k_scale.data() + k_scale.size(), std::nanf(""));
      std::fill(v_scale.data(), v_scale.data() + v_scale.size(), std::nanf(""));
    }
    std::vector<float> row(static_cast<std::size_t>(std::max(s.head_dim, s.v_dim)));
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < lengths[b]; ++j)
        for (int64_t h = 0; h < s.kv_heads; ++h)
          for (const bool keys : {true, false}) {
            const int64_t dim = keys ? s.head_dim : s.v_dim;
            for (int64_t c = 0; c < dim; ++c) row[c] = normal(rng);
            const auto [r0, r1] = slot(b, j);
            store_row(row.data(), dim, keys ? &k(r0, r1, h, 0) : &v(r0, r1, h, 0),
                      kInt8 ? (keys ? &k_scale(r0, r1, h) : &v_scale(r0, r1, h)) : nullptr);
          }
  }

  std::pair<int64_t, int64_t> slot(int64_t b, int64_t j) const {
    if (spec.block_size == 0) return {b, j};
    return {table(b, j / spec.block_size), j % spec.block_size};
  }

  // int8: one scale per row, max|x|/127 (as KVCache quantizes).
  static void store_row(const float* x, int64_t n, T* to, float* scale) {
    if constexpr (kInt8) {
      float largest = 0.0f;
      for (int64_t c = 0; c < n; ++c) largest = std::max(largest, std::abs(x[c]));
      *scale = largest / 127.0f;
      for (int64_t c = 0; c < n; ++c) to[c] = static_cast<std::int8_t>(std::nearbyint(x[c] / *scale));
    } else {
      for (int64_t c = 0; c < n; ++c) to[c] = stored<T>(x[c]);
    }
  }

  // Element c of key (or value) j of sequence b, head h, as the kernels read it: widened
  // exactly; int8 as level · scale, in Acc's arithmetic.
  template <class Acc>
  Acc element(bool keys, int64_t b, int64_t j, int64_t h, int64_t c) const {
    const auto [r0, r1] = slot(b, j);
    const T x = keys ? k(r0, r1, h, c) : v(r0, r1, h, c);
    if constexpr (kInt8) return static_cast<Acc>(x) * static_cast<Acc>((keys ? k_scale : v_scale)(r0, r1, h));
    else return static_cast<Acc>(static_cast<float>(x));
  }

  // Does query i of sequence b see key j? The tree among its new tokens, else causality
  // aligned bottom-right (the plan's options).
  bool sees(int64_t b, int64_t i, int64_t j) const {
    const int64_t n = cu[b + 1] - cu[b], prefix = lengths[b] - n;
    if (offsets[b] < 0) return j <= prefix + i;
    return j < prefix || mask[static_cast<std::size_t>(offsets[b] + i * n + (j - prefix))] != 0;
  }

  BatchLayout layout() const {
    BatchLayout l;
    l.cu_seqlens_q = std::span<const int64_t>(cu);
    l.cache_lengths = std::span<const int64_t>(lengths);
    if (spec.block_size > 0) {
      l.block_table = table.cview();
      l.block_size = spec.block_size;
    }
    l.num_heads = spec.q_heads;
    l.num_kv_heads = spec.kv_heads;
    l.head_dim = spec.head_dim;
    l.v_dim = spec.v_dim;
    l.storage = storage_type_of<T>;
    l.tree_mask = mask;
    l.tree_mask_offsets = std::span<const int64_t>(offsets);
    return l;
  }

  BatchArgs<T> args(Tensor<float, 3>& out, Tensor<float, 2>& lse) const {
    BatchArgs<T> a;
    a.q = q.cview();
    a.k_cache = k.cview();
    a.v_cache = v.cview();
    a.out = out.view();
    a.lse = lse.view();
    if constexpr (kInt8) {
      a.k_scale = k_scale.cview();
      a.v_scale = v_scale.cview();
    }
    return a;
  }
};

AttentionOptions options_for(const Spec& s, int threads = 2) {
  return test::step_options(s.softcap, s.sinks, s.q_heads, threads);
}

template <class Acc>
struct Dense {
  Tensor<Acc, 3> out;  // [total_q, Hq, dv]
  Tensor<Acc, 2> lse;  // [Hq, total_q]
};

// Dense-mask attention over the stored values, every sum in Acc: double is the oracle,
// float the plain fp32 loop the tolerance is measured against.
template <class Acc, class T>
Dense<Acc> dense_attention(const TreeStep<T>& step) {
  const Spec& s = step.spec;
  const int64_t total = step.cu.back(), group = s.q_heads / s.kv_heads;
  Dense<Acc> r{Tensor<Acc, 3>({total, s.q_heads, s.v_dim}), Tensor<Acc, 2>({s.q_heads, total})};
  const std::vector<float> sinks = sink_logits(s.q_heads);
  const Acc scale = static_cast<Acc>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  for (std::size_t b = 0; b + 1 < step.cu.size(); ++b) {
    const int64_t n = step.cu[b + 1] - step.cu[b], length = step.lengths[b];
    std::vector<Acc> logits(static_cast<std::size_t>(length));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < s.q_heads; ++h) {
        const int64_t row = step.cu[b] + i, g = h / group;
        Acc m = s.sinks ? static_cast<Acc>(sinks[h]) : -std::numeric_limits<Acc>::infinity();
        for (int64_t j = 0; j < length; ++j) {
          if (!step.sees(static_cast<int64_t>(b), i, j)) continue;
          Acc dot = 0;
          for (int64_t c = 0; c < s.head_dim; ++c)
            dot += static_cast<Acc>(step.q(row, h, c)) * step.template element<Acc>(true, static_cast<int64_t>(b), j, g, c);
          Acc logit = scale * dot;
          if (s.softcap > 0.0f) logit = static_cast<Acc>(s.softcap) * std::tanh(logit / static_cast<Acc>(s.softcap));
          logits[j] = logit;
          m = std::max(m, logit);
        }
        Acc l = s.sinks ? std::exp(static_cast<Acc>(sinks[h]) - m) : Acc(0);
        std::vector<Acc> acc(static_cast<std::size_t>(s.v_dim), Acc(0));
        for (int64_t j = 0; j < length; ++j) {
          if (!step.sees(static_cast<int64_t>(b), i, j)) continue;
          const Acc p = std::exp(logits[j] - m);
          l += p;
          for (int64_t c = 0; c < s.v_dim; ++c) acc[c] += p * step.template element<Acc>(false, static_cast<int64_t>(b), j, g, c);
        }
        for (int64_t c = 0; c < s.v_dim; ++c) r.out(row, h, c) = acc[c] / l;
        r.lse(h, row) = m + std::log(l);
      }
  }
  return r;
}

struct Results {
  Tensor<float, 3> out;
  Tensor<float, 2> lse;
};

template <class T>
Results run_plan(const TreeStep<T>& step, const AttentionOptions& options) {
  Results r{Tensor<float, 3>({step.cu.back(), step.spec.q_heads, step.spec.v_dim}),
            Tensor<float, 2>({step.spec.q_heads, step.cu.back()})};
  const BatchPlan plan(step.layout(), options);
  plan.run(step.args(r.out, r.lse));
  return r;
}

template <class A, class B, int R>
double max_error(const Tensor<A, R>& got, const Tensor<B, R>& want) { return test::max_abs_diff(got, want); }

template <int R>
double largest(const Tensor<double, R>& t) {
  double m = 0.0;
  for (std::size_t i = 0; i < t.size(); ++i) m = std::max(m, std::abs(t[i]));
  return m;
}

// The plan's results within the tolerance of the oracle (see the top of the file).
void expect_within_tolerance(const Results& got, const Dense<double>& oracle, const Dense<float>& plain) {
  const double eps = std::numeric_limits<float>::epsilon();
  EXPECT_LE(max_error(got.out, oracle.out),
            2.0 * max_error(plain.out, oracle.out) + 8.0 * eps * std::max(1.0, largest(oracle.out)))
      << "plain fp32 error " << max_error(plain.out, oracle.out);
  EXPECT_LE(max_error(got.lse, oracle.lse),
            2.0 * max_error(plain.lse, oracle.lse) + 8.0 * eps * std::max(1.0, largest(oracle.lse)))
      << "plain fp32 error " << max_error(plain.lse, oracle.lse);
}

// A draft tree of every interesting size next to sequences without one: trees of 1, 7,
// 16 (one full query tile), 17 (a second tile of one query), 40 and 64 nodes, with no
// prefix, a short one, one past a 64-key block and one past several 512-key chunks; a
// decode token, a 20-query prefill chunk (the tiled schedule) and an empty sequence.
Spec mixed_spec(int64_t block_size, std::uint64_t seed = 7) {
  return Spec{.seqs = {{1, 40, Kind::none},
                       {64, 1100, Kind::tree},
                       {7, 0, Kind::tree},
                       {20, 30, Kind::none},
                       {17, 75, Kind::shuffled_tree},
                       {0, 9, Kind::none},
                       {40, 3, Kind::arbitrary},
                       {16, 130, Kind::tree},
                       {1, 600, Kind::tree}},
              .block_size = block_size,
              .seed = seed};
}

template <class T>
void check_storage(const Spec& spec) {
  SCOPED_TRACE(std::string("storage ") + storage_name(storage_type_of<T>) + ", block_size " +
               std::to_string(spec.block_size));
  const TreeStep<T> step(spec);
  const Dense<double> oracle = dense_attention<double>(step);
  const Dense<float> plain = dense_attention<float>(step);
  test::for_each_simd_target([&](int64_t) {
    const Results two = run_plan(step, options_for(spec, 2));
    expect_within_tolerance(two, oracle, plain);
    const Results one = run_plan(step, options_for(spec, 1)), three = run_plan(step, options_for(spec, 3));
    EXPECT_TRUE(same_bits(one.out, two.out) && same_bits(one.lse, two.lse)) << "threads 1 vs 2";
    EXPECT_TRUE(same_bits(three.out, two.out) && same_bits(three.lse, two.lse)) << "threads 3 vs 2";
  });
  AttentionOptions reference = options_for(spec);
  reference.execution.backend = Backend::reference;
  const Results ref = run_plan(step, reference);
  const double eps = std::numeric_limits<float>::epsilon();
  EXPECT_LE(max_error(ref.out, oracle.out), eps * std::max(1.0, largest(oracle.out))) << "reference backend";
  EXPECT_LE(max_error(ref.lse, oracle.lse), eps * std::max(1.0, largest(oracle.lse))) << "reference backend";
}

TEST(TreeMask, RandomTreesMatchTheDenseMaskOracleForEveryStorageAndLayout) {
  for (const int64_t block : {0, 16, 5}) {
    check_storage<float>(mixed_spec(block));
    check_storage<bfloat16>(mixed_spec(block));
    check_storage<float16>(mixed_spec(block));
    check_storage<std::int8_t>(mixed_spec(block));
  }
}

TEST(TreeMask, ManyRandomTreesAndMasks) {
  std::mt19937 rng(2024);
  for (int round = 0; round < 6; ++round) {
    Spec spec{.block_size = round % 2 == 0 ? 16 : 0, .seed = 100u + static_cast<unsigned>(round)};
    spec.q_heads = 4;
    spec.kv_heads = round % 3 == 0 ? 4 : 1;
    spec.head_dim = round % 2 == 0 ? 32 : 59;  // 59: the packed path (not whole vectors)
    spec.v_dim = round % 2 == 0 ? 32 : 13;
    for (int s = 0; s < 4; ++s) {
      const int64_t nodes = std::uniform_int_distribution<int64_t>(1, 64)(rng);
      const int64_t prefix = std::uniform_int_distribution<int64_t>(0, 300)(rng);
      const auto kind = static_cast<Kind>(std::uniform_int_distribution<int>(1, 3)(rng));
      spec.seqs.push_back({nodes, prefix, kind});
    }
    SCOPED_TRACE("round " + std::to_string(round));
    check_storage<float>(spec);
  }
}

TEST(TreeMask, SoftcapAndSinks) {
  Spec spec = mixed_spec(16, 9);
  spec.softcap = 2.0f;
  spec.sinks = true;
  check_storage<float>(spec);
  check_storage<bfloat16>(spec);
}

// A tree sequence's rows are bitwise those of a one-sequence plan of it (with its tree),
// paged or contiguous; the tree replaces causality (none and bottom_right agree).
TEST(TreeMask, BatchInvariantAndIndependentOfCausalMode) {
  const Spec paged_spec = mixed_spec(16), contiguous_spec = mixed_spec(0);
  const TreeStep<float> paged(paged_spec), contiguous(contiguous_spec);
  test::for_each_simd_target([&](int64_t) {
    const Results batch = run_plan(paged, options_for(paged_spec));
    const Results flat = run_plan(contiguous, options_for(contiguous_spec));
    EXPECT_TRUE(same_bits(batch.out, flat.out) && same_bits(batch.lse, flat.lse)) << "paged vs contiguous";
    AttentionOptions none = options_for(paged_spec);
    none.causal = Causal::none;
    const Results unordered = run_plan(paged, none);
    const Spec& s = paged_spec;
    for (std::size_t b = 0; b < s.seqs.size(); ++b) {
      const int64_t n = paged.cu[b + 1] - paged.cu[b];
      if (paged.offsets[b] < 0 || n == 0) continue;
      SCOPED_TRACE("sequence " + std::to_string(b));
      const std::size_t first = static_cast<std::size_t>(paged.cu[b] * s.q_heads * s.v_dim);
      const std::size_t count = static_cast<std::size_t>(n * s.q_heads * s.v_dim);
      EXPECT_EQ(std::memcmp(batch.out.data() + first, unordered.out.data() + first, count * sizeof(float)), 0)
          << "causal none vs bottom_right";
      // Alone: its q rows, its row of the block table, its mask at its offset.
      BatchLayout l = paged.layout();
      const std::vector<int64_t> cu{0, n}, length{paged.lengths[b]}, offset{paged.offsets[b]};
      l.cu_seqlens_q = std::span<const int64_t>(cu);
      l.cache_lengths = std::span<const int64_t>(length);
      l.tree_mask_offsets = std::span<const int64_t>(offset);
      l.block_table = TensorView<const int32_t, 2>(paged.table.data() + b * paged.max_blocks, {1, paged.max_blocks},
                                                   {paged.max_blocks, 1});
      Tensor<float, 3> out({n, s.q_heads, s.v_dim});
      Tensor<float, 2> lse({s.q_heads, n});
      BatchArgs<float> a = paged.args(out, lse);
      a.q = View3<const float>(&paged.q(paged.cu[b], 0, 0), {n, s.q_heads, s.head_dim}, {s.q_heads * s.head_dim, s.head_dim, 1});
      BatchPlan(l, options_for(paged_spec, 3)).run(a);
      EXPECT_EQ(std::memcmp(out.data(), batch.out.data() + first, count * sizeof(float)), 0) << "alone vs in the batch";
      for (int64_t h = 0; h < s.q_heads; ++h)
        EXPECT_EQ(std::memcmp(&lse(h, 0), &batch.lse(h, paged.cu[b]), static_cast<std::size_t>(n) * sizeof(float)), 0);
    }
  });
}

TEST(TreeMask, FixedKeySplit) {
  const Spec spec = mixed_spec(16, 12);
  const TreeStep<bfloat16> step(spec);
  const Dense<double> oracle = dense_attention<double>(step);
  const Dense<float> plain = dense_attention<float>(step);
  AttentionOptions fixed = options_for(spec, 3);
  fixed.execution.fixed_key_split = true;
  const Results got = run_plan(step, fixed);
  expect_within_tolerance(got, oracle, plain);
  fixed.execution.threads = 1;
  const Results one = run_plan(step, fixed);
  EXPECT_TRUE(same_bits(one.out, got.out) && same_bits(one.lse, got.lse));
}

// NaN in one leaf's key and value (a token only its own row sees): that row is NaN, every
// other row of the step matches the oracle as before — on the cpu schedule and the reference.
TEST(TreeMask, NonFiniteNewTokensReachOnlyTheRowsThatSeeThem) {
  const Spec spec = mixed_spec(16, 21);
  TreeStep<float> step(spec);
  const std::size_t b = 1;  // 64 nodes after 1100 keys
  const int64_t n = step.cu[b + 1] - step.cu[b], prefix = step.lengths[b] - n;
  int64_t leaf = -1;  // a node no other node sees
  for (int64_t j = n - 1; j >= 0 && leaf < 0; --j) {
    int64_t seen_by = 0;
    for (int64_t i = 0; i < n; ++i) seen_by += step.sees(static_cast<int64_t>(b), i, prefix + j) ? 1 : 0;
    if (seen_by == 1) leaf = j;
  }
  ASSERT_GE(leaf, 0);
  const auto [r0, r1] = step.slot(static_cast<int64_t>(b), prefix + leaf);
  for (int64_t h = 0; h < spec.kv_heads; ++h) {
    step.k(r0, r1, h, 3) = std::nanf("");
    step.v(r0, r1, h, 5) = std::numeric_limits<float>::infinity();
  }
  const Dense<double> oracle = dense_attention<double>(step);
  AttentionOptions reference = options_for(spec);
  reference.execution.backend = Backend::reference;
  test::for_each_simd_target([&](int64_t) {
    for (const AttentionOptions& options : {options_for(spec, 2), reference}) {
      const Results got = run_plan(step, options);
      for (int64_t row = 0; row < step.cu.back(); ++row)
        for (int64_t h = 0; h < spec.q_heads; ++h) {
          const bool poisoned = row == step.cu[b] + leaf;
          for (int64_t c = 0; c < spec.v_dim; ++c) {
            ASSERT_EQ(std::isfinite(got.out(row, h, c)), !poisoned) << "row " << row << " head " << h;
            if (!poisoned) {
              ASSERT_NEAR(got.out(row, h, c), oracle.out(row, h, c), 1e-4) << "row " << row;
            }
          }
        }
    }
  });
}

// ---------------------------------------------------------------------------------
// Errors: the message names the argument (and index, sequence); nothing is written.

TEST(TreeMaskErrors, BadMasksAndCombinationsNameTheArgument) {
  const Spec spec = mixed_spec(16);
  const TreeStep<float> step(spec);
  const auto plan_with = [&](auto change, AttentionOptions options = {}) {
    return [&step, change, options] {
      std::vector<int64_t> offsets = step.offsets;
      std::vector<std::uint8_t> mask = step.mask;
      BatchLayout l = step.layout();
      change(l, offsets, mask);
      l.tree_mask_offsets = std::span<const int64_t>(offsets);
      l.tree_mask = mask;
      BatchPlan plan(l, options);
    };
  };
  using Offsets = std::vector<int64_t>;
  using Mask = std::vector<std::uint8_t>;
  // Sequence 1: 64 nodes, its mask at offsets[1].
  expect_error(plan_with([](BatchLayout&, Offsets& o, Mask&) { o[1] = -2; }), "tree_mask_offsets[1]: expected -1 (no tree) or 0..");
  expect_error(plan_with([](BatchLayout&, Offsets& o, Mask& m) { o[1] = static_cast<int64_t>(m.size()) - 64 * 64 + 1; }),
               "sequence 1's 64x64 mask within the");
  expect_error(plan_with([](BatchLayout&, Offsets& o, Mask&) { o.pop_back(); }),
               "tree_mask_offsets: expected one offset per sequence (9");
  expect_error(plan_with([](BatchLayout&, Offsets& o, Mask& m) { m[static_cast<std::size_t>(o[2] + 3 * 7 + 3)] = 0; }),
               "(sequence 2, token 3 sees itself): expected true");
  expect_error(plan_with([](BatchLayout&, Offsets& o, Mask&) { o.clear(); }), "tree_mask_offsets: expected one offset");
  expect_error(plan_with([](BatchLayout&, Offsets&, Mask& m) { m.clear(); }), "tree_mask: expected the flattened masks");
  AttentionOptions top_left, window, alibi;
  top_left.causal = Causal::top_left;
  window.window = {.left = 8, .right = 0};
  const std::vector<float> slopes(8, 0.5f);
  alibi.alibi_slopes = slopes;
  expect_error(plan_with([](BatchLayout&, Offsets&, Mask&) {}, top_left), "options.causal: expected none or bottom_right with a tree_mask");
  expect_error(plan_with([](BatchLayout&, Offsets&, Mask&) {}, window), "options.window: not with a tree_mask");
  expect_error(plan_with([](BatchLayout&, Offsets&, Mask&) {}, alibi), "options.alibi_slopes: not with a tree_mask");
}

TEST(TreeMaskErrors, KeyListsAreRefusedAtRunWithNothingWritten) {
  const Spec spec = mixed_spec(0);
  const TreeStep<float> step(spec);
  const BatchPlan plan(step.layout(), options_for(spec));
  Results r{Tensor<float, 3>({step.cu.back(), spec.q_heads, spec.v_dim}), Tensor<float, 2>({spec.q_heads, step.cu.back()})};
  std::fill(r.out.data(), r.out.data() + r.out.size(), 7.0f);
  std::vector<int32_t> lists(static_cast<std::size_t>(step.cu.back()), 0);
  BatchArgs<float> a = step.args(r.out, r.lse);
  a.indices = KeyIndices(TensorView<const int32_t, 2>(lists.data(), {step.cu.back(), 1}, {1, 1}));
  expect_error([&] { plan.run(a); }, "indices: not with a plan that has a tree_mask");
  for (std::size_t i = 0; i < r.out.size(); ++i) ASSERT_EQ(r.out[i], 7.0f);
}

}  // namespace
}  // namespace qkv
