// Merging partial attention results by their log-sum-exp.
//
// If (O_a, lse_a) is attention over one set of keys and (O_b, lse_b) over a disjoint set,
// attention over their union is, row by row,
//
//     lse = log(exp(lse_a) + exp(lse_b)) = m + log(w_a + w_b),   m = max(lse_a, lse_b)
//     O   = (w_a·O_a + w_b·O_b) / (w_a + w_b),                   w_x = exp(lse_x − m)
//
// exact in exact arithmetic, and what ring attention (qkv::dist) and split-key decoding
// do. A part that saw no key of a row has lse −∞ and contributes nothing; a row no part
// saw keeps output 0 and lse −∞, as the attention functions give it.
//
// Link qkv::ring_plan (qkv::dist links it for you).
#pragma once

#include "qkv/tensor.hpp"

namespace qkv {

// (out, lse) ← merge of (out, lse) and (part_out, part_lse), in place.
//   out, part_out [B, N, H, dv]      lse, part_lse [B, H, N]
// Any strides with a contiguous last dimension. Weights are computed per row in double
// from the fp32 LSEs; the output rows are combined in fp32. A NaN LSE makes its row NaN.
// Throws qkv::Error (before writing) when the shapes disagree or a view is null.
void merge_partials(View4<float> out, View3<float> lse, View4<const float> part_out,
                    View3<const float> part_lse);

}  // namespace qkv
