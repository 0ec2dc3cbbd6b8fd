// AttentionOptions — every knob of one attention call, in one small struct.
//
// Defaults give plain softmax(Q·Kᵀ/√d)·V. Optional features live in their own
// sub-structs so later ones (sliding window, ALiBi, soft-capping, varlen, KV cache,
// half precision, dropout) are new members with inert defaults: callers that use
// designated initializers keep compiling and keep their meaning.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "qkv/modifiers.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

// Which (query, key) pairs a causal mask keeps. With Nq queries and Nk keys:
//   top_left:     key j is visible to query i iff j <= i                (PyTorch is_causal)
//   bottom_right: key j is visible to query i iff j <= i + (Nk - Nq)    (FlashAttention)
// With key_lengths, bottom_right aligns the last query with the last *valid* key of
// its batch entry (Nk replaced by key_lengths[b]), as a padded KV cache needs.
enum class Causal { none, top_left, bottom_right };

// Masks are 4-D views [batch, heads, Nq, Nk]; batch, heads and Nq may each be 1 to
// broadcast (PyTorch's key-padding masks are [B, 1, 1, Nk]). Either or both may be set.
struct Mask {
  // Boolean: nonzero = the key takes part (PyTorch's bool attn_mask convention).
  TensorView<const std::uint8_t, 4> keep;
  // Additive: added to the scaled logits; -inf (or <= -1e30) removes the key; a NaN makes
  // its query row NaN (output, lse, gradients), as in PyTorch.
  TensorView<const float, 4> bias;

  bool empty() const { return keep.empty() && bias.empty(); }
};

enum class Backend {
  automatic,  // the fastest backend that supports the call
  reference,  // exact oracle: fp64 accumulation, materialized S and P, explicit Jacobian
  cpu,        // fused FlashAttention-2 style kernels (fp32)
};

// The arithmetic of the fused kernels (docs/numerics.md, bench/RESULTS.md §10):
//   fast:  the default. Where the CPU has dot-product units for the storage type that
//          beat its float32 FMAs (AMX tiles on Intel Xeons, AVX512-BF16 on AMD Zen 4/5 for
//          bfloat16; not Intel's vdpbf16ps, a quarter of the FMA rate), the block products
//          use them: Q·Kᵀ from exact bf16 products summed in float32, P rounded to bfloat16
//          once for P·V, and in the backward all five products with P and dS rounded once,
//          as PyTorch does: out, lse and every gradient within 2× PyTorch's bf16 error
//          against fp64 (measured: within 1.1×). Elsewhere (float16, float32, caches) it
//          is `exact`.
//   exact: every input widened exactly to float32, float32 products and sums: the same
//          bits as before this option existed, on every machine.
// float32 and float16 storage compute the same either way (no fp16 dot on these CPUs).
enum class Precision { fast, exact };

struct Execution {
  Backend backend = Backend::automatic;
  int threads = 0;  // 0: every hardware thread. Results never depend on this.
  // Opt-in: scan inputs first and throw an Error naming the first non-finite element
  // (tensor and index). Off by default: NaN/Inf otherwise propagate only to the output
  // rows they touch.
  bool check_finite = false;
  // Opt-in, for generations that must reproduce exactly (RL rollouts matched by a trainer,
  // evals): the split-K schedule (qkv::decode, KVCache::attend, qkv::BatchPlan, and
  // attention calls of ≤ 16 queries per sequence without elementwise masks) splits each
  // row's keys into chunks and blocks on a grid fixed by the key index alone (chunks of
  // 1024 keys from key 0), so a row's bits depend only on that row and the keys it sees —
  // a token computed in a decode step gets the same bits as the same row computed inside a
  // prefill chunk. Costs a little speed for sequences of few queries (bench/RESULTS.md).
  // The default is already batch invariant (see qkv/batch_plan.hpp) but not this.
  bool fixed_key_split = false;
};

// Sliding window, FlashAttention's `window_size`: query i sees key j only when
//   i + offset − left  ≤  j  ≤  i + offset + right        (−1: that side unbounded)
// where offset aligns queries to keys as the causal mode does: 0 for top_left, and
// bottom-right (Nk − Nq, Nk being the entry's valid key length) for bottom_right and
// none, FlashAttention's convention. Combined with causality, the window cuts the visible
// prefix further. Tiles outside every row's window are skipped, so time grows with the
// window, not with N.
struct Window {
  int64_t left = -1;
  int64_t right = -1;
  bool active() const { return left >= 0 || right >= 0; }
};

// Attention dropout for training, FlashAttention's way: each weight P_ij is kept with
// probability 1 − p and scaled by 1/(1 − p); the keep decision is a counter-based hash of
// (seed, offset, batch, head, query, key), so the backward regenerates it instead of
// storing it and results never depend on the thread count. The normalizer (and LSE) is
// that of the undropped weights.
struct Dropout {
  float p = 0.0f;  // in [0, 1)
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
};

struct AttentionOptions {
  // Multiplies Q·Kᵀ. Unset: 1/√d, which keeps the logits' variance at 1 for unit-variance
  // q and k (Var(q·k) = d). Must be finite and > 0.
  std::optional<double> scale;
  Causal causal = Causal::none;
  Mask mask;
  // Per batch entry b, only keys [0, key_lengths[b]) take part. Empty: all keys.
  std::span<const int64_t> key_lengths;

  // Variants of today's models (all inert by default).
  Window window;
  // ALiBi (BLOOM, MPT): one slope per query head; adds −slope·|i + Nk − Nq − j| to the
  // logits (positions aligned bottom-right, Nk the entry's valid key length), computed in
  // the kernel, never materialized.
  std::span<const float> alibi_slopes;
  // Logit soft-capping (Gemma 2): c > 0 turns each scaled logit s into c·tanh(s/c),
  // before masks and biases are added. 0: off.
  float softcap = 0.0f;
  // Attention sinks (gpt-oss): one logit per query head that joins every row's softmax
  // denominator without a value; the backward returns its gradient (BackwardArgs::dsinks).
  std::span<const float> sinks;
  Dropout dropout;
  // Programmable score_mod / mask_mod (qkv/modifiers.hpp): non-owning, like the masks.
  Modifiers modifiers;

  Precision precision = Precision::fast;
  Execution execution;
};

}  // namespace qkv
