// A decoder-only (GPT-style, pre-norm) transformer built from qkv::nn's layers:
//
//   x₀ = tok[ids] + pos[0:N]
//   for each block l:   h = x + Attn(LN₁(x))       (causal multi-head self-attention)
//                       x = h + MLP(LN₂(h))        (Linear → GELU → Linear)
//   logits = LN_f(x)·W_headᵀ
//
// The backward runs the same chain in reverse; a residual's gradient is the sum of the
// gradient flowing straight through and the one through its branch.
//
// Incremental decoding (float models): make_caches() builds one qkv::KVCache per block;
// forward_step() feeds T new tokens per sequence, at positions lengths[b] .. lengths[b]+T−1
// of the caches, through the same blocks (only the new tokens are projected; each block's
// attention appends their K/V to its cache and attends them to everything cached, bottom-
// right causal), and returns the logits of the new tokens. A prompt is one step with all
// its tokens (prefill); generation then feeds one token per step:
//
//   auto caches = model.make_caches({.batch = 1, .dtype = qkv::StorageType::bfloat16});
//   auto logits = model.forward_step(prompt, 1, prompt.size(), caches);   // [T, vocab]
//   for (...) {
//     int32_t next = argmax(last row of logits);
//     logits = model.forward_step({&next, 1}, 1, 1, caches);             // [1, vocab]
//   }
//
// The logits equal forward()'s over the whole sequence at the same positions up to float
// rounding (the two sum in different orders; with a 16-bit cache, K and V are also rounded
// once to its type). The caches are plain qkv::KVCache objects the caller owns: reset(seq)
// starts a sequence over, and sequences may hold different lengths (each gets its own
// positions). Caches may be paged (vLLM's layout) and store float32, bfloat16 or float16.
//
// Initialization (GPT-2's): every Linear and embedding weight N(0, 0.02²), the two
// projections that write into the residual stream (attention W_O and MLP fc2)
// N(0, (0.02/√(2L))²) so the stream's variance does not grow with depth; biases 0;
// LayerNorm γ = 1, β = 0.
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "qkv/kv_cache.hpp"
#include "qkv/nn/embedding.hpp"
#include "qkv/nn/layer_norm.hpp"
#include "qkv/nn/linear.hpp"
#include "qkv/nn/mlp.hpp"
#include "qkv/nn/multihead_attention.hpp"
#include "qkv/options.hpp"

namespace qkv::nn {

struct TransformerConfig {
  int64_t vocab_size = 0;
  int64_t context = 0;       // longest sequence (size of the position table)
  int64_t embed_dim = 0;     // E
  int64_t num_heads = 0;     // H, dividing E
  int64_t num_kv_heads = 0;  // 0: H; fewer: GQA
  int64_t num_layers = 0;    // L ≥ 1
  int64_t mlp_dim = 0;       // 0: 4·E
  Execution execution;       // for the attention core
  std::optional<double> attention_scale;  // unset: 1/√d (MultiHeadAttentionConfig::scale)
};

// What Transformer::make_caches builds: one qkv::KVCache per block, whose kv_heads and
// head_dim come from the model.
struct TransformerCacheConfig {
  int64_t batch = 1;      // sequences decoded together
  int64_t capacity = 0;   // tokens per sequence, ≤ context; 0: context
  StorageType dtype = StorageType::float32;  // or bfloat16 / float16: half the memory
  bool paged = false;     // a block pool and block table per layer (KVCacheConfig)
  int64_t block_size = 16;
  int64_t num_blocks = 0;  // paged: per layer's pool; 0: every sequence at capacity
};

template <class T>
struct TransformerBlockSaved {
  Tensor<T, 2> ln1_out, attn_out, mid, ln2_out, mlp_out;  // [rows, E]
  LayerNormSaved<T> ln1, ln2;
  MultiHeadAttentionSaved<T> attn;
  MlpSaved<T> mlp;
};

template <class T>
class TransformerBlock {
 public:
  using Saved = TransformerBlockSaved<T>;

  TransformerBlock() = default;
  explicit TransformerBlock(const TransformerConfig& config);

  // x, y [B, N, E] (contiguous). `weights` as MultiHeadAttention::forward.
  void forward(TensorView<const T, 3> x, TensorView<T, 3> y, Saved& saved,
               View4<T> weights = {}) const;
  // d [B, N, E]: on entry ∂L/∂y, on return ∂L/∂x. Accumulates parameter gradients.
  void backward(TensorView<const T, 3> x, Saved& saved, TensorView<T, 3> d,
                Tensor<T, 2>& scratch);
  // The same block for x [B, T, E] = T new tokens continuing the sequences in `cache`
  // (MultiHeadAttention::forward_cached); `scratch` keeps nothing for a backward.
  void forward_step(TensorView<const T, 3> x, TensorView<T, 3> y, KVCache& cache,
                    Saved& scratch) const
    requires std::same_as<T, float>;

  void collect(ParameterList<T>& list, const std::string& prefix);

  LayerNorm<T> ln1;
  MultiHeadAttention<T> attn;
  LayerNorm<T> ln2;
  Mlp<T> mlp;
};

template <class T>
class Transformer {
 public:
  // Throws qkv::Error for a config with a non-positive size or E not a multiple of H.
  explicit Transformer(const TransformerConfig& config);

  const TransformerConfig& config() const { return config_; }
  void reset_parameters(Rng& rng);

  // Every parameter, named ("tok.weight", "blocks.0.attn.q_proj.weight", ...), in a
  // fixed order.
  ParameterList<T> parameters();

  // ids [batch, seq] row-major, seq ≤ context, each id in [0, vocab). Returns the logits
  // [batch·seq, vocab] (valid until the next forward) and keeps what backward needs.
  Matrix<const T> forward(std::span<const int32_t> ids, int64_t batch, int64_t seq);

  // forward, then the mean softmax cross-entropy against targets [batch·seq]; keeps
  // ∂loss/∂logits for backward().
  double forward_loss(std::span<const int32_t> ids, std::span<const int32_t> targets,
                      int64_t batch, int64_t seq);

  // Backpropagates ∂loss/∂logits from the last forward_loss (or the given gradient,
  // [batch·seq, vocab], after a forward) and accumulates every parameter gradient.
  void backward();
  void backward(Matrix<const T> dlogits);

  // Incremental decoding (see the top of this file). One cache per block, each
  // [batch, capacity, num_kv_heads, E / H]; fresh caches hold no tokens.
  std::vector<KVCache> make_caches(const TransformerCacheConfig& cache_config) const
    requires std::same_as<T, float>;

  // ids [batch, new_tokens] row-major continue the sequences held in `caches` (one per
  // block, as make_caches builds them, all holding the same lengths): sequence b's new
  // tokens take positions lengths[b] .. lengths[b] + new_tokens − 1. Appends their keys
  // and values to every cache and returns their logits [batch·new_tokens, vocab] (valid
  // until the next forward_step). Leaves what backward() needs untouched.
  // Throws qkv::Error, with every cache unchanged, on an id outside [0, vocab), a position
  // at or past context, a cache that does not fit the model (kv_heads, head_dim), a batch
  // other than the caches', too few caches, caches of different lengths, or a cache
  // without room (capacity, free blocks).
  Matrix<const T> forward_step(std::span<const int32_t> ids, int64_t batch, int64_t new_tokens,
                               std::span<KVCache> caches)
    requires std::same_as<T, float>;

  // The attention probabilities [1, H, n, n] of block `layer` for one sequence.
  Tensor<T, 4> attention_weights(std::span<const int32_t> ids, int64_t layer);

  Embedding<T> tok;
  PositionEmbedding<T> pos;
  std::vector<TransformerBlock<T>> blocks;
  LayerNorm<T> ln_f;
  Linear<T> head;

 private:
  void embed(std::span<const int32_t> ids, int64_t batch, int64_t seq);

  TransformerConfig config_;
  // Activations of the last forward: residual stream before each block and after the
  // last ([rows, E] each, L + 1 of them), the blocks' saved state, the final norm.
  int64_t batch_ = 0, seq_ = 0;
  std::vector<int32_t> ids_;
  std::vector<Tensor<T, 2>> stream_;
  std::vector<TransformerBlockSaved<T>> saved_;
  Tensor<T, 2> final_norm_;
  LayerNormSaved<T> ln_f_saved_;
  Tensor<T, 2> logits_, dlogits_;
  Tensor<T, 2> d_stream_, d_scratch_;
  // forward_step's own buffers (so a step never disturbs a pending backward): the
  // residual stream before and after a block, one scratch reused by every block.
  Tensor<T, 2> step_x_, step_y_, step_norm_, step_logits_;
  TransformerBlockSaved<T> step_scratch_;
  LayerNormSaved<T> step_ln_f_;
};

}  // namespace qkv::nn
