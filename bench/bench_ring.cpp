// Ring attention (qkv::dist) on W local ranks: how long each ring step computes, how
// long its message takes, and how much of the message the compute hides.
//
//   mpiexec -n W build/release/bench/qkv_bench_ring [--seq 4096,8192] [--heads 8]
//       [--kv-heads 8] [--dim 64] [--threads 1] [--repeats 5] [--causal 0|1]
//       [--progress-rows 256]
//
// For each sequence length, four timings (median of --repeats after a warm-up; each
// the slowest rank's, since a ring is as slow as its slowest rank):
//   ring     ring_attention_forward / _backward as shipped (messages overlap compute);
//   compute  the same block calls (cut into the same pieces) and merges with no
//            messages (a local K/V buffer stands in for the visiting one);
//   comm     the same messages with no compute (W−1 K/V transfers forward; W−1 K/V
//            plus W dK/dV transfers backward);
//   overlap  (compute + comm − ring) / min(compute, comm): 1 = the smaller of the two
//            is fully hidden, 0 = they ran one after the other.
// FLOPs: forward 4·B·Hq·N²·d (half when causal), backward 2.5× that. Rank 0 prints one
// Markdown row per (N, pass). See bench/RING.md for the scaling model these feed.
#include <mpi.h>

#include <qkv/dist.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

using qkv::AttentionOptions;
using qkv::Tensor;
using qkv::View3;
using qkv::View4;

struct Config {
  std::vector<int64_t> seqs{4096, 8192};
  int64_t heads = 8, kv_heads = 8, dim = 64;
  int threads = 1, repeats = 5;
  int64_t progress_rows = 256;  // RingOptions::progress_rows, for the ring and compute alike
  bool causal = true;
};

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--seq") {
      c.seqs.clear();
      std::stringstream list(value);
      for (std::string item; std::getline(list, item, ',');) c.seqs.push_back(std::stoll(item));
    } else if (flag == "--heads") {
      c.heads = std::stoll(value);
    } else if (flag == "--kv-heads") {
      c.kv_heads = std::stoll(value);
    } else if (flag == "--dim") {
      c.dim = std::stoll(value);
    } else if (flag == "--threads") {
      c.threads = std::stoi(value);
    } else if (flag == "--repeats") {
      c.repeats = std::stoi(value);
    } else if (flag == "--progress-rows") {
      c.progress_rows = std::stoll(value);
    } else if (flag == "--causal") {
      c.causal = value != "0";
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  return c;
}

Tensor<float, 4> random4(const std::array<int64_t, 4>& shape, unsigned seed) {
  Tensor<float, 4> t(shape);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = normal(rng);
  return t;
}

// Median over repeats of the slowest rank's time of `body`, after one warm-up.
template <class Body>
double timed(int repeats, Body&& body) {
  std::vector<double> times;
  for (int r = 0; r <= repeats; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    body();
    const double mine = MPI_Wtime() - start;
    double slowest = 0.0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (r > 0) times.push_back(slowest);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// View rows [b0, b1) × [n0, n1) of a [B, N, H, D] view.
template <class T>
View4<T> rows(const View4<T>& v, int64_t b0, int64_t b1, int64_t n0, int64_t n1) {
  return View4<T>(v.data + b0 * v.strides[0] + n0 * v.strides[1], {b1 - b0, n1 - n0, v.shape[2], v.shape[3]},
                  v.strides);
}
template <class T>
View3<T> lse_rows(const View3<T>& v, int64_t b0, int64_t b1, int64_t n0, int64_t n1) {
  return View3<T>(v.data + b0 * v.strides[0] + n0 * v.strides[2], {b1 - b0, v.shape[1], n1 - n0}, v.strides);
}

// One message per step to the next rank and one from the previous, of the sizes the
// ring sends: {floats sent, floats received} per step.
struct Exchange {
  int64_t send = 0, recv = 0;
};

void ring_messages(int world, int rank, const std::vector<Exchange>& steps, std::vector<float>& a,
                   std::vector<float>& b) {
  const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
  for (const Exchange& step : steps) {
    MPI_Request requests[2];
    MPI_Irecv(b.data(), static_cast<int>(step.recv), MPI_FLOAT, prev, 1, MPI_COMM_WORLD, &requests[0]);
    MPI_Isend(a.data(), static_cast<int>(step.send), MPI_FLOAT, next, 1, MPI_COMM_WORLD, &requests[1]);
    MPI_Waitall(2, requests, MPI_STATUSES_IGNORE);
    std::swap(a, b);
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const Config c = parse(argc, argv);
  int world = 0, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    std::printf("# ranks=%d heads=%lld kv_heads=%lld d=%lld threads/rank=%d causal=%d repeats=%d "
                "progress_rows=%lld\n",
                world, static_cast<long long>(c.heads), static_cast<long long>(c.kv_heads),
                static_cast<long long>(c.dim), c.threads, c.causal ? 1 : 0, c.repeats,
                static_cast<long long>(c.progress_rows));
    std::printf("| N | pass | ring ms | compute ms | comm ms | overlap | GFLOP/s/rank | compute/step ms "
                "| MB/step | comm GB/s |\n|---|---|---|---|---|---|---|---|---|---|\n");
  }
  AttentionOptions options;
  options.causal = c.causal ? qkv::Causal::top_left : qkv::Causal::none;
  options.execution.threads = c.threads;
  const int64_t B = 1, H = c.heads, Hkv = c.kv_heads, d = c.dim;
  const qkv::dist::RingOptions ring{.progress_rows = c.progress_rows};

  for (int64_t N : c.seqs) {
    const int64_t n = qkv::dist::shard_length(N, world, rank, qkv::dist::Sharding::zigzag);
    const auto q = random4({B, n, H, d}, 1 + rank), k = random4({B, n, Hkv, d}, 11 + rank);
    const auto v = random4({B, n, Hkv, d}, 21 + rank), dout = random4({B, n, H, d}, 31 + rank);
    Tensor<float, 4> out({B, n, H, d}), dq({B, n, H, d}), dk({B, n, Hkv, d}), dv({B, n, Hkv, d});
    Tensor<float, 3> lse({B, H, n});
    const qkv::dist::RingProblem problem{.world = world, .batch = B, .q_len = N, .k_len = N,
                                         .causal = options.causal};
    std::vector<int64_t> k_rows;
    for (int r = 0; r < world; ++r)
      k_rows.push_back(qkv::dist::shard_length(N, world, r, qkv::dist::Sharding::zigzag));
    const int64_t max_rows = *std::max_element(k_rows.begin(), k_rows.end());
    // A stand-in for the visiting block: this rank's keys padded to the longest shard.
    const auto k_any = random4({B, max_rows, Hkv, d}, 41), v_any = random4({B, max_rows, Hkv, d}, 51);

    const double ring_fwd = timed(c.repeats, [&] {
      qkv::dist::ring_attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                                         .lse = lse.view()},
                                        options, MPI_COMM_WORLD, ring);
    });
    const double ring_bwd = timed(c.repeats, [&] {
      qkv::dist::ring_attention_backward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.cview(),
                                          .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(),
                                          .dk = dk.view(), .dv = dv.view()},
                                         options, MPI_COMM_WORLD, ring);
    });

    // Compute only: the plan's calls, with the stand-in block.
    Tensor<float, 4> acc({B, n, H, d}), part({B, n, H, d}), pdq({B, n, H, d});
    Tensor<float, 4> pdk({B, max_rows, Hkv, d}), pdv({B, max_rows, Hkv, d});
    Tensor<float, 3> acc_lse({B, H, n}), part_lse({B, H, n});
    auto calls_for = [&](int step) {
      std::vector<qkv::dist::BlockCall> pieces;
      for (const auto& call : qkv::dist::ring_block_calls(problem, rank, qkv::dist::ring_kv_owner(world, rank, step)))
        for (const auto& piece : qkv::dist::split_queries(call, c.progress_rows)) pieces.push_back(piece);
      return pieces;
    };
    const double compute_fwd = timed(c.repeats, [&] {
      for (int step = 0; step < world; ++step) {
        for (const auto& call : calls_for(step)) {
          AttentionOptions o = options;
          o.causal = call.causal;
          const int64_t nq = call.q_end - call.q_begin;
          const auto pv = View4<float>::contiguous(part.data(), {B, nq, H, d});
          const auto pl = View3<float>::contiguous(part_lse.data(), {B, H, nq});
          qkv::attention_forward({.q = rows(q.cview(), 0, B, call.q_begin, call.q_end),
                                  .k = rows(k_any.cview(), 0, B, call.k_begin, call.k_end),
                                  .v = rows(v_any.cview(), 0, B, call.k_begin, call.k_end), .out = pv, .lse = pl},
                                 o);
          qkv::merge_partials(rows(acc.view(), 0, B, call.q_begin, call.q_end),
                              lse_rows(acc_lse.view(), 0, B, call.q_begin, call.q_end), pv, pl);
        }
      }
    });
    const double compute_bwd = timed(c.repeats, [&] {
      for (int step = 0; step < world; ++step) {
        for (const auto& call : calls_for(step)) {
          AttentionOptions o = options;
          o.causal = call.causal;
          const int64_t nq = call.q_end - call.q_begin, nk = call.k_end - call.k_begin;
          qkv::attention_backward(
              {.q = rows(q.cview(), 0, B, call.q_begin, call.q_end),
               .k = rows(k_any.cview(), 0, B, call.k_begin, call.k_end),
               .v = rows(v_any.cview(), 0, B, call.k_begin, call.k_end),
               .out = rows(out.cview(), 0, B, call.q_begin, call.q_end),
               .lse = lse_rows(lse.cview(), 0, B, call.q_begin, call.q_end),
               .dout = rows(dout.cview(), 0, B, call.q_begin, call.q_end),
               .dq = View4<float>::contiguous(pdq.data(), {B, nq, H, d}),
               .dk = View4<float>::contiguous(pdk.data(), {B, nk, Hkv, d}),
               .dv = View4<float>::contiguous(pdv.data(), {B, nk, Hkv, d})},
              o);
        }
      }
    });

    // Communication only: the ring's messages, same sizes, same order.
    const int64_t floats_per_row = B * Hkv * 2 * d;
    std::vector<Exchange> fwd_steps, bwd_steps;
    auto block_at = [&](int step) {  // floats of the block this rank holds at `step`
      return floats_per_row * k_rows[qkv::dist::ring_kv_owner(world, rank, step % world)];
    };
    for (int step = 0; step + 1 < world; ++step) fwd_steps.push_back({block_at(step), block_at(step + 1)});
    for (int step = 0; step < world; ++step) {
      if (step + 1 < world) bwd_steps.push_back({block_at(step), block_at(step + 1)});  // K/V
      if (world > 1) bwd_steps.push_back({block_at(step), block_at(step + 1)});         // dK/dV
    }
    std::vector<float> buf_a(static_cast<std::size_t>(floats_per_row * max_rows)), buf_b(buf_a.size());
    const double comm_fwd = timed(c.repeats, [&] { ring_messages(world, rank, fwd_steps, buf_a, buf_b); });
    const double comm_bwd = timed(c.repeats, [&] { ring_messages(world, rank, bwd_steps, buf_a, buf_b); });

    if (rank == 0) {
      const double flops_fwd = 4.0 * double(B * H * d) * double(N) * double(N) * (c.causal ? 0.5 : 1.0);
      const double step_mb = double(floats_per_row * max_rows) * 4.0 / 1e6;
      auto row = [&](const char* pass, double ring_time, double compute, double comm, double flops, std::size_t messages) {
        const double overlap = world > 1 ? (compute + comm - ring_time) / std::min(compute, comm) : 0.0;
        const double per_message = messages ? comm / double(messages) : 0.0;
        std::printf("| %lld | %s | %.2f | %.2f | %.2f | %.2f | %.1f | %.3f | %.2f | %.2f |\n",
                    static_cast<long long>(N), pass, ring_time * 1e3, compute * 1e3, comm * 1e3, overlap,
                    flops / ring_time / world / 1e9, compute / world * 1e3, step_mb,
                    per_message > 0 ? step_mb / 1e3 / per_message : 0.0);
      };
      row("fwd", ring_fwd, compute_fwd, comm_fwd, flops_fwd, fwd_steps.size());
      row("bwd", ring_bwd, compute_bwd, comm_bwd, 2.5 * flops_fwd, bwd_steps.size());
      std::fflush(stdout);
    }
  }
  MPI_Finalize();
  return 0;
}
