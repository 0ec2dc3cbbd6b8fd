// Public entry points: validate once, pick a backend, run it into the caller's outputs.
#include "qkv/attention.hpp"

#include "core/validate.hpp"
#include "qkv/error.hpp"
#include "reference/reference.hpp"

namespace qkv {

Backend resolve_backend(const AttentionOptions& options, bool is_double, bool wants_weights) {
  const Backend requested = options.execution.backend;
  if (requested != Backend::automatic) return requested;
  (void)is_double;
  (void)wants_weights;
  return Backend::reference;  // the only backend until the fused cpu kernels land
}

namespace {

template <class Problem>
void run_forward(const Problem& problem, Backend backend) {
  switch (backend) {
    case Backend::reference:
      reference::forward(problem);
      return;
    case Backend::cpu:
    case Backend::automatic:
      break;
  }
  throw Error("qkv::attention_forward: options.execution.backend: cpu is not built into "
              "this version of qkv");
}

template <class Problem>
void run_backward(const Problem& problem, Backend backend) {
  switch (backend) {
    case Backend::reference:
      reference::backward(problem);
      return;
    case Backend::cpu:
    case Backend::automatic:
      break;
  }
  throw Error("qkv::attention_backward: options.execution.backend: cpu is not built into "
              "this version of qkv");
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

}  // namespace qkv
