// The keep decisions of attention dropout (AttentionOptions::dropout), for tests and for
// users who want to see the mask the kernels apply: the kernels regenerate each decision
// from (seed, offset, batch, head, query, key), never store it, so this is the same mask.
#pragma once

#include "qkv/options.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

// keep[b, h, i, j] = whether weight (i, j) of head h of batch entry b is kept (and scaled
// by 1/(1 − p)) under `dropout`. Throws qkv::Error unless 0 ≤ dropout.p < 1.
void dropout_keep_mask(TensorView<bool, 4> keep, const Dropout& dropout);

}  // namespace qkv
