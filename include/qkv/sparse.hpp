// Sparse attention over listed keys: DeepSeek Sparse Attention's "attention over the
// top-k selected keys". Each query row lists the keys it may attend; a key takes part
// iff it is listed AND the causal mode allows it:
//
//   A_i = { j listed for row i : j ≠ −1 and causal keeps (i, j) }      (a set: repeats count once)
//   S_ij = scale·q_i·k_j → soft-cap,   P_i = softmax over A_i ∪ {sink_h},   O_i = Σ_(j∈A_i) P_ij·v_j
//
// It is the dense attention of qkv/attention.hpp with a boolean mask scattered from the
// lists, computed in O(Nq·topk·d) and never building anything Nq × Nk.
//
// Shapes (logical order like attention_forward; any strides, inner dimension contiguous):
//   q    [B, Nq, Hq,  d ]      out  [B, Nq, Hq, dv]     lse [B, Hq, Nq]
//   k    [B, Nk, Hkv, d ]
//   v    [B, Nk, Hkv, dv]
//   indices: int32 or int64, −1 = no key, else 0 ≤ index < Nk:
//     [B, Nq, topk]        one list per query, shared by every head (DeepSeek's MQA/MLA mode)
//     [B, Hkv, Nq, topk]   one list per (query, key/value head): query head h reads kv head h / (Hq/Hkv)
//
// Options used: scale, causal (top_left / bottom_right as AttentionOptions defines them),
// softcap, sinks, execution (backend, threads, check_finite), precision (bfloat16 with
// groups of 16+ query heads per kv head takes the bf16 dot unit under Precision::fast, P
// rounded to bfloat16 once; every other call is float32 arithmetic either way). The rest
// (mask, key_lengths, window, alibi_slopes, dropout, modifiers) is refused by name: a
// qkv::Error, never ignored. A row with no key taking part: out 0, lse −inf, zero
// gradients (with sinks the sink takes the row's whole weight: out 0, lse = sink).
// An index outside [−1, Nk) is a qkv::Error naming its batch entry and row; nothing is
// written to any output then. Results are bitwise identical for every thread count.
#pragma once

#include <cstdint>
#include <span>

#include "qkv/attention.hpp"

namespace qkv {

// The key lists of a call, read in place: a [B, Nq, topk] or [B, Hkv, Nq, topk] view of
// int32 or int64 (any strides).
class KeyIndices {
 public:
  KeyIndices() = default;
  KeyIndices(TensorView<const int32_t, 3> shared) : i32_(per_query(shared)), shared_(true) {}  // NOLINT(google-explicit-constructor)
  KeyIndices(TensorView<const int64_t, 3> shared) : i64_(per_query(shared)), shared_(true) {}  // NOLINT(google-explicit-constructor)
  KeyIndices(TensorView<const int32_t, 4> per_kv_head) : i32_(per_kv_head) {}  // NOLINT(google-explicit-constructor)
  KeyIndices(TensorView<const int64_t, 4> per_kv_head) : i64_(per_kv_head) {}  // NOLINT(google-explicit-constructor)
  // Packed lists [total_q, topk], row n the n-th packed query (qkv::BatchPlan::run):
  // one list per query, shared by the heads; seen as [1, 1, total_q, topk].
  KeyIndices(TensorView<const int32_t, 2> packed) : i32_(per_row(packed)), shared_(true), packed_(true) {}  // NOLINT(google-explicit-constructor)
  KeyIndices(TensorView<const int64_t, 2> packed) : i64_(per_row(packed)), shared_(true), packed_(true) {}  // NOLINT(google-explicit-constructor)

  bool empty() const { return i32_.empty() && i64_.empty(); }
  // True for [B, Nq, topk]: every head reads the same list.
  bool shared_by_heads() const { return shared_; }
  bool is_int64() const { return !i64_.empty(); }
  // True for packed [total_q, topk] lists (BatchPlan::run's).
  bool packed() const { return packed_; }
  // The lists as [B, lists per query (1 when shared, else Hkv), Nq, topk].
  const TensorView<const int32_t, 4>& int32_view() const { return i32_; }
  const TensorView<const int64_t, 4>& int64_view() const { return i64_; }

 private:
  // [B, Nq, topk] seen as [B, 1, Nq, topk]: one list per query for every head.
  template <class I>
  static TensorView<const I, 4> per_query(TensorView<const I, 3> view) {
    return TensorView<const I, 4>(view.data, {view.shape[0], 1, view.shape[1], view.shape[2]},
                                  {view.strides[0], 0, view.strides[1], view.strides[2]});
  }
  template <class I>
  static TensorView<const I, 4> per_row(TensorView<const I, 2> view) {
    return TensorView<const I, 4>(view.data, {1, 1, view.shape[0], view.shape[1]},
                                  {0, 0, view.strides[0], view.strides[1]});
  }
  TensorView<const int32_t, 4> i32_;
  TensorView<const int64_t, 4> i64_;
  bool shared_ = false;
  bool packed_ = false;
};

template <class T>
struct SparseForwardArgs {
  View4<const T> q, k, v;
  KeyIndices indices;
  View4<T> out;
  View3<LseOf<T>> lse;  // optional: needed by sparse_attention_backward
};

template <class T>
struct SparseBackwardArgs {
  View4<const T> q, k, v;
  KeyIndices indices;          // the forward's
  View4<const T> out;          // the forward's output
  View3<const LseOf<T>> lse;   // the forward's log-sum-exp
  View4<const T> dout;         // ∂L/∂out
  View4<T> dq, dk, dv;         // written, not accumulated into
  std::span<float> dsinks;     // optional, with options.sinks: ∂L/∂sink_h per query head
};

void sparse_attention_forward(const SparseForwardArgs<float>& args, const AttentionOptions& options = {});
void sparse_attention_forward(const SparseForwardArgs<double>& args, const AttentionOptions& options = {});
void sparse_attention_forward(const SparseForwardArgs<bfloat16>& args, const AttentionOptions& options = {});
void sparse_attention_forward(const SparseForwardArgs<float16>& args, const AttentionOptions& options = {});

void sparse_attention_backward(const SparseBackwardArgs<float>& args, const AttentionOptions& options = {});
void sparse_attention_backward(const SparseBackwardArgs<double>& args, const AttentionOptions& options = {});
void sparse_attention_backward(const SparseBackwardArgs<bfloat16>& args, const AttentionOptions& options = {});
void sparse_attention_backward(const SparseBackwardArgs<float16>& args, const AttentionOptions& options = {});

}  // namespace qkv
