#include "parallel.hpp"

#include <atomic>
#include <string>

#include "check.hpp"
#include "qkv/nn/threads.hpp"

namespace qkv::nn {
namespace detail {
namespace {
std::atomic<int> g_threads{1};
}  // namespace

int thread_count() { return g_threads.load(std::memory_order_relaxed); }

void use_single_threaded_blas();  // gemm.cpp

}  // namespace detail

void set_threads(int n) {
  detail::expect(n >= 1, "set_threads", "n: expected ≥ 1, got " + std::to_string(n));
  detail::use_single_threaded_blas();
  detail::g_threads.store(n, std::memory_order_relaxed);
}

int threads() { return detail::thread_count(); }

}  // namespace qkv::nn
