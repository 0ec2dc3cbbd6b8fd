// The reference of sparse attention (qkv/sparse.hpp): per query row, the attended keys
// (core/key_selection.hpp) gathered and attended densely in fp64 — the dense reference's
// score pipeline, softmax row and explicit-Jacobian backward on those keys alone.
#pragma once

#include "core/key_selection.hpp"

namespace qkv::reference {

template <class T>
void sparse_forward(const detail::SparseForwardProblem<T>& problem);
template <class T>
void sparse_backward(const detail::SparseBackwardProblem<T>& problem);

}  // namespace qkv::reference
