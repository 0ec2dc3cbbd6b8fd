// Argument checking for the public entry points: turns a call into a Problem or throws
// qkv::Error naming the argument, the expected and the actual value. Never writes to
// any output. Instantiated for every storage type: float, double, bfloat16, float16.
#pragma once

#include "core/problem.hpp"

namespace qkv::detail {

template <class T>
ForwardProblem<T> validate(const ForwardArgs<T>& args, const AttentionOptions& options);
template <class T>
BackwardProblem<T> validate(const BackwardArgs<T>& args, const AttentionOptions& options);

class Checker;

// The variant options (validate_variants.cpp): checked, then copied into the mask rule
// (window, sinks) and the score modifiers.
void check_variants(const Checker& check, const AttentionOptions& options, const Extents& e,
                    MaskRule& mask, ScoreModifiers& modifiers);
void check_sink_gradient(const Checker& check, const AttentionOptions& options,
                         std::span<float> dsinks, int64_t q_heads);
void check_alibi_gradient(const Checker& check, const AttentionOptions& options,
                          std::span<float> dalibi_slopes, int64_t q_heads);
// Backward only: a score_mod must come with its derivative.
void check_modifier_gradient(const Checker& check, const AttentionOptions& options);

// Varlen calls become ordinary problems whose batch entries are the sequences
// (Sequences::cu_q/cu_k set, views [sequences, total, heads, dim] with batch stride 0).
template <class T>
ForwardProblem<T> validate(const VarlenForwardArgs<T>& args, const AttentionOptions& options);
template <class T>
BackwardProblem<T> validate(const VarlenBackwardArgs<T>& args, const AttentionOptions& options);

}  // namespace qkv::detail
