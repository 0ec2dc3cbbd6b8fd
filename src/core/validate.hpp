// Argument checking for the public entry points: turns a call into a Problem or throws
// qkv::Error naming the argument, the expected and the actual value. Never writes to
// any output. Instantiated for every storage type: float, double, bfloat16, float16.
#pragma once

#include <string_view>

#include "core/problem.hpp"

namespace qkv::detail {

template <class T>
ForwardProblem<T> validate(const ForwardArgs<T>& args, const AttentionOptions& options);
template <class T>
BackwardProblem<T> validate(const BackwardArgs<T>& args, const AttentionOptions& options);
// The same checks, the messages naming `function`: for entry points that are a dense call
// plus something more (qkv::sparse_attention_forward: the dense call and its key lists).
template <class T>
ForwardProblem<T> validate_as(const ForwardArgs<T>& args, const AttentionOptions& options,
                              std::string_view function);
template <class T>
BackwardProblem<T> validate_as(const BackwardArgs<T>& args, const AttentionOptions& options,
                               std::string_view function);

class Checker;

// Explicit instantiations of the forward and backward validators of one kind of call
// (ForwardArgs/BackwardArgs, VarlenForwardArgs/VarlenBackwardArgs) for every storage type.
#define QKV_INSTANTIATE_VALIDATE_FOR(T, Forward, Backward)                              \
  template ForwardProblem<T> validate(const Forward<T>&, const AttentionOptions&); \
  template BackwardProblem<T> validate(const Backward<T>&, const AttentionOptions&);
#define QKV_INSTANTIATE_VALIDATE(Forward, Backward)             \
  QKV_INSTANTIATE_VALIDATE_FOR(float, Forward, Backward)        \
  QKV_INSTANTIATE_VALIDATE_FOR(double, Forward, Backward)       \
  QKV_INSTANTIATE_VALIDATE_FOR(bfloat16, Forward, Backward)     \
  QKV_INSTANTIATE_VALIDATE_FOR(float16, Forward, Backward)

// The variant options (validate_variants.cpp): checked, then copied into the mask rule
// (window, sinks) and the score modifiers.
void check_variants(const Checker& check, const AttentionOptions& options, const Extents& e,
                    MaskRule& mask, ScoreModifiers& modifiers);
// Backward only: the gradients of the variants asked for (dsinks, dalibi_slopes) match
// their options, and a score_mod comes with its derivative.
void check_variant_gradients(const Checker& check, const AttentionOptions& options,
                             std::span<float> dsinks, std::span<float> dalibi_slopes,
                             int64_t q_heads);

// Varlen calls become ordinary problems whose batch entries are the sequences
// (Sequences::cu_q/cu_k set, views [sequences, total, heads, dim] with batch stride 0).
template <class T>
ForwardProblem<T> validate(const VarlenForwardArgs<T>& args, const AttentionOptions& options);
template <class T>
BackwardProblem<T> validate(const VarlenBackwardArgs<T>& args, const AttentionOptions& options);

// The packed [total, heads, dim] view seen as [sequences, total, heads, dim] with batch
// stride 0: entry b addresses rows through the Sequences offsets.
template <class T>
View4<T> as_batched(const View3<T>& view, int64_t sequences) {
  return View4<T>(view.data, {sequences, view.shape[0], view.shape[1], view.shape[2]},
                  {0, view.strides[0], view.strides[1], view.strides[2]});
}
template <class T>
View3<T> lse_as_batched(const TensorView<T, 2>& view, int64_t sequences) {
  return View3<T>(view.data, {sequences, view.shape[0], view.shape[1]},
                  {0, view.strides[0], view.strides[1]});
}

// What a call over a key/value cache (qkv::decode, KVCache::attend, qkv::BatchPlan)
// cannot take from AttentionOptions: a cache has its own lengths, and the split-K
// schedule no elementwise mask, dropout or programmable modifier (cache/decode.cpp).
void refuse_for_caches(const Checker& check, const AttentionOptions& options);

}  // namespace qkv::detail
