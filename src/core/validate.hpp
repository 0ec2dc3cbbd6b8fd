// Argument checking for the public entry points: turns a call into a Problem or throws
// qkv::Error naming the argument, the expected and the actual value. Never writes to
// any output.
#pragma once

#include "core/problem.hpp"

namespace qkv::detail {

ForwardProblem<float> validate(const ForwardArgs<float>& args, const AttentionOptions& options);
ForwardProblem<double> validate(const ForwardArgs<double>& args, const AttentionOptions& options);
BackwardProblem<float> validate(const BackwardArgs<float>& args, const AttentionOptions& options);
BackwardProblem<double> validate(const BackwardArgs<double>& args,
                                 const AttentionOptions& options);

}  // namespace qkv::detail

namespace qkv::detail {

class Checker;

// The variant options (validate_variants.cpp): checked, then copied into the mask rule
// (window, sinks) and the score modifiers.
void check_variants(const Checker& check, const AttentionOptions& options, const Extents& e,
                    MaskRule& mask, ScoreModifiers& modifiers);
void check_sink_gradient(const Checker& check, const AttentionOptions& options,
                         std::span<float> dsinks, int64_t q_heads);

// Varlen calls become ordinary problems whose batch entries are the sequences
// (Sequences::cu_q/cu_k set, views [sequences, total, heads, dim] with batch stride 0).
ForwardProblem<float> validate(const VarlenForwardArgs<float>& args,
                               const AttentionOptions& options);
ForwardProblem<double> validate(const VarlenForwardArgs<double>& args,
                                const AttentionOptions& options);
BackwardProblem<float> validate(const VarlenBackwardArgs<float>& args,
                                const AttentionOptions& options);
BackwardProblem<double> validate(const VarlenBackwardArgs<double>& args,
                                 const AttentionOptions& options);

}  // namespace qkv::detail
