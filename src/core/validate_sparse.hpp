// Argument checking for the sparse entry points (validate_sparse.cpp): a call becomes a
// sparse problem (core/key_selection.hpp) or throws qkv::Error naming the argument; no
// output is written either way. Instantiated for float, double, bfloat16, float16.
#pragma once

#include "core/key_selection.hpp"

namespace qkv::detail {

template <class T>
SparseForwardProblem<T> validate(const SparseForwardArgs<T>& args, const AttentionOptions& options);
template <class T>
SparseBackwardProblem<T> validate(const SparseBackwardArgs<T>& args, const AttentionOptions& options);

}  // namespace qkv::detail
