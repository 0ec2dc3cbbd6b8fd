// qkv::KVCache's attend over a key/value source that DecodeArgs cannot describe (int4
// storage, a float window for the newest tokens): the queries, outputs and options are
// validated as qkv::decode validates them (same messages); the source is the cache's own,
// built by it, and trusted.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "check/checker.hpp"
#include "core/kv_source.hpp"
#include "core/problem.hpp"
#include "qkv/sparse.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail {

void decode_cache_source(const KvSource& kv, int64_t capacity, std::span<const int64_t> cache_lengths,
                         View4<const float> q, View4<float> out, View3<float> lse, const AttentionOptions& options,
                         const KeyIndices& indices = {});

// The call as a dense problem: B sequences of Nq queries against a capacity of keys, each
// cut to its cache length; its key/value source is the caller's to set (decode.cpp).
ForwardProblem<float> cache_problem(const Checker& check, const AttentionOptions& options, View4<const float> q,
                                    View4<float> out, View3<float> lse, int64_t kv_heads, int64_t capacity,
                                    int64_t v_dim, std::span<const int64_t> cache_lengths);

// out [B, Nq, Hq, v_dim] and lse [B, Hq, Nq] (optional) checked and appended to `outputs`.
void check_decode_outputs(const Checker& check, const Described& out, View3<float> lse_view, int64_t batch,
                          int64_t q_len, int64_t q_heads, int64_t v_dim, const char* v_dim_from,
                          std::vector<Described>& outputs);

// A cache's layout, checked: contiguous, `pool` [batch, capacity, ...]; paged (block_table
// not empty), `pool` [blocks, block_size, ...] and the table [batch, max_blocks], rows
// contiguous — then check_cache_lengths. Returns the capacity per sequence (paged:
// max_blocks · block_size); the table joins `inputs`.
int64_t check_cache_layout(const Checker& check, const Described& pool, TensorView<const int32_t, 2> block_table,
                           std::span<const int64_t> cache_lengths, int64_t batch, const char* batch_from,
                           std::vector<Described>& inputs);

// cache_lengths: one per sequence, each 0..capacity; paged (block_table not empty): every
// block a sequence's keys occupy names a block 0..blocks − 1 of the pool `pool`, whose
// blocks hold block_size keys. Errors name the entry.
void check_cache_lengths(const Checker& check, std::span<const int64_t> cache_lengths, int64_t batch, int64_t capacity,
                         TensorView<const int32_t, 2> block_table, int64_t blocks, int64_t block_size,
                         const char* pool);

// Key lists (DeepSeek sparse attention's top-k) on a cache (decode_sparse.cpp): the
// options no list form applies — window, alibi_slopes — refused by name.
void refuse_for_key_lists(const Checker& check, const AttentionOptions& options);
// `dense`: the validated call without its lists (its mask rule: cache lengths and causal
// mode; dense, or varlen for qkv::BatchPlan, whose lists are packed [total_q, topk]).
// Checks `indices` (shape, every index in [−1, cache length)), then attends each query
// row over its listed keys that the rule allows, read in place, on `backend`.
void decode_key_lists(const Checker& check, const ForwardProblem<float>& dense, const KeyIndices& indices,
                      Backend backend);
// decode_key_lists' checks alone (the same errors), for a call that must refuse bad lists
// before it writes anything (BatchPlan::run_appending writes the cache first).
void check_key_lists(const Checker& check, const ForwardProblem<float>& dense, const KeyIndices& indices);

}  // namespace qkv::detail
