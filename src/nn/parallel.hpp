// The one way qkv::nn runs work on several threads: a loop over a fixed number of
// independent blocks on OpenMP's pool (the pool the attention core uses as well).
// Callers choose blocks from the problem's shape alone, never from the thread count, so
// every result is the same for any number of threads.
#pragma once

#include <cstdint>

namespace qkv::nn::detail {

int thread_count();  // qkv::nn::threads()

// Rows per block for row-wise loops: large enough that a block's work dwarfs the cost
// of handing it to a thread, small enough that 2–16 threads get balanced work for the
// B·N = 10²–10⁴ rows of a training step.
inline constexpr int64_t kRowBlock = 64;

inline int64_t block_count(int64_t n, int64_t block) { return (n + block - 1) / block; }

// Runs body(i) for i in [0, count), spread over the threads, in no particular order.
template <class Body>
void parallel_for(int64_t count, Body&& body) {
  const int threads = thread_count();
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count > 1)
  for (int64_t i = 0; i < count; ++i) body(i);
}

// Runs body(begin, end) over [0, n) in blocks of `block`.
template <class Body>
void parallel_blocks(int64_t n, int64_t block, Body&& body) {
  parallel_for(block_count(n, block), [&](int64_t i) {
    const int64_t begin = i * block;
    body(begin, begin + block < n ? begin + block : n);
  });
}

}  // namespace qkv::nn::detail
