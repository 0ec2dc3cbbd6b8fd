// attention_forward's way into the decode kernel: calls with few queries per sequence
// and only prefix masks (causal, key lengths) run there instead of the tiled forward.
#pragma once

#include "core/problem.hpp"

namespace qkv::cpu {

// Runs `problem` on the decode kernel and returns true when its shape calls for it
// (1..kDecodeQueries queries, no elementwise mask); otherwise returns false untouched.
bool forward_by_decode(const detail::ForwardProblem<float>& problem);

}  // namespace qkv::cpu
