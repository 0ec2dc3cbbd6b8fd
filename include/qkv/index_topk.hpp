// DeepSeek Sparse Attention's "lightning indexer": the top-k keys of every query.
//
// Shapes (logical order; any strides, innermost dimension contiguous):
//   q        [B, Nq, Hi, di]    the indexer's query heads
//   k        [B, Nk, di]        one indexer key per position (shared by every head)
//   weights  [B, Nq, Hi]        per-query head weights
//   indices  [B, Nq, topk]      output, int32
//
//   score(b, i, j) = Σ_h weights[b,i,h] · relu(scale · q[b,i,h,:]·k[b,j,:])
//
// which is transformers' DeepseekV32Indexer: relu(scale·(q·kᵀ)) weighted per head and summed
// over heads (the model folds its own Hi^-½ into the weights it passes); scale defaults to
// 1/√di. indices[b,i,:] lists the keys j that row i is allowed, by descending score, ties to
// the lower index; where a row is allowed fewer than topk keys, the rest of it is −1. A key
// is allowed when options.causal lets row i see it (qkv/options.hpp: top_left j ≤ i,
// bottom_right j ≤ i + L_b − Nq) and j < L_b, L_b = key_lengths[b] (Nk without them). A NaN
// score ranks above every number (as torch.topk orders it); −0 and +0 are the same score.
//
// Options used: scale, causal, key_lengths, execution (threads, backend, check_finite);
// masks, window, ALiBi, soft-cap, sinks, dropout and modifiers are refused; precision (below).
// Every storage type is widened exactly to float (double for the reference), except
// bfloat16 q and k with Precision::fast (the default) on a CPU with a bfloat16 unit —
// AVX512-BF16's vdpbf16ps (AMD Zen 4/5) or the AMX tiles (Intel Xeons; cpu/dot_products.hpp
// picks it): there each head's logit is summed on the unit from exact products, the keys
// read in place — the same
// scores up to float32 summation order (and subnormal products flushed), so a top-k that
// may differ from Precision::exact's only among keys whose scores lie within that
// rounding of each other. Precision::exact keeps the float32 FMAs bit for bit.
//
// Backends: reference (fp64 scores, then a sort of each row's allowed keys) and cpu (the
// default for float, bfloat16, float16): the keys are streamed in blocks, scores computed
// in float with Highway SIMD, each row keeping a running top-k (a bounded heap), so memory is
// O(threads · topk) beside the output, never the Nq × Nk scores. The result is the same for
// any thread count: every score is computed the same way whichever thread computes it, and
// the top-k of a totally ordered set is unique.
//
// Validation happens before anything is written; a bad call throws qkv::Error naming the
// argument ("qkv::index_topk: k.shape[2] (head_dim): expected 128 (as q.shape[3]), got 64").
#pragma once

#include <cstdint>
#include <type_traits>

#include "qkv/half.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

// The weights' element type for storage type T: float (double for double inputs).
template <class T>
using IndexWeightOf = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
struct IndexTopkArgs {
  View4<const T> q;                          // [B, Nq, Hi, di]
  View3<const T> k;                          // [B, Nk, di]
  View3<const IndexWeightOf<T>> weights;     // [B, Nq, Hi]
  View3<int32_t> indices;                    // [B, Nq, topk], written
};

void index_topk(const IndexTopkArgs<float>& args, const AttentionOptions& options = {});
void index_topk(const IndexTopkArgs<double>& args, const AttentionOptions& options = {});
void index_topk(const IndexTopkArgs<bfloat16>& args, const AttentionOptions& options = {});
void index_topk(const IndexTopkArgs<float16>& args, const AttentionOptions& options = {});

}  // namespace qkv
