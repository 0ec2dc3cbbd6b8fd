// The rules every attention entry point checks alike (core/validate.cpp,
// core/validate_varlen.cpp, cache/decode.cpp, cache/kv_cache.cpp), on the shared Checker
// (check/checker.hpp): one function per rule, so the same bad value gives the same
// message from attention_forward, varlen, decode and the caches.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>

#include "check/checker.hpp"
#include "qkv/options.hpp"

namespace qkv::detail {

// Longest sequence (and packed total) a call may have: the kernels index rows with int32.
inline constexpr int64_t kMaxRows = 2147483647;

// Grouped-query attention: every key/value head serves the same number of query heads.
// `axis` is the heads axis of q and kv (2 for [B, N, H, d] views, 1 for packed ones).
inline void check_head_groups(const Checker& check, const Described& q, const Described& kv,
                              int axis) {
  if (q.shape[axis] % kv.shape[axis] != 0) {
    std::ostringstream out;
    out << q.name << ".shape[" << axis << "] (heads): expected a multiple of " << kv.name
        << ".shape[" << axis << "] (key/value heads) = " << kv.shape[axis]
        << " for grouped-query attention, got " << q.shape[axis];
    check.fail(out.str());
  }
}

// The scale of q·kᵀ: 1/√head_dim when unset (`scale` is options.scale of any entry point).
// Checked in float, the type the kernels multiply in: a double such as 1e39 is finite but
// rounds to inf in float (every output NaN), and 1e-46 rounds to 0.
inline double resolve_scale(const Checker& check, const std::optional<double>& scale,
                            int64_t head_dim) {
  if (!scale) return 1.0 / std::sqrt(static_cast<double>(head_dim));
  const double value = *scale;
  const bool valid_double = std::isfinite(value) && value > 0.0;
  const float as_float = valid_double ? static_cast<float>(value) : 0.0f;
  if (!valid_double || !std::isfinite(as_float) || as_float <= 0.0f) {
    std::ostringstream out;
    out << "options.scale: expected a finite value > 0, got " << value;
    if (valid_double) out << " (" << as_float << " as a float, the type the kernels compute in)";
    check.fail(out.str());
  }
  return value;
}

inline double resolve_scale(const Checker& check, const AttentionOptions& options, int64_t head_dim) {
  return resolve_scale(check, options.scale, head_dim);
}

// The machine's hardware threads, asked once per process: glibc answers
// std::thread::hardware_concurrency() by reading /sys/devices/system/cpu/online (an open,
// a read and a close, 3–12 µs measured here), which a small call cannot afford each time.
// CPUs brought online later are not seen; the thread count changes speed only, never
// results.
inline int hardware_threads() {
  static const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return threads;
}

// The thread count to run with: 0 means every hardware thread. `option` names the field
// in messages, since the entry points keep it in different places.
inline int resolve_threads(const Checker& check, int requested, const char* option) {
  if (requested < 0) {
    check.fail(std::string(option) + ": expected >= 0 (0 = all hardware threads), got " +
               std::to_string(requested));
  }
  if (requested > 0) return requested;
  return hardware_threads();
}

inline int resolve_threads(const Checker& check, const AttentionOptions& options) {
  return resolve_threads(check, options.execution.threads, "options.execution.threads");
}

// options.key_lengths: empty, or one length in [0, k_len] per batch entry.
inline void check_key_lengths(const Checker& check, std::span<const int64_t> lengths, int64_t batch,
                              int64_t k_len) {
  if (lengths.empty()) return;
  if (static_cast<int64_t>(lengths.size()) != batch) {
    check.fail("options.key_lengths: expected one length per batch entry (" + std::to_string(batch) +
               "), got " + std::to_string(lengths.size()));
  }
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 0 || lengths[b] > k_len) {
      check.fail("options.key_lengths[" + std::to_string(b) + "]: expected 0.." + std::to_string(k_len) +
                 " (the key length), got " + std::to_string(lengths[b]));
    }
  }
}

inline Causal checked_causal(const Checker& check, Causal causal) {
  if (causal != Causal::none && causal != Causal::top_left && causal != Causal::bottom_right) {
    check.fail("options.causal: expected none, top_left or bottom_right, got value " +
               std::to_string(static_cast<int>(causal)));
  }
  return causal;
}

inline Causal checked_causal(const Checker& check, const AttentionOptions& options) {
  return checked_causal(check, options.causal);
}

inline void check_backend(const Checker& check, const AttentionOptions& options, bool is_double,
                   bool wants_weights) {
  const Backend chosen = options.execution.backend;
  if (chosen != Backend::automatic && chosen != Backend::reference && chosen != Backend::cpu) {
    check.fail("options.execution.backend: unknown value " +
               std::to_string(static_cast<int>(chosen)));
  }
  if (chosen == Backend::cpu && is_double) {
    check.fail("options.execution.backend: cpu computes in float; double inputs need "
               "Backend::reference or Backend::automatic");
  }
  if (chosen == Backend::cpu && wants_weights) {
    check.fail("weights: the cpu backend never materializes the attention weights; use "
               "Backend::reference or Backend::automatic to get them");
  }
}

inline Precision checked_precision(const Checker& check, const AttentionOptions& options) {
  if (options.precision != Precision::fast && options.precision != Precision::exact) {
    check.fail("options.precision: expected fast or exact, got value " +
               std::to_string(static_cast<int>(options.precision)));
  }
  return options.precision;
}

// The execution options of a dense or varlen problem (ForwardProblem<T> or
// BackwardProblem<T>, core/problem.hpp): the backend checked, the scale and the thread
// count resolved into the problem. Last in every validator, after the views.
template <template <class> class Problem, class T>
void resolve_execution(const Checker& check, const AttentionOptions& options, bool wants_weights,
                       Problem<T>& problem) {
  check_backend(check, options, std::is_same_v<T, double>, wants_weights);
  problem.scale = resolve_scale(check, options, problem.extents.head_dim);
  problem.threads = resolve_threads(check, options);
  if constexpr (requires { problem.fixed_key_split; }) problem.fixed_key_split = options.execution.fixed_key_split;
  problem.precision = checked_precision(check, options);
}

}  // namespace qkv::detail
