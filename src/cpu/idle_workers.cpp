// The process-wide setting of qkv/threads.hpp.
#include <atomic>

#include "qkv/threads.hpp"

namespace qkv {
namespace {
std::atomic<bool> workers_spin{false};
}  // namespace

void set_idle_workers_spin(bool spin) { workers_spin.store(spin, std::memory_order_relaxed); }

bool idle_workers_spin() { return workers_spin.load(std::memory_order_relaxed); }

}  // namespace qkv
