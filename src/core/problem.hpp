// The validated, normalized form of one attention call that backends receive.
// Built only by validate.cpp; a backend may assume every invariant written here.
//
// One description serves every backend and pass: `Sequences` says which rows of the
// caller's tensors form each batch entry (dense batches and packed varlen alike),
// `MaskRule` says which (query, key) pairs of an entry take part and with which bias.
// The reference reads them row by row; the cpu kernels summarize them per tile once per
// call (core/tile_plan.hpp). Nothing re-derives masks elsewhere.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "core/kv_source.hpp"
#include "qkv/attention.hpp"
#include "qkv/options.hpp"

namespace qkv::detail {

struct Extents {
  int64_t batch = 0;     // batch entries (varlen: sequences)
  int64_t q_len = 0;     // Nq; varlen: the longest query sequence
  int64_t k_len = 0;     // Nk; varlen: the longest key sequence
  int64_t q_heads = 0;   // Hq ≥ 1
  int64_t kv_heads = 0;  // Hkv ≥ 1, divides Hq
  int64_t head_dim = 0;  // d ≥ 1
  int64_t v_dim = 0;     // dv ≥ 1

  int64_t group() const { return q_heads / kv_heads; }  // query heads per kv head
  int64_t kv_head_of(int64_t q_head) const { return q_head / group(); }
};

// The batch entries of a call. Dense: entry b is batch index b of the views, rows
// [0, Nq) and [0, Nk). Varlen: the views are the packed [total, heads, dim] tensors seen
// as [sequences, total, heads, dim] with batch stride 0, and entry b owns query rows
// [cu_q[b], cu_q[b+1]) and key rows [cu_k[b], cu_k[b+1]).
struct Sequences {
  int64_t count = 0;
  int64_t dense_q_len = 0, dense_k_len = 0;
  std::vector<int64_t> cu_q, cu_k;  // count + 1 prefix sums; empty when dense

  bool varlen() const { return !cu_q.empty(); }
  int64_t q_begin(int64_t b) const { return varlen() ? cu_q[b] : 0; }
  int64_t k_begin(int64_t b) const { return varlen() ? cu_k[b] : 0; }
  int64_t q_len(int64_t b) const { return varlen() ? cu_q[b + 1] - cu_q[b] : dense_q_len; }
  int64_t k_len(int64_t b) const { return varlen() ? cu_k[b + 1] - cu_k[b] : dense_k_len; }
};

// Speculative-decoding trees (qkv::BatchPlan's tree_mask): sequence b's n = q_len(b) new
// tokens are its last n keys; where offsets[b] ≥ 0, the row-major n×n mask at
// bits[offsets[b]] says which of them token i sees (nonzero: visible). It replaces
// causality among the new tokens — a draft tree need not be laid out in topological order —
// while every key before them (the cached prefix) stays visible to each of them. BatchPlan
// refuses windows, ALiBi and key lists with a tree, and key_lengths are never set for it.
struct TreeMask {
  std::span<const std::uint8_t> bits;
  std::span<const int64_t> offsets;  // per sequence (−1: no tree); empty: no trees at all

  bool has(int64_t b) const { return !offsets.empty() && offsets[static_cast<std::size_t>(b)] >= 0; }
};

// Which keys query (b, h, i) sees and what is added to its logits. Causality and key
// padding cut each row to a prefix [0, key_end); the boolean and additive masks act
// element by element inside that prefix.
//
// A key is *removed* (never read: a NaN behind it cannot reach the row) when it lies past
// key_end, its boolean mask entry or mask_mod is false, or its bias is ≤ kRemovalBias
// (−inf, and the "finfo.min" that PyTorch and transformers use for padding). One exception keeps
// PyTorch's result: a row none of whose keys has a bias above kRemovalBias, but some of
// which have a finite bias ≤ kRemovalBias (a *degenerate* row, e.g. a padding query of a
// left-padded batch), takes those keys literally, as PyTorch's softmax does: with every
// logit at ≈ finfo.min it averages their values.
struct MaskRule {
  // Additive mask entries at or below this remove the key (see above). Far below any
  // logit a model produces and above float's lowest value, −3.4e38.
  static constexpr float kRemovalBias = -1e30f;

  Causal causal = Causal::none;
  Sequences sequences;
  std::span<const int64_t> key_lengths;
  Window window;
  // With sinks every row has a normal competitor, so no row is degenerate (a row of
  // ≤ kRemovalBias keys then gives its weight to the sink, as the literal math does).
  bool has_sinks = false;
  View4<const std::uint8_t> keep;  // broadcast axes have stride 0 after validation
  View4<const float> bias;
  // A programmable mask (qkv/modifiers.hpp): one more keep condition, never with bias.
  MaskModHook mask_mod;
  TreeMask tree;

  int64_t q_len(int64_t b) const { return sequences.q_len(b); }
  int64_t valid_keys(int64_t b) const {
    return key_lengths.empty() ? sequences.k_len(b) : key_lengths[b];
  }

  // Where query i meets the keys for the window: 0 (top_left) or bottom-right.
  int64_t window_offset(int64_t b) const {
    return causal == Causal::top_left ? 0 : valid_keys(b) - q_len(b);
  }

  // One past the last key that causality, padding and the window leave to query row i
  // of entry b. Never decreases along i.
  int64_t key_end(int64_t b, int64_t i) const {
    const int64_t valid = valid_keys(b);
    if (tree.has(b)) return valid;  // the tree, not causality, orders the new tokens
    int64_t end = valid;
    switch (causal) {
      case Causal::top_left:
        end = std::min(valid, i + 1);
        break;
      case Causal::bottom_right:
        end = std::clamp<int64_t>(i + 1 + (valid - q_len(b)), 0, valid);
        break;
      case Causal::none:
        break;
    }
    if (window.right >= 0) end = std::clamp<int64_t>(i + window_offset(b) + window.right + 1, 0, end);
    return end;
  }

  // The first key the window leaves to query row i (0 without a left window). Never
  // decreases along i; the row sees [key_begin, key_end), possibly nothing.
  int64_t key_begin(int64_t b, int64_t i) const {
    if (window.left < 0) return 0;
    return std::clamp<int64_t>(i + window_offset(b) - window.left, 0, valid_keys(b));
  }

  // Sequence b's first new token's key: a tree (tree.has(b)) acts on keys from here on.
  int64_t tree_begin(int64_t b) const { return valid_keys(b) - q_len(b); }
  // Does new token i of sequence b (tree.has(b)) see key j ≥ tree_begin(b)?
  bool tree_sees(int64_t b, int64_t i, int64_t j) const {
    const int64_t n = q_len(b);
    return tree.bits[static_cast<std::size_t>(tree.offsets[static_cast<std::size_t>(b)] + i * n + (j - tree_begin(b)))] != 0;
  }

  bool has_elementwise() const { return !keep.empty() || !bias.empty(); }
  bool has_mask_mod() const { return mask_mod.active(); }
  bool keeps(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return (keep.empty() || keep(b, h, i, j) != 0) &&
           (!has_mask_mod() || mask_mod.keeps(mask_mod.context, b, h, i, j)) &&
           (!tree.has(b) || j < tree_begin(b) || tree_sees(b, i, j));
  }
  float bias_at(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return bias.empty() ? 0.0f : bias(b, h, i, j);
  }

  // The row takes its ≤ kRemovalBias keys literally (see above). O(Nk): the reference
  // asks per row; the kernels read the per-row flags of the tile plan.
  bool degenerate_row(int64_t b, int64_t h, int64_t i) const {
    if (bias.empty() || has_sinks) return false;
    bool any_soft = false;
    for (int64_t j = key_begin(b, i), end = key_end(b, i); j < end; ++j) {
      if (!keeps(b, h, i, j)) continue;
      const float value = bias(b, h, i, j);
      if (!(value <= kRemovalBias)) return false;  // a normal key (NaN counts: it must show)
      any_soft = any_soft || value != -std::numeric_limits<float>::infinity();
    }
    return any_soft;
  }

  // Does key j (in [key_begin, key_end)) take part in row i, given whether the row is
  // degenerate?
  bool takes_part(int64_t b, int64_t h, int64_t i, int64_t j, bool degenerate) const {
    if (!keeps(b, h, i, j)) return false;
    const float value = bias_at(b, h, i, j);
    if (value == -std::numeric_limits<float>::infinity()) return false;
    return degenerate || !(value <= kRemovalBias);
  }
};

// What the variants do to a row's logits beyond which keys take part, in the order the
// kernels apply them:  s = scale·q·k  →  softcap·tanh(s/softcap)  →  + ALiBi  →
// score_mod  → + mask bias; then the softmax over the keys and the sink; then dropout on
// the weights.
struct ScoreModifiers {
  float softcap = 0.0f;                  // 0: off
  std::span<const float> alibi_slopes;   // per query head, or empty
  std::span<const float> sinks;          // per query head, or empty
  Dropout dropout;
  ScoreModHook score_mod;                // programmable (qkv/modifiers.hpp), or inactive

  bool has_alibi() const { return !alibi_slopes.empty(); }
  bool has_score_mod() const { return score_mod.active(); }
  bool has_sinks() const { return !sinks.empty(); }
  bool has_dropout() const { return dropout.p > 0.0f; }
  // ALiBi's bias of (query i, key j) of head h: −slope·|i + offset − j|, with the offset
  // aligning the last query to the entry's last valid key.
  static int64_t alibi_offset(const MaskRule& mask, int64_t b) {
    return mask.valid_keys(b) - mask.q_len(b);
  }
};

// Row accessors that apply the sequence offsets: backends never index the views with a
// bare row number.
template <class Args>
struct RowAccess {
  const Sequences* sequences = nullptr;
  const Args* args = nullptr;

  auto* q(int64_t b, int64_t i, int64_t h) const {
    return &args->q(b, sequences->q_begin(b) + i, h, 0);
  }
  auto* k(int64_t b, int64_t j, int64_t kv) const {
    return &args->k(b, sequences->k_begin(b) + j, kv, 0);
  }
  auto* v(int64_t b, int64_t j, int64_t kv) const {
    return &args->v(b, sequences->k_begin(b) + j, kv, 0);
  }
  auto* out(int64_t b, int64_t i, int64_t h) const {
    return &args->out(b, sequences->q_begin(b) + i, h, 0);
  }
  auto& lse(int64_t b, int64_t h, int64_t i) const {
    return args->lse(b, h, sequences->q_begin(b) + i);
  }
};

template <class T>
struct ForwardProblem {
  Extents extents;
  double scale = 1.0;
  MaskRule mask;  // holds the Sequences too
  ScoreModifiers modifiers;
  ForwardArgs<T> args;  // args.stats is null: read `stats` below
  // Where the key/value rows live when they are not the views args.k / args.v: a cache
  // (qkv::decode, KVCache::attend; core/kv_source.hpp) — contiguous or paged, any storage
  // type, int8 with row scales — read by the split-K schedule and the reference, with
  // args.k / args.v empty. Empty (kv.k null) for dense and varlen calls. key_values() is
  // the one description either way.
  KvSource kv;
  int threads = 1;  // resolved: ≥ 1
  // options.execution.fixed_key_split: the split-K schedule splits keys on a fixed grid
  // (cpu/decode_plan.hpp), so a row's bits do not depend on the rows computed with it.
  bool fixed_key_split = false;
  // options.precision, checked: whether the kernels may use dot-product units.
  Precision precision = Precision::fast;
  // Softmax statistics (qkv/attention_stats.hpp, core/head_stats.hpp), normalized like
  // the other views: per-row views [B, Hq, Nq] (varlen: batch stride 0, rows addressed
  // through the sequence offsets), in float for the 16-bit storage types. `collect_stats`
  // is false when none were asked for.
  AttentionStats<LseOf<T>> stats;
  bool collect_stats = false;

  const Sequences& sequences() const { return mask.sequences; }
  RowAccess<ForwardArgs<T>> rows() const { return {&mask.sequences, &args}; }
  // K and V are args.k / args.v (else only `kv` describes them: a paged, scaled or
  // differently stored cache, which only the split-K schedule and the reference read).
  bool kv_in_args() const { return kv.k == nullptr; }
  KvSource key_values() const {
    return kv_in_args() ? KvSource::of_views(storage_type_of<T>, args.k, args.v) : kv;
  }
};

template <class T>
struct BackwardRowAccess : RowAccess<BackwardArgs<T>> {
  auto* dout(int64_t b, int64_t i, int64_t h) const {
    return &this->args->dout(b, this->sequences->q_begin(b) + i, h, 0);
  }
  auto* dq(int64_t b, int64_t i, int64_t h) const {
    return &this->args->dq(b, this->sequences->q_begin(b) + i, h, 0);
  }
  auto* dk(int64_t b, int64_t j, int64_t kv) const {
    return &this->args->dk(b, this->sequences->k_begin(b) + j, kv, 0);
  }
  auto* dv(int64_t b, int64_t j, int64_t kv) const {
    return &this->args->dv(b, this->sequences->k_begin(b) + j, kv, 0);
  }
};

template <class T>
struct BackwardProblem {
  Extents extents;
  double scale = 1.0;
  MaskRule mask;
  ScoreModifiers modifiers;
  BackwardArgs<T> args;
  int threads = 1;
  Precision precision = Precision::fast;

  const Sequences& sequences() const { return mask.sequences; }
  BackwardRowAccess<T> rows() const { return {{&mask.sequences, &args}}; }
};

}  // namespace qkv::detail
