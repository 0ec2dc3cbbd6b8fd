// Causal attention over a sequence sharded across the ranks of MPI_COMM_WORLD:
// every rank builds the same global q, k, v (a real program would load its own shard),
// keeps its zigzag shard, runs the ring, gathers the output and checks it against
// single-process attention on the whole sequence. Exit code 1 if they disagree.
#include <mpi.h>

#include <qkv/dist.hpp>

#include <cmath>
#include <cstdio>
#include <random>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int world = 0, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const int64_t B = 1, N = 1000, H = 4, d = 32;

  qkv::Tensor<float, 4> q({B, N, H, d}), k({B, N, H, d}), v({B, N, H, d});
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  for (auto* t : {&q, &k, &v})
    for (std::size_t i = 0; i < t->size(); ++i) (*t)[i] = normal(rng);

  // This rank's rows: chunks r and 2W−1−r of 2W.
  const auto zigzag = qkv::dist::Sharding::zigzag;
  const int64_t n = qkv::dist::shard_length(N, world, rank, zigzag);
  qkv::Tensor<float, 4> lq({B, n, H, d}), lk({B, n, H, d}), lv({B, n, H, d}), out({B, n, H, d});
  qkv::dist::shard_into(q.cview(), lq.view(), world, rank, zigzag);
  qkv::dist::shard_into(k.cview(), lk.view(), world, rank, zigzag);
  qkv::dist::shard_into(v.cview(), lv.view(), world, rank, zigzag);

  qkv::AttentionOptions options;
  options.causal = qkv::Causal::top_left;
  options.execution.threads = 1;
  qkv::dist::ring_attention_forward({.q = lq.cview(), .k = lk.cview(), .v = lv.cview(), .out = out.view()},
                                    options, MPI_COMM_WORLD);
  const qkv::Tensor<float, 4> ring = qkv::dist::gather_sequence(out.cview(), MPI_COMM_WORLD);

  qkv::Tensor<float, 4> single({B, N, H, d});
  qkv::attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = single.view()}, options);
  double worst = 0.0;
  for (std::size_t i = 0; i < single.size(); ++i) worst = std::fmax(worst, std::fabs(ring[i] - single[i]));
  if (rank == 0) {
    std::printf("%d ranks, %lld rows each (of %lld): max |ring - single process| = %.3g\n", world,
                static_cast<long long>(n), static_cast<long long>(N), worst);
  }
  MPI_Finalize();
  return worst < 1e-5 ? 0 : 1;  // fp32 rounding of values of size ~1
}
