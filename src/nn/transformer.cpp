// The decoder-only transformer: embeddings, blocks, final norm, LM head.
#include "qkv/nn/transformer.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "check.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/cross_entropy.hpp"

namespace qkv::nn {
namespace {

std::string str(int64_t value) { return std::to_string(value); }

TransformerConfig validated(TransformerConfig c) {
  const std::string fn = "Transformer";
  detail::expect(c.vocab_size >= 1, fn, "config.vocab_size: expected ≥ 1, got " + str(c.vocab_size));
  detail::expect(c.context >= 1, fn, "config.context: expected ≥ 1, got " + str(c.context));
  detail::expect(c.embed_dim >= 1, fn, "config.embed_dim: expected ≥ 1, got " + str(c.embed_dim));
  detail::expect(c.num_heads >= 1, fn, "config.num_heads: expected ≥ 1, got " + str(c.num_heads));
  detail::expect(c.embed_dim % c.num_heads == 0, fn,
                 "config.embed_dim: expected a multiple of num_heads (" + str(c.num_heads) +
                     "), got " + str(c.embed_dim));
  detail::expect(c.num_layers >= 1, fn, "config.num_layers: expected ≥ 1, got " + str(c.num_layers));
  detail::expect(c.mlp_dim >= 0, fn, "config.mlp_dim: expected ≥ 0, got " + str(c.mlp_dim));
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
  if (c.mlp_dim == 0) c.mlp_dim = 4 * c.embed_dim;
  return c;
}

template <class T>
TensorView<T, 3> as_3d(Tensor<T, 2>& t, int64_t batch, int64_t seq) {
  return TensorView<T, 3>::contiguous(t.data(), {batch, seq, t.shape()[1]});
}
template <class T>
TensorView<const T, 3> as_3d(const Tensor<T, 2>& t, int64_t batch, int64_t seq) {
  return TensorView<const T, 3>::contiguous(t.data(), {batch, seq, t.shape()[1]});
}

}  // namespace

template <class T>
Transformer<T>::Transformer(const TransformerConfig& config) : config_(validated(config)) {
  tok = Embedding<T>(config_.vocab_size, config_.embed_dim);
  pos = PositionEmbedding<T>(config_.context, config_.embed_dim);
  for (int64_t l = 0; l < config_.num_layers; ++l) blocks.emplace_back(config_);
  ln_f = LayerNorm<T>(config_.embed_dim);
  head = Linear<T>(config_.embed_dim, config_.vocab_size, /*bias=*/false);
  saved_.resize(blocks.size());
}

template <class T>
void Transformer<T>::reset_parameters(Rng& rng) {
  constexpr double kStd = 0.02;  // GPT-2's
  const double residual_std = kStd / std::sqrt(2.0 * static_cast<double>(config_.num_layers));
  auto init_linear = [&](Linear<T>& linear, double stddev) {
    fill_normal(linear.weight.values(), 0.0, stddev, rng);
    if (linear.has_bias()) std::ranges::fill(linear.bias.values(), T(0));
  };
  fill_normal(tok.weight.values(), 0.0, kStd, rng);
  fill_normal(pos.weight.values(), 0.0, kStd, rng);
  for (auto& block : blocks) {
    block.ln1.reset_parameters();
    init_linear(block.attn.q_proj, kStd);
    init_linear(block.attn.k_proj, kStd);
    init_linear(block.attn.v_proj, kStd);
    init_linear(block.attn.out_proj, residual_std);
    block.ln2.reset_parameters();
    init_linear(block.mlp.fc1, kStd);
    init_linear(block.mlp.fc2, residual_std);
  }
  ln_f.reset_parameters();
  init_linear(head, kStd);
}

template <class T>
ParameterList<T> Transformer<T>::parameters() {
  ParameterList<T> list;
  tok.collect(list, "tok");
  pos.collect(list, "pos");
  for (std::size_t l = 0; l < blocks.size(); ++l) blocks[l].collect(list, "blocks." + str(l));
  ln_f.collect(list, "ln_f");
  head.collect(list, "head");
  return list;
}

template <class T>
void Transformer<T>::embed(std::span<const int32_t> ids, int64_t batch, int64_t seq) {
  const std::string fn = "Transformer::forward";
  detail::expect(batch >= 1, fn, "batch: expected ≥ 1, got " + str(batch));
  detail::expect(seq >= 1 && seq <= config_.context, fn,
                 "seq: expected in [1, " + str(config_.context) + "] (context), got " + str(seq));
  detail::expect(static_cast<int64_t>(ids.size()) == batch * seq, fn,
                 "ids.size(): expected " + str(batch * seq) + " (batch·seq), got " +
                     str(static_cast<int64_t>(ids.size())));
  batch_ = batch;
  seq_ = seq;
  ids_.assign(ids.begin(), ids.end());
  const int64_t rows = batch * seq;
  stream_.resize(blocks.size() + 1);
  for (auto& t : stream_) detail::ensure_shape(t, {rows, config_.embed_dim});
  // x₀ = tok[ids] + pos[0:N]
  tok.forward(ids, stream_[0].view());
  pos.forward(as_3d(stream_[0], batch, seq));
}

template <class T>
Matrix<const T> Transformer<T>::forward(std::span<const int32_t> ids, int64_t batch,
                                        int64_t seq) {
  embed(ids, batch, seq);
  for (std::size_t l = 0; l < blocks.size(); ++l) {
    blocks[l].forward(as_3d(std::as_const(stream_[l]), batch, seq),
                      as_3d(stream_[l + 1], batch, seq), saved_[l]);
  }
  const int64_t rows = batch * seq;
  detail::ensure_shape(final_norm_, {rows, config_.embed_dim});
  detail::ensure_shape(logits_, {rows, config_.vocab_size});
  ln_f.forward(stream_.back().view(), final_norm_.view(), ln_f_saved_);
  head.forward(final_norm_.view(), logits_.view());
  return logits_.view();
}

template <class T>
double Transformer<T>::forward_loss(std::span<const int32_t> ids,
                                    std::span<const int32_t> targets, int64_t batch,
                                    int64_t seq) {
  forward(ids, batch, seq);
  detail::ensure_shape(dlogits_, logits_.shape());
  return softmax_cross_entropy(logits_.cview(), targets, dlogits_.view());
}

template <class T>
void Transformer<T>::backward() {
  detail::expect(dlogits_.size() == logits_.size() && logits_.size() > 0,
                 "Transformer::backward", "no forward_loss to backpropagate");
  backward(dlogits_.cview());
}

template <class T>
void Transformer<T>::backward(Matrix<const T> dlogits) {
  const std::string fn = "Transformer::backward";
  const int64_t rows = batch_ * seq_;
  detail::expect(rows > 0 && logits_.shape()[0] == rows, fn, "no forward to backpropagate");
  detail::check_matrix(fn, "dlogits", dlogits, rows, config_.vocab_size);
  detail::ensure_shape(d_stream_, {rows, config_.embed_dim});
  detail::ensure_shape(d_scratch_, {rows, config_.embed_dim});
  // In the forward logits = LN_f(x_L)·W_headᵀ, so now d x_L = LN_fᵀ(dlogits·W_head).
  head.backward(final_norm_.view(), dlogits, d_scratch_.view());
  ln_f.backward(stream_.back().view(), ln_f_saved_, d_scratch_.view(), d_stream_.view());
  for (std::size_t l = blocks.size(); l-- > 0;) {
    blocks[l].backward(as_3d(std::as_const(stream_[l]), batch_, seq_), saved_[l],
                       as_3d(d_stream_, batch_, seq_), d_scratch_);
  }
  // x₀ = tok[ids] + pos[0:N].
  pos.backward(as_3d(std::as_const(d_stream_), batch_, seq_));
  tok.backward(ids_, d_stream_.view());
}

template <class T>
std::vector<KVCache> Transformer<T>::make_caches(const TransformerCacheConfig& cache_config) const
  requires std::same_as<T, float>
{
  const std::string fn = "Transformer::make_caches";
  const int64_t capacity = cache_config.capacity == 0 ? config_.context : cache_config.capacity;
  detail::expect(capacity >= 1 && capacity <= config_.context, fn,
                 "cache_config.capacity: expected in [1, " + str(config_.context) +
                     "] (context: later positions have no embedding) or 0, got " +
                     str(cache_config.capacity));
  const KVCacheConfig per_layer{.batch = cache_config.batch,
                                .capacity = capacity,
                                .kv_heads = config_.num_kv_heads,
                                .head_dim = config_.embed_dim / config_.num_heads,
                                .v_dim = 0,
                                .dtype = cache_config.dtype,
                                .paged = cache_config.paged,
                                .block_size = cache_config.block_size,
                                .num_blocks = cache_config.num_blocks};
  std::vector<KVCache> caches;
  caches.reserve(blocks.size());
  for (std::size_t l = 0; l < blocks.size(); ++l) caches.emplace_back(per_layer);
  return caches;
}

template <class T>
Matrix<const T> Transformer<T>::forward_step(std::span<const int32_t> ids, int64_t batch,
                                             int64_t new_tokens, std::span<KVCache> caches)
  requires std::same_as<T, float>
{
  const std::string fn = "Transformer::forward_step";
  detail::expect(batch >= 1, fn, "batch: expected ≥ 1, got " + str(batch));
  detail::expect(new_tokens >= 1, fn, "new_tokens: expected ≥ 1, got " + str(new_tokens));
  detail::expect(static_cast<int64_t>(ids.size()) == batch * new_tokens, fn,
                 "ids.size(): expected " + str(batch * new_tokens) + " (batch·new_tokens), got " +
                     str(static_cast<int64_t>(ids.size())));
  detail::expect(static_cast<int64_t>(caches.size()) == config_.num_layers, fn,
                 "caches.size(): expected " + str(config_.num_layers) +
                     " (one per block: make_caches), got " + str(static_cast<int64_t>(caches.size())));
  // Every check before the first cache changes, so a failed step leaves them all as they
  // were: each block's cache must fit it and have room, and all must hold the same tokens.
  for (std::size_t l = 0; l < caches.size(); ++l) {
    try {
      blocks[l].attn.check_cache(caches[l], batch, new_tokens);
    } catch (const Error& e) {
      detail::fail(fn, "caches[" + str(static_cast<int64_t>(l)) + "]: " + e.what());
    }
    detail::expect(std::ranges::equal(caches[l].lengths(), caches[0].lengths()), fn,
                   "caches[" + str(static_cast<int64_t>(l)) +
                       "].lengths(): expected those of caches[0] (every block has seen the "
                       "same tokens)");
  }
  const std::span<const int64_t> start = caches[0].lengths();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t held = start[static_cast<std::size_t>(b)];
    detail::expect(held + new_tokens <= config_.context, fn,
                   "new_tokens: sequence " + str(b) + " holds " + str(held) + " tokens; " +
                       str(new_tokens) + " more pass context (" + str(config_.context) + ")");
  }
  for (std::size_t r = 0; r < ids.size(); ++r) {
    detail::expect(ids[r] >= 0 && ids[r] < config_.vocab_size, fn,
                   "ids[" + str(static_cast<int64_t>(r)) + "]: expected in [0, " +
                       str(config_.vocab_size) + "), got " + str(ids[r]));
  }

  // x₀ = tok[ids] + pos[start_b : start_b + T]
  const int64_t rows = batch * new_tokens;
  detail::ensure_shape(step_x_, {rows, config_.embed_dim});
  detail::ensure_shape(step_y_, {rows, config_.embed_dim});
  tok.forward(ids, step_x_.view());
  pos.forward(as_3d(step_x_, batch, new_tokens), start);
  // The blocks, each appending to and attending over its own cache.
  for (std::size_t l = 0; l < blocks.size(); ++l) {
    blocks[l].forward_step(as_3d(std::as_const(step_x_), batch, new_tokens),
                           as_3d(step_y_, batch, new_tokens), caches[l], step_scratch_);
    std::swap(step_x_, step_y_);
  }
  // logits = LN_f(x_L)·W_headᵀ
  detail::ensure_shape(step_norm_, {rows, config_.embed_dim});
  detail::ensure_shape(step_logits_, {rows, config_.vocab_size});
  ln_f.forward(step_x_.view(), step_norm_.view(), step_ln_f_);
  head.forward(step_norm_.view(), step_logits_.view());
  return step_logits_.view();
}

template <class T>
Tensor<T, 4> Transformer<T>::attention_weights(std::span<const int32_t> ids, int64_t layer) {
  detail::expect(layer >= 0 && layer < config_.num_layers, "Transformer::attention_weights",
                 "layer: expected in [0, " + str(config_.num_layers) + "), got " + str(layer));
  const int64_t seq = static_cast<int64_t>(ids.size());
  embed(ids, 1, seq);
  Tensor<T, 4> weights({1, config_.num_heads, seq, seq});
  for (int64_t l = 0; l <= layer; ++l) {
    blocks[l].forward(as_3d(std::as_const(stream_[l]), 1, seq), as_3d(stream_[l + 1], 1, seq),
                      saved_[l], l == layer ? weights.view() : View4<T>{});
  }
  batch_ = seq_ = 0;  // the kept activations are no longer a full forward's
  return weights;
}

template class Transformer<float>;
template class Transformer<double>;

}  // namespace qkv::nn
