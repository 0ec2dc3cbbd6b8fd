// qkv::BatchPlan — one attention call per layer for a whole continuous-batching step.
//
// An inference server's step mixes prefill chunks (many new queries of one sequence,
// which with prefix caching also attend to keys already cached) and decode tokens (one
// query per sequence), all against key/value caches. A BatchPlan takes that step's
// layout once — how many new queries each sequence has, how many keys its cache holds
// (the new tokens' own keys included), where its keys live — validates it, and splits the
// work into tasks balanced across threads by cost; `run` then computes one layer from
// the packed queries and the caches, read in place. Plan once per step, run per layer
// (FlashInfer's plan/run split): the layout is not re-checked or re-planned 30 times.
//
//   layout (BatchLayout, copied into the plan):
//     cu_seqlens_q [B + 1]  prefix sums of the new queries per sequence (int32 or int64)
//     cache_lengths [B]     keys each sequence's cache holds, its new tokens' included;
//                           cu_seqlens_q[b+1] − cu_seqlens_q[b] ≤ cache_lengths[b]
//     block_table [B, max_blocks] (int32) + block_size: a paged pool, key j of sequence b
//                           in pool block block_table[b, j / block_size], row j % block_size;
//                           empty table (block_size 0): contiguous caches
//     num_heads (Hq), num_kv_heads (Hkv, divides Hq), head_dim (d), v_dim (dv; 0: d),
//     storage: the caches' element type
//     tree_mask, tree_mask_offsets [B]: speculative-decoding trees (optional; see Trees)
//     share_prefixes: attend pool blocks that sequences share once (optional; see Shared
//                           prefixes)
//   run (BatchArgs<T>, T the storage type):
//     q        [total_q, Hq, d]   float32, packed: sequence b's rows cu_seqlens_q[b]..
//     k_cache  contiguous [B, capacity, Hkv, d] (any strides, last axis contiguous), or the
//              pool [num_blocks, block_size, Hkv, d] (vLLM's and FlashAttention's layout);
//              v_cache alike with dv
//     out      [total_q, Hq, dv]  float32;  lse [Hq, total_q] optional
//     k_scale, v_scale: int8 and float8 caches only, one float per cached row ([B,
//              capacity, Hkv] or [num_blocks, block_size, Hkv], any strides: float8's
//              per-head or per-tensor scale repeated by strides 0); values element · scale
//   or run over a qkv::KVCache (any of its storages: int4 and caches with a float window
//   too, which BatchArgs cannot describe): its lengths must be the plan's cache_lengths,
//   its dtype the plan's storage, and, paged, its block table the plan's (pass
//   cache.block_table() to the layout); it is read under the cache's lock, as attend().
//
// Options: the same AttentionOptions as every entry point, read at plan time — scale,
// causal (Causal::bottom_right for a serving step: each sequence's new queries are its
// newest tokens, query i of sequence b seeing keys j ≤ i + cache_lengths[b] − n_b;
// AttentionOptions' default, none, lets every query see every cached key), window,
// softcap, alibi_slopes and sinks (copied into the plan), execution (threads, backend,
// fixed_key_split). As for qkv::decode, options.mask, key_lengths, dropout, modifiers and
// execution.check_finite are refused. Forward only.
//
// Trees (speculative decoding: verifying an EAGLE/Medusa/MTP draft tree in one step).
// Sequence b's n_b new tokens — its last n_b keys, cache_lengths[b] − n_b .. cache_lengths[b] − 1
// — may carry a boolean n_b×n_b mask, row-major at tree_mask[tree_mask_offsets[b]]: entry
// (i, j) nonzero means new token i sees new token j (an ancestor mask: j is i or an ancestor
// of i). tree_mask_offsets holds one int32/int64 offset per sequence, −1 for a sequence
// without a tree (its rows follow options.causal as usual); masks may overlap or be shared.
//   - The tree replaces causality among the new tokens: each row sees the whole cached prefix
//     (keys 0 .. cache_lengths[b] − n_b − 1) and exactly the new tokens its row of the mask
//     says, whether options.causal is none or bottom_right. Any mask is allowed — a token
//     may see a later one (trees need not be laid out in topological order; FlashInfer's
//     custom masks allow the same) — but every token must see itself (the diagonal is true),
//     so no row is empty.
//   - The result equals dense-mask attention with that visibility: keys a row does not see
//     never reach it (a NaN or Inf in a hidden key or value does not leak).
//   - Every schedule honours it: a sequence with a tree runs on the split-K schedule
//     whatever its query count (16-query tiles; the prefix blocks fully visible, the
//     block(s) holding the new tokens masked per row), and the reference backend too.
//   - The plan copies the masks. Batch invariance holds as for any sequence: a tree
//     sequence's rows are bitwise those of a one-sequence plan of it with its tree.
//   - Errors (qkv::Error, naming the argument, index and sequence): tree_mask_offsets
//     without tree_mask or the other way round, not one offset per sequence, an offset
//     below −1 or whose n_b² entries run past tree_mask, a false diagonal entry; with a
//     tree_mask, options.causal top_left, options.window and options.alibi_slopes (they
//     count positions along the sequence, which a tree's tokens are not) are refused, and
//     so are key lists (BatchArgs::indices) at run. Softcap and sinks combine as usual.
//
// Shared prefixes (parallel sampling, beam search, a common system prompt: FlashInfer's
// cascade attention). With layout.share_prefixes, sequences whose block tables start with
// the same pool blocks — the same memory, so the same keys — form groups, found at plan
// time (prefix_groups() lists them): each group's shared keys are attended once, in one
// pass over the pool that takes all its members' query rows together (16-query tiles of
// the split-K schedule, the G query heads of a kv head sharing each read), and every
// member attends only its own keys after them; the two parts are merged by their LSE
// (qkv/merge.hpp's arithmetic). A decode step of 32 sequences over one 16k prefix then
// reads that prefix twice instead of 32 times.
//   - Grouping: a sequence takes part when it has new queries and at least one whole block
//     cached before them; a group's prefix is whole blocks its members all share, every one
//     before each member's new tokens (so all of them are visible to every new query).
//     Among nested sharing (all share a system prompt, pairs share more), the grouping that
//     saves the most block reads is taken, one group per sequence.
//   - Exactness: a grouped row equals the plain step's within float32 rounding (a
//     partition of its keys merged in double-weighted float32: |Δ| of a few ulp of the
//     largest value it averages); sinks join the member's own part once, softcap both.
//   - Invariance: deterministic for any thread count, as always. A grouped row's bits
//     depend on its group (the shared length, and the group's query rows, which set the
//     pass's tiles), so they are not batch invariant; rows of sequences in no group are.
//   - Paged layouts only, the cpu backend (the reference backend computes the plain step).
//     Refused by name: a contiguous layout, options.causal top_left (queries would not see
//     the whole prefix), options.window and options.alibi_slopes (they depend on each
//     query's position), options.execution.fixed_key_split (its bits promise), key lists
//     (indices) at run, and a KVCache with a float window (its rows sit at positions the
//     trimmed tables do not keep).
//
// Appending (run_appending; FlashAttention's flash_attn_with_kvcache with k, v and rotary):
// the step's new tokens k_new [total_q, Hkv, d] and v_new [total_q, Hkv, dv], packed as q,
// are written into each sequence's last n_b cache rows — rows cache_lengths[b] − n_b ..
// cache_lengths[b] − 1 (the plan's lengths count them), through the block table when
// paged — and then attended with the rest, in one call that reads the cache once more.
//   - With a Rotary (qkv/rotary.hpp), q and k_new are rotated first, new token n by its
//     table row n (or rotary.positions[n]); q is rotated into the call's own scratch: the
//     caller's q is never written. v_new is not rotated.
//   - The caches are the caller's memory and are written (BatchAppendArgs holds them
//     mutable): float32 as given, bfloat16 and float16 rounded to nearest even, int8 per
//     row as KVCache stores it (scale max|x| / 127 written to k_scale / v_scale), float8
//     as x / scale rounded with the scale read from k_scale / v_scale. int8 keys scaled
//     per channel are not written (use a KVCache); int4 has no BatchArgs.
//   - The result equals writing those rows by hand and calling run(BatchArgs) with the
//     rotated q: bitwise (the rotation rounds as PyTorch's float32 does).
//   - Everything is checked before anything is written (a qkv::Error leaves caches, scales
//     and out as they were): run(BatchArgs)'s errors, and k_new without v_new (or the
//     other way round), their shapes, the Rotary's errors, a Rotary without k_new (the
//     cache's keys would then be rotated differently from the queries that read them:
//     refused, rotary.cos named), caches that share memory with each other or with q,
//     k_new, v_new, out or the tables, and key lists (indices) with a tree_mask.
//
// Keys in two parts (latent attention over FlashInfer's two pools: c_kv [.., dc] and k_pe
// [.., dr]): with BatchArgs::k_rope_cache [B, capacity, Hkv, dr] (or the pool [num_blocks,
// block_size, Hkv, dr], the same table), channels [head_dim − dr, head_dim) of every key
// are its k_rope_cache row and the first head_dim − dr its k_cache row (k_cache's last axis
// head_dim − dr); q's rows hold both parts, [q_nope | q_pe]. The values are usually the
// latent rows themselves: v_cache the same view as k_cache, layout.v_dim = head_dim − dr.
// Each row is read in place, never copied into a combined pool, and the result is bitwise
// that of the same keys in one combined pool [.., head_dim] (the same schedules, including
// the AVX512-BF16 latent step with options.precision fast and one kv head). float32,
// bfloat16 and float16 only: int8 and float8 caches are refused by name (their row scale
// would have to serve both pools; a combined float8 pool works).
//   run_appending writes both pools (FlashInfer's append_paged_mla_kv_cache, then the
// step): BatchAppendArgs::k_new [total_q, Hkv, head_dim − dr] goes into k_cache as given and
// k_rope_new [total_q, Hkv, dr] into k_rope_cache. A Rotary acts on the rotary part only,
// as DeepSeek's MLA rotates it: k_rope_new and each query's last dr channels (q_pe) are
// rotated as a row of dr channels would be (rotary_dim ≤ dr; the q_nope channels and k_new
// pass through). Engines' DeepSeek rotation is GPT-J's pairs (vLLM's is_neox_style=False):
// Rotary::interleaved with tables repeat_interleave(freqs, 2). With v_cache the same view
// as k_cache (the latent values) v_new must be left empty: the values are the rows k_new
// writes; with a separate v_cache, v_new is written as usual.
//
// FlashMLA's FP8 records (vLLM's fp8_ds_mla latent cache, DeepSeek-V3.2 and GLM-5; the
// layout qkv/mla.hpp's MlaRecordArgs states): run(BatchRecordArgs) reads them in place —
// one latent head, so the plan has num_kv_heads 1, head_dim dc + dr, v_dim dc (a multiple
// of 128) and storage float8_e4m3fn (the records' latent values); q [total_q, Hq, dc + dr]
// holds [q_nope | q_pe], out [total_q, Hq, dc]. Each query row runs on mla_decode's
// records kernel (cpu/mla_records.cpp): its keys in chunks cut by their count alone,
// merged in order, so a row's bits are those of mla_decode over the same records, for
// any batch and thread count. Options and key lists as for run(BatchArgs); refused by
// name: window and ALiBi (as mla_decode refuses them), and plans with a tree_mask or
// share_prefixes (the records kernel has neither).
//   run_appending(BatchRecordAppendArgs) writes the step's new tokens as records first:
// k_new [total_q, dc] (c_kv) and k_rope_new [total_q, dr] (k_pe; the Rotary rotating k_rope_new and q's
// last dr channels, as above) packed as qkv::pack_mla_records packs them (its scales
// rule), into each sequence's last n_b records, then the step as run(BatchRecordArgs) over
// the rotated q. The records of the whole step are packed into scratch before the first
// is stored, so a refused call (run's errors, the new rows' shapes, a non-finite k_new
// value, records sharing memory with what the call reads) leaves every record as it was.
//
// Schedules (cpu backend): sequences of ≤ 32 queries run on the split-K schedule
// (cpu/decode.cpp), planned together, their tasks handed to threads costliest first; a
// prefill chunk of more queries runs on the tiled schedule over its keys gathered into
// float32 rows per run (bitwise attention_forward of that chunk alone over them). With
// execution.fixed_key_split every sequence runs on split-K. A sequence of 0 queries costs
// nothing.
//
// Invariance (what a sequence's output rows depend on):
//   - batch invariant (always, but for the rows of a shared-prefix group: see Shared
//     prefixes): a sequence's rows are bitwise identical whether it runs
//     alone (a one-sequence plan; qkv::decode for ≤ 16 queries) or in any batch, with any thread count, contiguous or paged, whatever the
//     other sequences' lengths — its blocks and chunks follow from its own query count
//     and keys only;
//   - with options.execution.fixed_key_split, also across calls: a row's bits depend only
//     on the row and the keys it sees, so a token decoded alone gets the bits it had as a
//     row of a prefill chunk (what RL rollouts matched against a trainer need); the cost
//     is in bench/RESULTS.md.
//   Not invariant: across SIMD targets (QKV_SIMD_TARGET), and a row whose tile holds
//   a key with non-finite values that the row does not see takes a scalar path.
//
// Errors (qkv::Error naming the argument and index, nothing written): non-monotone
// cu_seqlens_q, a cache length below its query count or above capacity, a block table too
// short or pointing outside the pool, mismatched heads or dims, a cache of another storage
// type than planned. A plan is immutable after construction: `run` may be called from
// several threads at once (each with its own outputs).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/half.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/mla.hpp"  // RecordScales
#include "qkv/options.hpp"
#include "qkv/rotary.hpp"
#include "qkv/sparse.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

struct BatchLayout {
  SeqOffsets cu_seqlens_q;
  SeqOffsets cache_lengths;
  TensorView<const int32_t, 2> block_table;  // empty: contiguous caches
  int64_t block_size = 0;                   // paged only
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t v_dim = 0;  // 0: head_dim
  StorageType storage = StorageType::float32;  // int4: run over a qkv::KVCache only
  // Trees (see above): the masks flattened (nonzero: visible), and where sequence b's
  // n_b×n_b mask starts (−1: none). Both empty: no trees.
  std::span<const std::uint8_t> tree_mask;
  SeqOffsets tree_mask_offsets;
  // Shared prefixes (see above): pool blocks that several sequences' tables start with are
  // attended once per group. Paged layouts only.
  bool share_prefixes = false;
};

// One group of a plan with share_prefixes: its sequences (ascending) and the keys they
// share (whole blocks from key 0).
struct PrefixGroup {
  std::vector<int64_t> sequences;
  int64_t keys = 0;
};

template <class T>  // the caches' storage type: float, bfloat16, float16, int8_t, float8_e4m3fn or float8_e5m2
struct BatchArgs {
  View3<const float> q;
  View4<const T> k_cache, v_cache;
  View3<float> out;
  TensorView<float, 2> lse;           // optional
  View3<const float> k_scale, v_scale;  // int8 and float8 only
  // int8 keys scaled per channel too (as qkv::DecodeArgs; empty: per row only).
  View4<const float> k_channel_scale, k_channel_zero;
  int64_t key_group = 0;
  // Optional key lists (DeepSeek sparse attention's top-k): packed [total_q, topk] int32
  // or int64 (KeyIndices' packed constructor), row n for the n-th packed query, entries
  // positions 0..cache_lengths[b] − 1 within its own sequence b, or −1. As for
  // qkv::decode's (DecodeArgs::indices): a query attends the keys it lists that the plan's
  // causal mode allows, repeats once; an index outside [−1, cache_lengths[b]) is a
  // qkv::Error naming its sequence and row, nothing written; refused if the plan has a
  // window or ALiBi. Every sequence then runs on the split-K schedule.
  KeyIndices indices;
  // Keys in two parts (optional; float32, bfloat16 and float16 caches): MLA's latent cache
  // kept as two pools, FlashInfer's ckv/kpe layout — see "Keys in two parts" above.
  View4<const T> k_rope_cache;
};

// run_appending: the step's new tokens written into caches the caller owns, then attended
// (see "Appending" above). T as BatchArgs'; the caches are written, so they are not const.
template <class T>
struct BatchAppendArgs {
  View3<const float> q;             // [total_q, Hq, d]: read only (rotated into scratch)
  View3<const float> k_new, v_new;  // [total_q, Hkv, d], [total_q, Hkv, dv], packed as q
  Rotary rotary;                    // optional: rotates q and k_new (qkv/rotary.hpp)
  View4<T> k_cache, v_cache;        // as BatchArgs'; each sequence's last n_b rows written
  View3<float> out;
  TensorView<float, 2> lse;         // optional
  View3<float> k_scale, v_scale;    // int8: the new rows' scales written; float8: read
  KeyIndices indices;               // as BatchArgs'
  // Keys in two parts (see above): k_new then holds each new key's first head_dim − dr
  // channels, k_rope_new [total_q, Hkv, dr] its last dr (rotated), written to k_rope_cache.
  View3<const float> k_rope_new;
  View4<T> k_rope_cache;
};

// run over FlashMLA's FP8 records (see above).
struct BatchRecordArgs {
  View3<const float> q;                 // [total_q, Hq, dc + dr]
  View3<const std::uint8_t> records;    // [B, capacity, R] or the pool [num_blocks, block_size, R]
  View3<float> out;                     // [total_q, Hq, dc]
  TensorView<float, 2> lse;             // optional, [Hq, total_q]
  KeyIndices indices;                   // optional, packed [total_q, topk] (as BatchArgs')
};

// run_appending over FlashMLA's FP8 records (see above): the new tokens packed, stored, attended.
struct BatchRecordAppendArgs {
  View3<const float> q;                 // [total_q, Hq, dc + dr]: read only (rotated into scratch)
  TensorView<const float, 2> k_new;       // c_kv [total_q, dc], packed as q
  TensorView<const float, 2> k_rope_new;  // k_pe [total_q, dr], rotated by `rotary` before packing
  Rotary rotary;                        // optional
  View3<std::uint8_t> records;          // as BatchRecordArgs'; each sequence's last n_b records written
  View3<float> out;                     // [total_q, Hq, dc]
  TensorView<float, 2> lse;             // optional, [Hq, total_q]
  KeyIndices indices;                   // optional, as BatchRecordArgs'
  RecordScales scales = RecordScales::power_of_two;  // qkv::pack_mla_records' rule
};

class BatchPlan {
 public:
  BatchPlan(const BatchLayout& layout, const AttentionOptions& options);
  ~BatchPlan();
  BatchPlan(const BatchPlan&);
  BatchPlan& operator=(const BatchPlan&);
  BatchPlan(BatchPlan&&) noexcept;
  BatchPlan& operator=(BatchPlan&&) noexcept;

  void run(const BatchArgs<float>& args) const;
  void run(const BatchArgs<bfloat16>& args) const;
  void run(const BatchArgs<float16>& args) const;
  void run(const BatchArgs<std::int8_t>& args) const;
  void run(const BatchArgs<float8_e4m3fn>& args) const;
  void run(const BatchArgs<float8_e5m2>& args) const;
  // The new tokens written into the caches (rotated, and quantized for int8 and float8),
  // then the step as run(BatchArgs) computes it: see "Appending" above.
  void run_appending(const BatchAppendArgs<float>& args) const;
  void run_appending(const BatchAppendArgs<bfloat16>& args) const;
  void run_appending(const BatchAppendArgs<float16>& args) const;
  void run_appending(const BatchAppendArgs<std::int8_t>& args) const;
  void run_appending(const BatchAppendArgs<float8_e4m3fn>& args) const;
  void run_appending(const BatchAppendArgs<float8_e5m2>& args) const;
  // The step over FlashMLA's FP8 records: see above.
  void run(const BatchRecordArgs& args) const;
  // The new tokens packed into the records, then that step: see above.
  void run_appending(const BatchRecordAppendArgs& args) const;
  // The step over a qkv::KVCache: q [total_q, Hq, d], out [total_q, Hq, dv], lse
  // [Hq, total_q] (optional).
  void run(View3<const float> q, const KVCache& cache, View3<float> out, TensorView<float, 2> lse = {}) const;
  // The same over packed key lists (BatchArgs::indices says what they hold).
  void run(View3<const float> q, const KVCache& cache, View3<float> out, TensorView<float, 2> lse,
           const KeyIndices& indices) const;

  int64_t sequences() const;      // B
  int64_t total_queries() const;  // cu_seqlens_q[B]
  int64_t tasks() const;          // units of parallel work of one run
  // The plan's cost estimate of each task (flop-equivalents: max(flops, 8 · bytes), the
  // streaming or the arithmetic, whichever binds), in the order threads take them (a
  // plan with shared prefixes: their passes' tasks first, run before the step's): for
  // modelling how a step spreads over more cores than a machine has (bench/).
  std::vector<double> task_costs() const;
  // The groups that share a prefix (layout.share_prefixes; empty otherwise or when no
  // sequences share a whole block).
  std::vector<PrefixGroup> prefix_groups() const;

  struct State;  // opaque (src/serve/batch_plan.cpp)

 private:
  std::shared_ptr<const State> state_;
};

}  // namespace qkv
