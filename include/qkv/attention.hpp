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
// plus the options' variants: soft-cap, ALiBi, sliding window, sinks, dropout.
//
// A query row whose keys are all removed has O = 0, lse = -inf and zero gradients.
// Batch and sequence lengths may be 0 (nothing to do; Nk = 0 means every row is fully
// masked); heads and head dims must be ≥ 1.
//
// Every function validates all arguments before touching any output and throws
// qkv::Error on a bad call. float runs on every backend; double runs on the reference
// backend (Backend::automatic picks it), which is what gradient checks want.
//
// Half precision: bfloat16 and float16 (qkv/half.hpp) run on every backend. q, k, v,
// out, dout, dq, dk, dv are all of the call's one storage type; lse is always float
// (LseOf<T>). The cpu kernels widen inputs exactly to float, compute in float and round
// each output element once (to nearest even); the reference widens them to double.
#pragma once

#include <cstdint>
#include <span>

#include "qkv/attention_stats.hpp"
#include "qkv/half.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

// The element type of lse for storage type T: float for the 16-bit types (a log-sum-exp
// rounded to 8 or 11 bits would cost the backward its accuracy), T otherwise.
template <class T>
struct LseType {
  using type = T;
};
template <>
struct LseType<bfloat16> {
  using type = float;
};
template <>
struct LseType<float16> {
  using type = float;
};
template <class T>
using LseOf = typename LseType<T>::type;

template <class T>
struct ForwardArgs {
  View4<const T> q, k, v;
  View4<T> out;
  View3<LseOf<T>> lse;  // optional: log-sum-exp of each row, needed by attention_backward
  View4<T> weights;  // optional: the attention weights P (reference backend only)
  // Optional: softmax saturation and entropy per head and per row, written into the
  // views it holds (qkv/attention_stats.hpp; float for the 16-bit types, like lse).
  // Null: not computed, at no cost.
  const AttentionStats<LseOf<T>>* stats = nullptr;
};

template <class T>
struct BackwardArgs {
  View4<const T> q, k, v;
  View4<const T> out;   // the forward's output
  View3<const LseOf<T>> lse;  // the forward's log-sum-exp
  View4<const T> dout;  // ∂L/∂out
  View4<T> dq, dk, dv;  // written, not accumulated into
  // With options.sinks: ∂L/∂sinks, one per query head (float, written). Optional.
  std::span<float> dsinks;
  // With options.alibi_slopes: ∂L/∂slope_h = −Σ_(i,j) ∂L/∂S_ij·|i + Nk − Nq − j| over every
  // entry and row of head h, one per query head (float, written). Optional; not with a
  // score_mod (qkv/modifiers.hpp), whose derivative would have to be chained in between.
  std::span<float> dalibi_slopes;
};

void attention_forward(const ForwardArgs<float>& args, const AttentionOptions& options = {});
void attention_forward(const ForwardArgs<double>& args, const AttentionOptions& options = {});
void attention_forward(const ForwardArgs<bfloat16>& args, const AttentionOptions& options = {});
void attention_forward(const ForwardArgs<float16>& args, const AttentionOptions& options = {});

void attention_backward(const BackwardArgs<float>& args, const AttentionOptions& options = {});
void attention_backward(const BackwardArgs<double>& args, const AttentionOptions& options = {});
void attention_backward(const BackwardArgs<bfloat16>& args, const AttentionOptions& options = {});
void attention_backward(const BackwardArgs<float16>& args, const AttentionOptions& options = {});

// ---------------------------------------------------------------------------------------
// Varlen (packed) attention, FlashAttention's `flash_attn_varlen_func` layout: a batch of
// sequences of different lengths stored back to back, with no padding at all.
//
//   q    [total_q, Hq,  d ]     out  [total_q, Hq, dv]     lse [Hq, total_q]
//   k    [total_k, Hkv, d ]
//   v    [total_k, Hkv, dv]
//
// Sequence s owns query rows [cu_seqlens_q[s], cu_seqlens_q[s+1]) and key rows
// [cu_seqlens_k[s], cu_seqlens_k[s+1]); it attends only within itself. The prefix sums
// start at 0, never decrease and end at total_q / total_k. Causal modes apply per
// sequence (bottom_right aligns each sequence's last query with its last key). Options
// used: scale, causal, execution; masks and key_lengths are refused (there is no padding
// to describe). Sequences may be empty.

// cu_seqlens as int32 (FlashAttention's type) or int64, read in place.
class SeqOffsets {
 public:
  SeqOffsets() = default;
  SeqOffsets(std::span<const int32_t> offsets) : i32_(offsets) {}  // NOLINT(google-explicit-constructor)
  SeqOffsets(std::span<const int64_t> offsets) : i64_(offsets) {}  // NOLINT(google-explicit-constructor)
  std::size_t size() const { return i32_.empty() ? i64_.size() : i32_.size(); }
  int64_t operator[](std::size_t i) const { return i32_.empty() ? i64_[i] : i32_[i]; }

 private:
  std::span<const int32_t> i32_;
  std::span<const int64_t> i64_;
};

template <class T>
struct VarlenForwardArgs {
  View3<const T> q, k, v;
  View3<T> out;
  TensorView<LseOf<T>, 2> lse;  // optional: [Hq, total_q], needed by the backward
  SeqOffsets cu_seqlens_q, cu_seqlens_k;
  // Optional (0: not given). When given, must be ≥ every sequence's length (as in
  // FlashAttention, where it sizes the launch); qkv needs neither and checks both.
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  // Optional: per-sequence and per-row softmax statistics (qkv/attention_stats.hpp).
  const VarlenAttentionStats<LseOf<T>>* stats = nullptr;
};

template <class T>
struct VarlenBackwardArgs {
  View3<const T> q, k, v;
  View3<const T> out;
  TensorView<const LseOf<T>, 2> lse;
  View3<const T> dout;
  View3<T> dq, dk, dv;  // written, not accumulated into
  std::span<float> dsinks;  // optional, with options.sinks
  std::span<float> dalibi_slopes;  // optional, with options.alibi_slopes (see BackwardArgs)
  SeqOffsets cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
};

void varlen_attention_forward(const VarlenForwardArgs<float>& args,
                              const AttentionOptions& options = {});
void varlen_attention_forward(const VarlenForwardArgs<double>& args,
                              const AttentionOptions& options = {});
void varlen_attention_forward(const VarlenForwardArgs<bfloat16>& args,
                              const AttentionOptions& options = {});
void varlen_attention_forward(const VarlenForwardArgs<float16>& args,
                              const AttentionOptions& options = {});
void varlen_attention_backward(const VarlenBackwardArgs<float>& args,
                               const AttentionOptions& options = {});
void varlen_attention_backward(const VarlenBackwardArgs<double>& args,
                               const AttentionOptions& options = {});
void varlen_attention_backward(const VarlenBackwardArgs<bfloat16>& args,
                               const AttentionOptions& options = {});
void varlen_attention_backward(const VarlenBackwardArgs<float16>& args,
                               const AttentionOptions& options = {});

// The backend `Backend::automatic` resolves to for this element type and these outputs.
Backend resolve_backend(const AttentionOptions& options, bool is_double, bool wants_weights);

}  // namespace qkv
