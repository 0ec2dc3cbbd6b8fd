// `qkv bench`: timing of attention forward and backward, for the CLI and its tests.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "qkv/options.hpp"

namespace qkv::cli {

struct BenchConfig {
  int64_t batch = 1;
  int64_t heads = 8;
  std::vector<int64_t> seqs{256, 1024};
  std::vector<int64_t> dims{64, 128};
  std::vector<Causal> causal{Causal::none, Causal::top_left};
  bool forward = true, backward = true;
  Backend backend = Backend::automatic;
  int threads = 0;
  int reps = 3;          // timed runs at least
  int max_reps = 1000;   // and at most
  double min_time = 0.5; // seconds of timed runs at least, per row
  std::uint64_t seed = 1;
};

struct BenchShape {
  int64_t batch = 0, heads = 0, seq = 0, dim = 0;
  Causal causal = Causal::none;
};

struct BenchRow {
  BenchShape shape;
  bool backward = false;
  int reps = 0;
  double median_s = 0.0, min_s = 0.0;
  double flops = 0.0, gflops = 0.0;
};

// Forward: 4·B·H·N²·d, halved when causal; backward: 2.5 × forward.
double attention_flops(const BenchShape& shape, bool backward);

// Throws qkv::Error naming the flag when a value is out of range.
void validate(const BenchConfig& config);

// Runs every (seq, dim, causal, pass) row; calls on_row as each finishes.
std::vector<BenchRow> run_bench(const BenchConfig& config,
                                const std::function<void(const BenchRow&)>& on_row = {});

}  // namespace qkv::cli
