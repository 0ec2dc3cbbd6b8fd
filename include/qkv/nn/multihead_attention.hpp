// MultiHeadAttention: learned projections around qkv::attention_forward/backward.
//
//   Q = query·W_Qᵀ + b_Q   [B, Nq, H·d]     seen as [B, Nq, H, d]   (no transpose: a view)
//   K = key·W_Kᵀ + b_K     [B, Nk, Hkv·d]   seen as [B, Nk, Hkv, d]
//   V = value·W_Vᵀ + b_V   [B, Nk, Hkv·d]   seen as [B, Nk, Hkv, d]
//   C = softmax(Q·Kᵀ/√d + mask)·V           per head                 (qkv::attention_*)
//   out = C·W_Oᵀ + b_O     [B, Nq, E]
//
// with d = E / H. Self-attention passes one tensor as query, key and value; cross-
// attention passes another for key and value (of key_dim / value_dim features, as
// torch.nn.MultiheadAttention's kdim / vdim). With num_kv_heads < num_heads, key/value
// heads are shared by groups of query heads (GQA; 1 = MQA). The backward runs the chain
// in reverse: dC = dout·W_O, then qkv::attention_backward gives dQ, dK, dV, and each
// projection's backward gives its input and parameter gradients.
//
// Incremental decoding (forward_cached, float layers): the keys and values of earlier
// tokens are kept in a qkv::KVCache; each call projects only the new tokens, appends their
// K and V to the cache and attends their queries to everything cached (qkv::decode):
//   K_new, V_new = x·W_Kᵀ + b_K, x·W_Vᵀ + b_V  →  cache.append(K_new, V_new)
//   C = cache.attend(Q)                         (bottom-right causal: query i of T new
//                                               tokens sees the cache up to its own key)
//   out = C·W_Oᵀ + b_O
//
// Initialization (PyTorch's, for separate projection weights): W_Q, W_K, W_V
// Xavier-uniform U(±√(6/(fan_in + fan_out))), W_O U(±1/√E), every bias 0.
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "qkv/attention_stats.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {

struct MultiHeadAttentionConfig {
  int64_t embed_dim = 0;     // E: features of the query input and of the output
  int64_t num_heads = 0;     // H query heads, each of dimension E / H
  int64_t num_kv_heads = 0;  // 0: num_heads. Fewer (dividing num_heads): GQA; 1: MQA
  int64_t key_dim = 0;       // features of the key input; 0: E
  int64_t value_dim = 0;     // features of the value input; 0: E
  bool bias = true;          // biases on all four projections
  Causal causal = Causal::none;
  Execution execution;       // backend and threads for the attention core
  // Multiplies Q·Kᵀ; unset: 1/√d (qkv's default). 1 trains without the scale, which is
  // what `qkv demo --unscaled` shows going wrong.
  std::optional<double> scale;
};

// Per-call masking on top of the configured causality (see qkv/options.hpp). The views
// must stay alive until the matching backward.
struct AttentionMasking {
  Mask mask;                               // [B|1, H|1, Nq|1, Nk]
  std::span<const int64_t> key_lengths;    // per batch entry: keys [0, len) take part
};

// What forward keeps for backward, and backward's scratch. Buffers are reused across
// calls of the same shape.
template <class T>
struct MultiHeadAttentionSaved {
  int64_t batch = 0, q_len = 0, k_len = 0;
  Tensor<T, 2> q, k, v;   // projections: [B·Nq, H·d], [B·Nk, Hkv·d], [B·Nk, Hkv·d]
  Tensor<T, 2> context;   // attention output before W_O: [B·Nq, H·d]
  Tensor<T, 3> lse;       // [B, H, Nq]
  AttentionMasking masking;
  Tensor<T, 2> d_context, dq, dk, dv;  // backward scratch
};

template <class T>
struct AttentionInputGrads {
  TensorView<T, 3> query, key, value;  // written; an empty view skips that input
};

template <class T>
class MultiHeadAttention {
 public:
  using Saved = MultiHeadAttentionSaved<T>;

  MultiHeadAttention() = default;
  // Throws qkv::Error if E is not a multiple of H or H not a multiple of Hkv.
  explicit MultiHeadAttention(const MultiHeadAttentionConfig& config);

  const MultiHeadAttentionConfig& config() const { return config_; }
  int64_t head_dim() const { return config_.embed_dim / config_.num_heads; }

  void reset_parameters(Rng& rng);

  // query [B, Nq, E], key [B, Nk, key_dim], value [B, Nk, value_dim] → out [B, Nq, E].
  // Views need contiguous rows ([B, N] flattens to B·N rows). `weights`, if given
  // ([B, H, Nq, Nk]), receives the attention probabilities (this runs the reference
  // backend, whatever `execution` says).
  void forward(TensorView<const T, 3> query, TensorView<const T, 3> key,
               TensorView<const T, 3> value, TensorView<T, 3> out, Saved& saved,
               const AttentionMasking& masking = {}, View4<T> weights = {}) const;

  // Accumulates every parameter gradient and writes the input gradients named in `grads`.
  void backward(TensorView<const T, 3> query, TensorView<const T, 3> key,
                TensorView<const T, 3> value, Saved& saved, TensorView<const T, 3> dout,
                const AttentionInputGrads<T>& grads);

  // Self-attention: query = key = value = x; backward writes dx = the sum of the three.
  void forward(TensorView<const T, 3> x, TensorView<T, 3> out, Saved& saved,
               const AttentionMasking& masking = {}, View4<T> weights = {}) const;
  void backward(TensorView<const T, 3> x, Saved& saved, TensorView<const T, 3> dout,
                TensorView<T, 3> dx);

  // Self-attention of T new tokens x [B, T, E] that continue the B sequences held in
  // `cache` → out [B, T, E]. Appends K, V of x to the cache (rounded to its storage type),
  // then attends: with causal set (either alignment) query i sees the cached keys up to
  // its own token (bottom-right); with Causal::none every new query sees every new key
  // too. Scale and threads come from the config; the decode kernel has no other backend.
  // `scratch` holds the projections (nothing is kept for a backward: the cache path is
  // for inference). Everything is checked (check_cache) before the cache changes.
  void forward_cached(TensorView<const T, 3> x, TensorView<T, 3> out, KVCache& cache,
                      Saved& scratch) const
    requires std::same_as<T, float>;

  // Throws qkv::Error unless `cache` fits this layer (kv_heads = num_kv_heads, head_dim =
  // v_dim = E / H, batch = `batch`) and can take `new_tokens` more tokens per sequence
  // (capacity; for a paged cache, enough free blocks). Changes nothing.
  void check_cache(const KVCache& cache, int64_t batch, int64_t new_tokens) const;

  void collect(ParameterList<T>& list, const std::string& prefix);

  Linear<T> q_proj, k_proj, v_proj, out_proj;
  // When set, every forward also writes the softmax statistics of its attention there
  // (qkv/attention_stats.hpp: how saturated each head is); views [B, H] / [B, H, Nq].
  const AttentionStats<T>* stats = nullptr;

 private:
  AttentionOptions attention_options(const AttentionMasking& masking) const;

  MultiHeadAttentionConfig config_;
};

}  // namespace qkv::nn
