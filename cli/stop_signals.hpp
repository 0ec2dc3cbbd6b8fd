// Ctrl-C as a request, not a kill: while a StopOnSignals lives, SIGINT and SIGTERM set
// its flag instead of ending the process, so a long command can finish the step in
// progress, save and exit cleanly. A second signal of the same kind ends the process as
// usual (the handler is reset on first use), so an impatient user still gets out.
#pragma once

#include <signal.h>

#include <atomic>

namespace qkv::cli {

class StopOnSignals {
 public:
  StopOnSignals();   // installs the handlers (one instance at a time)
  ~StopOnSignals();  // restores the previous ones
  StopOnSignals(const StopOnSignals&) = delete;
  StopOnSignals& operator=(const StopOnSignals&) = delete;

  const std::atomic<bool>& requested() const;

 private:
  struct sigaction previous_int_{}, previous_term_{};
};

}  // namespace qkv::cli
