// Gradient-norm clipping, as torch.nn.utils.clip_grad_norm_ (L2, all parameters as one
// vector):  n = ‖(g₁, …, g_k)‖₂;  if n > max_norm, every g ← g · max_norm / (n + 1e-6).
#pragma once

#include "qkv/nn/parameter.hpp"

namespace qkv::nn {

// Returns n, the norm before clipping (accumulated in double). A non-finite n leaves the
// gradients untouched (the caller decides what to do with a NaN step). max_norm must
// be > 0, else qkv::Error.
double clip_grad_norm(const ParameterList<float>& parameters, double max_norm);
double clip_grad_norm(const ParameterList<double>& parameters, double max_norm);

// The L2 norm of all gradients, without changing them.
double grad_norm(const ParameterList<float>& parameters);
double grad_norm(const ParameterList<double>& parameters);

}  // namespace qkv::nn
