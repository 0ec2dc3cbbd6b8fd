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

// Validation has already refused cpu for double and for weights. The cpu kernels take
// float and the 16-bit storage types (widened to float inside).
template <class T>
void run_forward(const detail::ForwardProblem<T>& problem, Backend backend) {
  if constexpr (!std::is_same_v<T, double>) {
    if (backend == Backend::cpu) {
      if constexpr (std::is_same_v<T, float>) {
        // Few queries against many keys: the decode kernel reads each K/V head once per
        // GQA group and splits the keys across threads. It keeps no softmax statistics
        // (yet): calls that ask for them run the tiled forward, which does; nor does it
        // run score_mod / mask_mod.
        const bool programmable = problem.modifiers.has_score_mod() || problem.mask.has_mask_mod();
        if (!problem.collect_stats && !programmable && cpu::forward_by_decode(problem)) return;
      }
      return cpu::forward(problem);
    }
  }
  reference::forward(problem);
}

template <class T>
void run_backward(const detail::BackwardProblem<T>& problem, Backend backend) {
  if constexpr (!std::is_same_v<T, double>) {
    if (backend == Backend::cpu) return cpu::backward(problem);
  }
  reference::backward(problem);
}

template <class T>
void forward_entry(const ForwardArgs<T>& args, const AttentionOptions& options) {
  const auto problem = detail::validate(args, options);
  run_forward(problem, resolve_backend(options, std::is_same_v<T, double>, !args.weights.empty()));
}

template <class T>
void backward_entry(const BackwardArgs<T>& args, const AttentionOptions& options) {
  const auto problem = detail::validate(args, options);
  run_backward(problem, resolve_backend(options, std::is_same_v<T, double>, false));
}

// Varlen calls validate into ordinary problems (batch entries = sequences).
template <class T>
void varlen_forward_entry(const VarlenForwardArgs<T>& args, const AttentionOptions& options) {
  run_forward(detail::validate(args, options),
              resolve_backend(options, std::is_same_v<T, double>, false));
}

template <class T>
void varlen_backward_entry(const VarlenBackwardArgs<T>& args, const AttentionOptions& options) {
  run_backward(detail::validate(args, options),
               resolve_backend(options, std::is_same_v<T, double>, false));
}

}  // namespace

#define QKV_DEFINE_ENTRY_POINTS(T)                                                           \
  void attention_forward(const ForwardArgs<T>& args, const AttentionOptions& options) {      \
    forward_entry(args, options);                                                            \
  }                                                                                          \
  void attention_backward(const BackwardArgs<T>& args, const AttentionOptions& options) {    \
    backward_entry(args, options);                                                           \
  }                                                                                          \
  void varlen_attention_forward(const VarlenForwardArgs<T>& args,                            \
                                const AttentionOptions& options) {                           \
    varlen_forward_entry(args, options);                                                     \
  }                                                                                          \
  void varlen_attention_backward(const VarlenBackwardArgs<T>& args,                          \
                                 const AttentionOptions& options) {                          \
    varlen_backward_entry(args, options);                                                    \
  }
QKV_DEFINE_ENTRY_POINTS(float)
QKV_DEFINE_ENTRY_POINTS(double)
QKV_DEFINE_ENTRY_POINTS(bfloat16)
QKV_DEFINE_ENTRY_POINTS(float16)
#undef QKV_DEFINE_ENTRY_POINTS

}  // namespace qkv
