// The split-K ("decode") schedule of the cpu backend: few queries per sequence against
// many keys, read in place from wherever the problem's key/value source says they live
// (the call's K/V views, or a contiguous or paged cache of float32, bfloat16, float16 or
// int8 with a scale per row). It reads the same validated problem as the tiled forward:
// the sequences and MaskRule for which keys each row sees, the ScoreModifiers for what is
// done to the logits (core/problem.hpp).
#pragma once

#include <cstddef>

#include "core/problem.hpp"

namespace qkv::cpu {

// Calls whose rows each see a range of keys: no elementwise mask, no dropout, no
// programmable modifier (cpu/forward_schedule.cpp). Their sequences of at most
// kDecodeQueries queries have their logits summed the split-K way in every schedule and
// pass (split_k_logits_for), so that a row's logits depend on its own sequence only.
bool split_k_eligible(const detail::MaskRule& mask, const detail::ScoreModifiers& modifiers);
bool split_k_logits_for(const detail::MaskRule& mask, int64_t batch_entry);
// split_k_eligible dense calls of 1..kDecodeQueries queries: what the split-K schedule runs.
bool split_k_shape(const detail::Extents& extents, const detail::MaskRule& mask,
                   const detail::ScoreModifiers& modifiers);

// Whether the split-K schedule runs `problem`: every cache that only `problem.kv`
// describes (the tiled schedule reads args.k / args.v), and split_k_shape calls that ask
// for no statistics. The one place the forward's schedule is chosen.
bool runs_split_k(const detail::ForwardProblem<float>& problem);
// The 16-bit storage types: split_k_shape calls with Precision::fast asking for no
// statistics or weights, run by split_k_half (the queries widened, the output rounded once).
template <class T>
bool runs_split_k(const detail::ForwardProblem<T>& problem);
template <class T>
void split_k_half(const detail::ForwardProblem<T>& problem);

// The tiled forward schedule itself (forward.cpp), whatever runs_split_k says.
void tiled_forward(const detail::ForwardProblem<float>& problem);

struct DecodePlan;  // cpu/decode_plan.hpp

// Runs the split-K schedule (fused, fp32 arithmetic, SIMD target chosen at runtime).
// Results are bitwise identical for every thread count. `planned`: the problem's
// DecodePlan made ahead (qkv::BatchPlan) for decode_vector_lanes(), or null.
void decode(const detail::ForwardProblem<float>& problem, const DecodePlan* planned = nullptr);
// The vector length (floats) of the SIMD target decode() runs on now.
std::size_t decode_vector_lanes();

}  // namespace qkv::cpu
