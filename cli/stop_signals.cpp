#include "stop_signals.hpp"

#include <stdexcept>

namespace qkv::cli {
namespace {

// Written by the handler: a lock-free atomic is async-signal-safe.
std::atomic<bool> stop_flag{false};
std::atomic<bool> installed{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void request_stop(int /*signal*/) { stop_flag.store(true, std::memory_order_relaxed); }

}  // namespace

StopOnSignals::StopOnSignals() {
  if (installed.exchange(true)) throw std::logic_error("StopOnSignals: already installed");
  stop_flag.store(false);
  struct sigaction action {};
  action.sa_handler = request_stop;
  sigemptyset(&action.sa_mask);
  // SA_RESETHAND: the first signal is a request; the next one has the default effect.
  // SA_RESTART: a read or write in progress continues instead of failing with EINTR.
  action.sa_flags = SA_RESETHAND | SA_RESTART;
  sigaction(SIGINT, &action, &previous_int_);
  sigaction(SIGTERM, &action, &previous_term_);
}

StopOnSignals::~StopOnSignals() {
  sigaction(SIGINT, &previous_int_, nullptr);
  sigaction(SIGTERM, &previous_term_, nullptr);
  installed.store(false);
}

const std::atomic<bool>& StopOnSignals::requested() const { return stop_flag; }

}  // namespace qkv::cli
