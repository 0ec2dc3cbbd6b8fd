// The decoder-only transformer: embeddings, blocks, final norm, LM head.
#include "qkv/nn/transformer.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "check.hpp"
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
