// Public entry points: validate once, pick a backend, run it into the caller's outputs.
#include "qkv/attention.hpp"

#include <new>
#include <string>
#include <type_traits>

#include "core/dispatch.hpp"
#include "qkv/error.hpp"
#include "core/validate.hpp"
#include "cpu/cpu_backend.hpp"
#include "cpu/decode.hpp"
#include "reference/reference.hpp"

namespace qkv {

Backend resolve_backend(const AttentionOptions& options, bool is_double, bool wants_weights) {
  const Backend requested = options.execution.backend;
  if (requested != Backend::automatic) return requested;
  // The fused kernels compute in float and never materialize P.
  return is_double || wants_weights ? Backend::reference : Backend::cpu;
}

namespace {

// A workspace the system cannot give (the per-call plan, a backend's scratch) is a
// qkv::Error like any other refused call, not a std::bad_alloc.
template <class Run>
void out_of_memory_as_error(const char* pass, Run&& run) {
  try {
    run();
  } catch (const std::bad_alloc&) {
    throw Error(std::string("qkv: out of memory for the ") + pass + "'s workspace");
  }
}

// Validation has already refused cpu for double and for weights. The cpu backend takes
// float and the 16-bit storage types (widened to float inside) and chooses its schedule
// itself (cpu/forward_schedule.cpp).
template <class T>
void run_forward(const detail::ForwardProblem<T>& problem, Backend backend) {
  out_of_memory_as_error("forward", [&] {
    if constexpr (!std::is_same_v<T, double>) {
      if (backend == Backend::cpu) return cpu::forward(problem);
    }
    reference::forward(problem);
  });
}

template <class T>
void run_backward(const detail::BackwardProblem<T>& problem, Backend backend) {
  out_of_memory_as_error("backward", [&] {
    if constexpr (!std::is_same_v<T, double>) {
      if (backend == Backend::cpu) return cpu::backward(problem);
    }
    reference::backward(problem);
  });
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

void detail::run_planned_forward(const ForwardProblem<float>& problem, Backend backend,
                                 const cpu::DecodePlan* planned) {
  out_of_memory_as_error("forward", [&] {
    if (backend == Backend::cpu) return cpu::decode(problem, planned);
    reference::forward(problem);
  });
}

void detail::run_forward(const ForwardProblem<float>& problem, Backend backend) {
  qkv::run_forward(problem, backend);
}

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
