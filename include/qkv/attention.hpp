// Scaled dot-product attention, forward and backward.
//
// Shapes (logical order; any strides, inner dimension contiguous):
//   q    [B, Nq, Hq,  d ]      out  [B, Nq, Hq, dv]     lse      [B, Hq, Nq]
//   k    [B, Nk, Hkv, d ]                               weights  [B, Hq, Nq, Nk]
//   v    [B, Nk, Hkv, dv]
// Hq must be a multiple of Hkv (GQA; Hkv = 1 is MQA). Query head h reads key/value head
// h / (Hq / Hkv).
//
//   S = scale·Q·Kᵀ + mask.bias, masked entries removed     (scale defaults to 1/√d)
//   P = softmax(S) row by row,   O = P·V,   lse_i = log Σ_j exp(S_ij)
//
// A query row whose keys are all removed has O = 0, lse = -inf and zero gradients.
// Batch and sequence lengths may be 0 (nothing to do; Nk = 0 means every row is fully
// masked); heads and head dims must be ≥ 1.
//
// Every function validates all arguments before touching any output and throws
// qkv::Error on a bad call. float runs on every backend; double runs on the reference
// backend (Backend::automatic picks it), which is what gradient checks want.
#pragma once

#include "qkv/options.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

template <class T>
struct ForwardArgs {
  View4<const T> q, k, v;
  View4<T> out;
  View3<T> lse;      // optional: log-sum-exp of each row, needed by attention_backward
  View4<T> weights;  // optional: the attention weights P (reference backend only)
};

template <class T>
struct BackwardArgs {
  View4<const T> q, k, v;
  View4<const T> out;   // the forward's output
  View3<const T> lse;   // the forward's log-sum-exp
  View4<const T> dout;  // ∂L/∂out
  View4<T> dq, dk, dv;  // written, not accumulated into
};

void attention_forward(const ForwardArgs<float>& args, const AttentionOptions& options = {});
void attention_forward(const ForwardArgs<double>& args, const AttentionOptions& options = {});

void attention_backward(const BackwardArgs<float>& args, const AttentionOptions& options = {});
void attention_backward(const BackwardArgs<double>& args, const AttentionOptions& options = {});

// The backend `Backend::automatic` resolves to for this element type and these outputs.
Backend resolve_backend(const AttentionOptions& options, bool is_double, bool wants_weights);

}  // namespace qkv
