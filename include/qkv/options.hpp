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
  // Additive: added to the scaled logits; -inf removes the key.
  TensorView<const float, 4> bias;

  bool empty() const { return keep.empty() && bias.empty(); }
};

enum class Backend {
  automatic,  // the fastest backend that supports the call
  reference,  // exact oracle: fp64 accumulation, materialized S and P, explicit Jacobian
  cpu,        // fused FlashAttention-2 style kernels (fp32)
};

struct Execution {
  Backend backend = Backend::automatic;
  int threads = 0;  // 0: every hardware thread. Results never depend on this.
  // Opt-in: scan inputs first and throw an Error naming the first non-finite element
  // (tensor and index). Off by default: NaN/Inf otherwise propagate only to the output
  // rows they touch.
  bool check_finite = false;
};

struct AttentionOptions {
  // Multiplies Q·Kᵀ. Unset: 1/√d, which keeps the logits' variance at 1 for unit-variance
  // q and k (Var(q·k) = d). Must be finite and > 0.
  std::optional<double> scale;
  Causal causal = Causal::none;
  Mask mask;
  // Per batch entry b, only keys [0, key_lengths[b]) take part. Empty: all keys.
  std::span<const int64_t> key_lengths;
  Execution execution;
};

}  // namespace qkv
