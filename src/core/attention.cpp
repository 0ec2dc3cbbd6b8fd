// Public entry points: validate once, pick a backend, run it into the caller's outputs.
#include "qkv/attention.hpp"

#include <type_traits>

#include "core/validate.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/decode_dispatch.hpp"
#include "reference/reference.hpp"

namespace qkv {

Backend resolve_backend(const AttentionOptions& options, bool is_double, bool wants_weights) {
  const Backend requested = options.execution.backend;
  if (requested != Backend::automatic) return requested;
  // The fused kernels compute in float and never materialize P.
  return is_double || wants_weights ? Backend::reference : Backend::cpu;
}

namespace {

// Validation has already refused cpu for double and for weights.
template <class T>
void run_forward(const detail::ForwardProblem<T>& problem, Backend backend) {
  if constexpr (std::is_same_v<T, float>) {
    if (backend == Backend::cpu) {
      // Few queries against many keys: the decode kernel reads each K/V head once per
      // GQA group and splits the keys across threads. It keeps no softmax statistics
      // (yet): calls that ask for them run the tiled forward, which does.
      if (!problem.collect_stats && cpu::forward_by_decode(problem)) return;
      return cpu::forward(problem);
    }
  }
  reference::forward(problem);
}

template <class T>
void run_backward(const detail::BackwardProblem<T>& problem, Backend backend) {
  if constexpr (std::is_same_v<T, float>) {
    if (backend == Backend::cpu) return cpu::backward(problem);
  }
  reference::backward(problem);
}

}  // namespace

void attention_forward(const ForwardArgs<float>& args, const AttentionOptions& options) {
  const auto problem = detail::validate(args, options);
  run_forward(problem, resolve_backend(options, false, !args.weights.empty()));
}

void attention_forward(const ForwardArgs<double>& args, const AttentionOptions& options) {
  const auto problem = detail::validate(args, options);
  run_forward(problem, resolve_backend(options, true, !args.weights.empty()));
}

void attention_backward(const BackwardArgs<float>& args, const AttentionOptions& options) {
  const auto problem = detail::validate(args, options);
  run_backward(problem, resolve_backend(options, false, false));
}

void attention_backward(const BackwardArgs<double>& args, const AttentionOptions& options) {
  const auto problem = detail::validate(args, options);
  run_backward(problem, resolve_backend(options, true, false));
}

// Varlen calls validate into ordinary problems (batch entries = sequences).
void varlen_attention_forward(const VarlenForwardArgs<float>& args,
                              const AttentionOptions& options) {
  run_forward(detail::validate(args, options), resolve_backend(options, false, false));
}

void varlen_attention_forward(const VarlenForwardArgs<double>& args,
                              const AttentionOptions& options) {
  run_forward(detail::validate(args, options), resolve_backend(options, true, false));
}

void varlen_attention_backward(const VarlenBackwardArgs<float>& args,
                               const AttentionOptions& options) {
  run_backward(detail::validate(args, options), resolve_backend(options, false, false));
}

void varlen_attention_backward(const VarlenBackwardArgs<double>& args,
                               const AttentionOptions& options) {
  run_backward(detail::validate(args, options), resolve_backend(options, true, false));
}

}  // namespace qkv
