// Ring attention on real ranks (run under mpiexec -n 2, 3, 4): every rank builds the
// same global inputs, runs the ring on its shards, gathers the results and compares them
// with the single-process fp32 kernel and the fp64 reference on the unsharded input.
//
// Rule (per output X), the library's own for its fused kernels: err_ring ≤ 2·err_cpu +
// 8·eps·max(1, max|X|), where err is the max deviation from the fp64 reference and
// err_cpu that of qkv's single-process fp32 kernel on the same inputs. The ring adds
// one kind of rounding the single kernel lacks: each LSE merge weighs its partials by
// exp(lse_part − lse) from fp32 LSEs (relative error ~eps·|lse|/2, the size of the
// kernel's own LSE error); on these shapes (|lse| < 6) that stays within the rule,
// and QKV_DIST_VERBOSE=1 prints both errors per output.
#include <gtest/gtest.h>
#include <mpi.h>

#include <qkv/dist.hpp>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace qkv::dist {
namespace {

struct RingCase {
  std::string name;
  int64_t batch = 1, q_len = 0, k_len = 0, q_heads = 2, kv_heads = 2, dim = 16, v_dim = 16;
  Causal causal = Causal::none;
  std::vector<int64_t> key_lengths;
  std::optional<double> scale;
  Sharding sharding = Sharding::zigzag;
  bool bhsd = false;  // shards in PyTorch's [B, H, S, D] memory: strided views
  int64_t progress_rows = 256;  // small values cut the block calls into pieces
};

void PrintTo(const RingCase& c, std::ostream* os) { *os << c.name; }

int world_size() {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  return world;
}
int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

template <class T, int R>
Tensor<double, R> widen(const Tensor<T, R>& t) {
  Tensor<double, R> out(t.shape());
  for (std::size_t i = 0; i < t.size(); ++i) out[i] = t[i];
  return out;
}

template <int R>
double max_abs(const Tensor<double, R>& t) {
  double m = 0.0;
  for (std::size_t i = 0; i < t.size(); ++i)
    if (std::isfinite(t[i])) m = std::max(m, std::abs(t[i]));
  return m;
}

// max |x − ref|, equal infinities (the −inf LSE of rows without keys) counting as exact.
template <int R>
double error(const Tensor<float, R>& x, const Tensor<double, R>& ref) {
  double worst = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (std::isinf(ref[i]) && static_cast<double>(x[i]) == ref[i]) continue;
    const double e = std::abs(static_cast<double>(x[i]) - ref[i]);
    if (std::isnan(e)) return INFINITY;
    worst = std::max(worst, e);
  }
  return worst;
}

template <class T>
struct Results {
  Tensor<T, 4> out, dq, dk, dv;
  Tensor<T, 3> lse;
};

template <class T>
Results<T> single_process(const RingCase& c, const AttentionOptions& options, const Tensor<T, 4>& q,
                          const Tensor<T, 4>& k, const Tensor<T, 4>& v, const Tensor<T, 4>& dout) {
  Results<T> r{Tensor<T, 4>({c.batch, c.q_len, c.q_heads, c.v_dim}), Tensor<T, 4>(q.shape()),
               Tensor<T, 4>(k.shape()), Tensor<T, 4>(v.shape()), Tensor<T, 3>({c.batch, c.q_heads, c.q_len})};
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = r.out.view(), .lse = r.lse.view()},
                    options);
  attention_backward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = r.out.cview(), .lse = r.lse.cview(),
                      .dout = dout.cview(), .dq = r.dq.view(), .dk = r.dk.view(), .dv = r.dv.view()},
                     options);
  return r;
}

// A local shard, in [B, S, H, D] or [B, H, S, D] memory, seen as a logical view.
struct Shard {
  Tensor<float, 4> memory;
  View4<float> view;

  Shard(int64_t b, int64_t s, int64_t h, int64_t d, bool bhsd)
      : memory(bhsd ? Tensor<float, 4>({b, h, s, d}) : Tensor<float, 4>({b, s, h, d})),
        view(bhsd ? View4<float>::from_bhsd(memory.data(), b, h, s, d) : memory.view()) {}
};

Shard shard_of(const Tensor<float, 4>& global, const RingCase& c, bool bhsd) {
  const auto& s = global.shape();
  Shard local(s[0], shard_length(s[1], world_size(), world_rank(), c.sharding), s[2], s[3], bhsd);
  shard_into(global.cview(), local.view, world_size(), world_rank(), c.sharding);
  return local;
}

Results<float> run_ring(const RingCase& c, const AttentionOptions& options, const Tensor<float, 4>& q,
                        const Tensor<float, 4>& k, const Tensor<float, 4>& v, const Tensor<float, 4>& dout) {
  const RingOptions ring{.sharding = c.sharding, .progress_rows = c.progress_rows};
  const Shard lq = shard_of(q, c, c.bhsd), lk = shard_of(k, c, c.bhsd), lv = shard_of(v, c, c.bhsd);
  const Shard ldout = shard_of(dout, c, c.bhsd);
  const int64_t nq = lq.view.shape[1], nk = lk.view.shape[1];
  Shard out(c.batch, nq, c.q_heads, c.v_dim, c.bhsd), dq(c.batch, nq, c.q_heads, c.dim, c.bhsd);
  Shard dk(c.batch, nk, c.kv_heads, c.dim, c.bhsd), dv(c.batch, nk, c.kv_heads, c.v_dim, c.bhsd);
  Tensor<float, 3> lse({c.batch, c.q_heads, nq});
  ring_attention_forward({.q = lq.view, .k = lk.view, .v = lv.view, .out = out.view, .lse = lse.view()}, options,
                         MPI_COMM_WORLD, ring);
  ring_attention_backward({.q = lq.view, .k = lk.view, .v = lv.view, .out = out.view, .lse = lse.cview(),
                           .dout = ldout.view, .dq = dq.view, .dk = dk.view, .dv = dv.view},
                          options, MPI_COMM_WORLD, ring);
  // lse [B, H, n] seen as [B, n, H, 1] to gather it along the sequence like the rest.
  const auto l = lse.cview();
  const View4<const float> lse4(l.data, {c.batch, nq, c.q_heads, 1}, {l.strides[0], l.strides[2], l.strides[1], 1});
  const Tensor<float, 4> lse_all = gather_sequence(lse4, MPI_COMM_WORLD, c.sharding);
  Results<float> r{gather_sequence(out.view, MPI_COMM_WORLD, c.sharding),
                   gather_sequence(dq.view, MPI_COMM_WORLD, c.sharding),
                   gather_sequence(dk.view, MPI_COMM_WORLD, c.sharding),
                   gather_sequence(dv.view, MPI_COMM_WORLD, c.sharding), Tensor<float, 3>({c.batch, c.q_heads, c.q_len})};
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.q_heads; ++h)
      for (int64_t n = 0; n < c.q_len; ++n) r.lse(b, h, n) = lse_all(b, n, h, 0);
  return r;
}

template <int R>
void expect_rule(const std::string& what, const Tensor<float, R>& ring, const Tensor<float, R>& cpu,
                 const Tensor<double, R>& exact) {
  const double floor = 8.0 * std::numeric_limits<float>::epsilon() * std::max(1.0, max_abs(exact));
  const double ring_error = error(ring, exact), cpu_error = error(cpu, exact);
  const double bound = 2.0 * cpu_error + floor;
  EXPECT_LE(ring_error, bound) << what << ": ring error " << ring_error << ", single-process error "
                               << cpu_error << ", bound " << bound;
  if (std::getenv("QKV_DIST_VERBOSE") && world_rank() == 0) {
    std::printf("  %-40s ring %.3g  single %.3g  bound %.3g\n", what.c_str(), ring_error, cpu_error, bound);
  }
}

void check_case(const RingCase& c) {
  SCOPED_TRACE(c.name);
  AttentionOptions options;
  options.scale = c.scale;
  options.causal = c.causal;
  options.key_lengths = c.key_lengths;
  options.execution.threads = 1;  // ranks share this machine's cores
  const auto q = test::random_tensor<float, 4>({c.batch, c.q_len, c.q_heads, c.dim}, 101);
  const auto k = test::random_tensor<float, 4>({c.batch, c.k_len, c.kv_heads, c.dim}, 102);
  const auto v = test::random_tensor<float, 4>({c.batch, c.k_len, c.kv_heads, c.v_dim}, 103);
  const auto dout = test::random_tensor<float, 4>({c.batch, c.q_len, c.q_heads, c.v_dim}, 104);

  const Results<float> ring = run_ring(c, options, q, k, v, dout);
  const Results<float> cpu = single_process(c, options, q, k, v, dout);
  AttentionOptions exact_options = options;
  exact_options.execution.backend = Backend::reference;
  const Results<double> exact = single_process(c, exact_options, widen(q), widen(k), widen(v), widen(dout));
  expect_rule(c.name + " out", ring.out, cpu.out, exact.out);
  expect_rule(c.name + " lse", ring.lse, cpu.lse, exact.lse);
  expect_rule(c.name + " dq", ring.dq, cpu.dq, exact.dq);
  expect_rule(c.name + " dk", ring.dk, cpu.dk, exact.dk);
  expect_rule(c.name + " dv", ring.dv, cpu.dv, exact.dv);
}

std::vector<RingCase> cases() {
  std::vector<RingCase> all;
  all.push_back({.name = "full", .batch = 2, .q_len = 37, .k_len = 37});
  all.push_back({.name = "causal_zigzag", .q_len = 64, .k_len = 64, .dim = 32, .v_dim = 32,
                 .causal = Causal::top_left});
  all.push_back({.name = "causal_contiguous", .q_len = 50, .k_len = 50, .causal = Causal::top_left,
                 .sharding = Sharding::contiguous});
  all.push_back({.name = "gqa_bottom_right_cross", .q_len = 29, .k_len = 53, .q_heads = 4, .kv_heads = 2,
                 .dim = 24, .v_dim = 8, .causal = Causal::bottom_right, .scale = 0.3});
  all.push_back({.name = "top_left_more_queries", .q_len = 40, .k_len = 23, .causal = Causal::top_left});
  all.push_back({.name = "key_lengths_causal", .batch = 3, .q_len = 45, .k_len = 45,
                 .causal = Causal::top_left, .key_lengths = {45, 17, 0}});
  all.push_back({.name = "key_lengths_bottom_right_mqa", .batch = 2, .q_len = 20, .k_len = 50, .q_heads = 3,
                 .kv_heads = 1, .causal = Causal::bottom_right, .key_lengths = {31, 50}});
  all.push_back({.name = "key_lengths_full_bhsd", .batch = 2, .q_len = 33, .k_len = 31, .dim = 8, .v_dim = 12,
                 .key_lengths = {5, 30}, .bhsd = true});
  all.push_back({.name = "causal_bhsd", .q_len = 47, .k_len = 47, .causal = Causal::top_left, .bhsd = true});
  // Block calls cut into pieces of a few rows (RingOptions::progress_rows).
  all.push_back({.name = "pieces_causal_gqa", .batch = 2, .q_len = 61, .k_len = 61, .q_heads = 4, .kv_heads = 2,
                 .causal = Causal::top_left, .progress_rows = 5});
  all.push_back({.name = "pieces_bottom_right_key_lengths", .batch = 2, .q_len = 30, .k_len = 57,
                 .causal = Causal::bottom_right, .key_lengths = {40, 57}, .progress_rows = 3});
  // Fewer rows than ranks: some ranks hold nothing and still take part in the ring.
  all.push_back({.name = "one_row", .q_len = 1, .k_len = 1, .causal = Causal::top_left});
  all.push_back({.name = "two_rows", .q_len = 2, .k_len = 2, .causal = Causal::top_left});
  all.push_back({.name = "three_rows_full", .q_len = 3, .k_len = 5});
  return all;
}

class RingAttention : public ::testing::TestWithParam<RingCase> {};

TEST_P(RingAttention, MatchesTheSingleProcessKernel) { check_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, RingAttention, ::testing::ValuesIn(cases()),
                         [](const auto& param_info) { return param_info.param.name; });

// Runs `call` on every rank; every rank must throw a qkv::Error containing `expected`.
template <class Call>
void expect_error_everywhere(Call&& call, const std::string& expected) {
  try {
    call();
    ADD_FAILURE() << "expected qkv::Error containing \"" << expected << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
}

struct LocalProblem {
  Tensor<float, 4> q, k, v, out;
  Tensor<float, 3> lse;
  LocalProblem(int64_t nq, int64_t nk, int64_t heads, int64_t q_heads_here, int64_t out_rows)
      : q(test::random_tensor<float, 4>({1, nq, q_heads_here, 8}, 5)),
        k(test::random_tensor<float, 4>({1, nk, heads, 8}, 6)),
        v(test::random_tensor<float, 4>({1, nk, heads, 8}, 7)),
        out({1, out_rows, q_heads_here, 8}),
        lse({1, q_heads_here, nq}) {}
  ForwardArgs<float> args() {
    return {.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(), .lse = lse.view()};
  }
};

TEST(RingErrors, EveryRankThrowsTheSameError) {
  const int world = world_size(), rank = world_rank(), last = world - 1;
  const int64_t rows = shard_length(10 * world, world, rank, Sharding::zigzag);
  AttentionOptions options;
  options.execution.threads = 1;

  {  // A local mistake on the last rank only: out has a row too many.
    LocalProblem p(rows, rows, 2, 2, rank == last ? rows + 1 : rows);
    test::fill(p.out, 7.0f);
    expect_error_everywhere([&] { ring_attention_forward(p.args(), options, MPI_COMM_WORLD); },
                            "rank " + std::to_string(last) + ": ");
    EXPECT_EQ(p.out[0], 7.0f) << "nothing is written when any rank fails";
  }
  {  // Ranks disagree on the head count.
    LocalProblem p(rows, rows, 2, rank == last ? 4 : 2, rows);
    expect_error_everywhere([&] { ring_attention_forward(p.args(), options, MPI_COMM_WORLD); },
                            "q.shape[2] (heads)");
  }
  {  // Shards of the wrong length for zigzag sharding of the total.
    const int64_t wrong = rank == 0 ? 10 * world : 0;  // all on rank 0
    LocalProblem p(wrong, wrong, 2, 2, wrong);
    expect_error_everywhere([&] { ring_attention_forward(p.args(), options, MPI_COMM_WORLD); },
                            "zigzag sharding");
  }
  {  // A mask cannot be sharded by the ring.
    LocalProblem p(rows, rows, 2, 2, rows);
    Tensor<std::uint8_t, 4> keep({1, 1, 1, rows});
    AttentionOptions masked = options;
    masked.mask.keep = keep.cview();
    expect_error_everywhere([&] { ring_attention_forward(p.args(), masked, MPI_COMM_WORLD); },
                            "options.mask");
  }
  {  // key_lengths beyond the global key length (checked on every rank alike).
    LocalProblem p(rows, rows, 2, 2, rows);
    const std::vector<int64_t> lengths{10 * world + 1};
    AttentionOptions padded = options;
    padded.key_lengths = lengths;
    expect_error_everywhere([&] { ring_attention_forward(p.args(), padded, MPI_COMM_WORLD); },
                            "key_lengths[0]");
  }
  {  // check_finite: a NaN on rank 0 only.
    LocalProblem p(rows, rows, 2, 2, rows);
    if (rank == 0 && rows > 0) p.v[3] = std::nanf("");
    AttentionOptions checked = options;
    checked.execution.check_finite = true;
    expect_error_everywhere([&] { ring_attention_forward(p.args(), checked, MPI_COMM_WORLD); },
                            "rank 0: qkv::dist::ring_attention_forward: check_finite: v[");
  }
  // The communicator is still usable: a correct call after all those errors.
  check_case({.name = "after_errors", .q_len = 10 * world, .k_len = 10 * world, .causal = Causal::top_left});
}

TEST(RingErrors, BackwardChecksToo) {
  const int world = world_size(), rank = world_rank();
  const int64_t rows = shard_length(6 * world, world, rank, Sharding::zigzag);
  LocalProblem p(rows, rows, 2, 2, rows);
  Tensor<float, 4> dq({1, rows, 2, 8}), dk({1, rows, 2, 8}), dv({1, rows + (rank == 0 ? 1 : 0), 2, 8});
  AttentionOptions options;
  options.execution.threads = 1;
  expect_error_everywhere(
      [&] {
        ring_attention_backward({.q = p.q.cview(), .k = p.k.cview(), .v = p.v.cview(), .out = p.out.cview(),
                                 .lse = p.lse.cview(), .dout = p.out.cview(), .dq = dq.view(), .dk = dk.view(),
                                 .dv = dv.view()},
                                options, MPI_COMM_WORLD);
      },
      "rank 0: qkv::dist::ring_attention_backward: dv.shape[1]");
}

}  // namespace
}  // namespace qkv::dist
