// MultiHeadAttention: projections (Linear, BLAS) around qkv::attention_forward/backward.
// A [rows, H·d] projection is directly the [B, N, H, d] view the core takes, so there is
// no transpose or copy anywhere between the GEMMs and the attention kernels.
#include "qkv/nn/multihead_attention.hpp"

#include <algorithm>
#include <cmath>
#include <utility>
#include <string>

#include "check.hpp"
#include "qkv/attention.hpp"

namespace qkv::nn {
namespace {

std::string str(int64_t value) { return std::to_string(value); }

// [B·N, H·d] rows as the attention core's [B, N, H, d] view.
template <class T>
View4<T> heads_view(Tensor<T, 2>& t, int64_t batch, int64_t seq, int64_t heads, int64_t dim) {
  return View4<T>::contiguous(t.data(), {batch, seq, heads, dim});
}
template <class T>
View4<const T> heads_view(const Tensor<T, 2>& t, int64_t batch, int64_t seq, int64_t heads,
                          int64_t dim) {
  return View4<const T>::contiguous(t.data(), {batch, seq, heads, dim});
}

template <class T>
void check_3d(const std::string& fn, const char* name, const TensorView<T, 3>& view,
              int64_t batch, int64_t seq, int64_t features) {
  const detail::LayerChecker check(fn);
  const qkv::detail::Described d = qkv::detail::describe(name, view);
  const int64_t expected[3] = {batch, seq, features};
  const char* axis[3] = {"batch", "seq", "features"};
  for (int a = 0; a < 3; ++a)
    if (expected[a] >= 0) check->expect_extent(d, a, axis[a], expected[a]);
  check->expect_data(d);
}

}  // namespace

template <class T>
MultiHeadAttention<T>::MultiHeadAttention(const MultiHeadAttentionConfig& config)
    : config_(config) {
  const std::string fn = "MultiHeadAttention";
  auto& c = config_;
  detail::expect(c.embed_dim >= 1, fn, "config.embed_dim: expected ≥ 1, got " + str(c.embed_dim));
  detail::expect(c.num_heads >= 1, fn, "config.num_heads: expected ≥ 1, got " + str(c.num_heads));
  detail::expect(c.embed_dim % c.num_heads == 0, fn,
                 "config.embed_dim: expected a multiple of num_heads (" + str(c.num_heads) +
                     "), got " + str(c.embed_dim));
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
  detail::expect(c.num_kv_heads >= 1 && c.num_heads % c.num_kv_heads == 0, fn,
                 "config.num_kv_heads: expected a divisor of num_heads (" + str(c.num_heads) +
                     "), got " + str(c.num_kv_heads));
  if (c.key_dim == 0) c.key_dim = c.embed_dim;
  if (c.value_dim == 0) c.value_dim = c.embed_dim;
  detail::expect(c.key_dim >= 1, fn, "config.key_dim: expected ≥ 1, got " + str(c.key_dim));
  detail::expect(c.value_dim >= 1, fn, "config.value_dim: expected ≥ 1, got " + str(c.value_dim));

  const int64_t kv_features = c.num_kv_heads * head_dim();
  q_proj = Linear<T>(c.embed_dim, c.embed_dim, c.bias);
  k_proj = Linear<T>(c.key_dim, kv_features, c.bias);
  v_proj = Linear<T>(c.value_dim, kv_features, c.bias);
  out_proj = Linear<T>(c.embed_dim, c.embed_dim, c.bias);
}

template <class T>
void MultiHeadAttention<T>::reset_parameters(Rng& rng) {
  for (Linear<T>* projection : {&q_proj, &k_proj, &v_proj}) {
    const double fan_in = static_cast<double>(projection->in_features());
    const double fan_out = static_cast<double>(projection->out_features());
    const double bound = std::sqrt(6.0 / (fan_in + fan_out));
    fill_uniform(projection->weight.values(), -bound, bound, rng);
    if (projection->has_bias()) std::ranges::fill(projection->bias.values(), T(0));
  }
  const double bound = 1.0 / std::sqrt(static_cast<double>(config_.embed_dim));
  fill_uniform(out_proj.weight.values(), -bound, bound, rng);
  if (out_proj.has_bias()) std::ranges::fill(out_proj.bias.values(), T(0));
}

template <class T>
AttentionOptions MultiHeadAttention<T>::attention_options(const AttentionMasking& masking) const {
  AttentionOptions options;
  options.scale = config_.scale;
  options.causal = config_.causal;
  options.mask = masking.mask;
  options.key_lengths = masking.key_lengths;
  options.execution = config_.execution;
  return options;
}

template <class T>
void MultiHeadAttention<T>::forward(TensorView<const T, 3> query, TensorView<const T, 3> key,
                                    TensorView<const T, 3> value, TensorView<T, 3> out,
                                    Saved& saved, const AttentionMasking& masking,
                                    View4<T> weights) const {
  const std::string fn = "MultiHeadAttention::forward";
  const auto& c = config_;
  const int64_t batch = query.shape[0], q_len = query.shape[1], k_len = key.shape[1];
  const int64_t d = head_dim(), hd = c.num_heads * d, kv_hd = c.num_kv_heads * d;
  check_3d(fn, "query", query, -1, -1, c.embed_dim);
  check_3d(fn, "key", key, batch, -1, c.key_dim);
  check_3d(fn, "value", value, batch, k_len, c.value_dim);
  check_3d(fn, "out", out, batch, q_len, c.embed_dim);

  saved.batch = batch;
  saved.q_len = q_len;
  saved.k_len = k_len;
  saved.masking = masking;
  detail::ensure_shape(saved.q, {batch * q_len, hd});
  detail::ensure_shape(saved.k, {batch * k_len, kv_hd});
  detail::ensure_shape(saved.v, {batch * k_len, kv_hd});
  detail::ensure_shape(saved.context, {batch * q_len, hd});
  detail::ensure_shape(saved.lse, {batch, c.num_heads, q_len});

  // Q = query·W_Qᵀ + b_Q, K = key·W_Kᵀ + b_K, V = value·W_Vᵀ + b_V.
  q_proj.forward(detail::flatten_rows(fn, "query", query), saved.q.view());
  k_proj.forward(detail::flatten_rows(fn, "key", key), saved.k.view());
  v_proj.forward(detail::flatten_rows(fn, "value", value), saved.v.view());

  // C = softmax(Q·Kᵀ/√d + mask)·V, head by head, keeping lse for the backward.
  AttentionOptions options = attention_options(masking);
  if (!weights.empty()) options.execution.backend = Backend::reference;
  attention_forward(ForwardArgs<T>{.q = heads_view(std::as_const(saved.q), batch, q_len,
                                                   c.num_heads, d),
                                   .k = heads_view(std::as_const(saved.k), batch, k_len,
                                                   c.num_kv_heads, d),
                                   .v = heads_view(std::as_const(saved.v), batch, k_len,
                                                   c.num_kv_heads, d),
                                   .out = heads_view(saved.context, batch, q_len, c.num_heads, d),
                                   .lse = saved.lse.view(),
                                   .weights = weights,
                                   .stats = stats},
                    options);

  // out = C·W_Oᵀ + b_O.
  out_proj.forward(saved.context.view(), detail::flatten_rows(fn, "out", out));
}

template <class T>
void MultiHeadAttention<T>::backward(TensorView<const T, 3> query, TensorView<const T, 3> key,
                                     TensorView<const T, 3> value, Saved& saved,
                                     TensorView<const T, 3> dout,
                                     const AttentionInputGrads<T>& grads) {
  const std::string fn = "MultiHeadAttention::backward";
  const auto& c = config_;
  const int64_t batch = saved.batch, q_len = saved.q_len, k_len = saved.k_len;
  const int64_t d = head_dim(), hd = c.num_heads * d, kv_hd = c.num_kv_heads * d;
  detail::expect(saved.q.size() == static_cast<std::size_t>(batch * q_len * hd) && hd > 0 &&
                     saved.lse.size() == static_cast<std::size_t>(batch * c.num_heads * q_len),
                 fn, "saved: not filled by a forward of this layer");
  check_3d(fn, "query", query, batch, q_len, c.embed_dim);
  check_3d(fn, "key", key, batch, k_len, c.key_dim);
  check_3d(fn, "value", value, batch, k_len, c.value_dim);
  check_3d(fn, "dout", dout, batch, q_len, c.embed_dim);
  if (!grads.query.empty()) check_3d(fn, "grads.query", grads.query, batch, q_len, c.embed_dim);
  if (!grads.key.empty()) check_3d(fn, "grads.key", grads.key, batch, k_len, c.key_dim);
  if (!grads.value.empty()) check_3d(fn, "grads.value", grads.value, batch, k_len, c.value_dim);

  detail::ensure_shape(saved.d_context, {batch * q_len, hd});
  detail::ensure_shape(saved.dq, {batch * q_len, hd});
  detail::ensure_shape(saved.dk, {batch * k_len, kv_hd});
  detail::ensure_shape(saved.dv, {batch * k_len, kv_hd});

  // In the forward out = C·W_Oᵀ + b_O, so now dC = dout·W_O (and dW_O, db_O).
  out_proj.backward(saved.context.view(), detail::flatten_rows(fn, "dout", dout),
                    saved.d_context.view());

  // The attention core: dQ, dK, dV from dC, recomputing P from lse.
  attention_backward(
      BackwardArgs<T>{
          .q = heads_view(std::as_const(saved.q), batch, q_len, c.num_heads, d),
          .k = heads_view(std::as_const(saved.k), batch, k_len, c.num_kv_heads, d),
          .v = heads_view(std::as_const(saved.v), batch, k_len, c.num_kv_heads, d),
          .out = heads_view(std::as_const(saved.context), batch, q_len, c.num_heads, d),
          .lse = saved.lse.cview(),
          .dout = heads_view(std::as_const(saved.d_context), batch, q_len, c.num_heads, d),
          .dq = heads_view(saved.dq, batch, q_len, c.num_heads, d),
          .dk = heads_view(saved.dk, batch, k_len, c.num_kv_heads, d),
          .dv = heads_view(saved.dv, batch, k_len, c.num_kv_heads, d)},
      attention_options(saved.masking));

  // In the forward Q = query·W_Qᵀ + b_Q (likewise K, V), so now d query = dQ·W_Q, ...
  // When two inputs are one tensor (self-attention) their gradients land in one buffer:
  // the first write sets it, the next ones add.
  const T* written[3] = {nullptr, nullptr, nullptr};
  int count = 0;
  auto input_grad = [&](Linear<T>& projection, TensorView<const T, 3> input,
                        const Tensor<T, 2>& d_projection, TensorView<T, 3> d_input,
                        const char* name) {
    Matrix<T> dx;
    bool accumulate = false;
    if (!d_input.empty()) {
      dx = detail::flatten_rows(fn, name, d_input);
      for (int i = 0; i < count; ++i) accumulate = accumulate || written[i] == d_input.data;
      written[count++] = d_input.data;
    }
    projection.backward(detail::flatten_rows(fn, name, input), d_projection.view(), dx,
                        accumulate);
  };
  input_grad(q_proj, query, saved.dq, grads.query, "query");
  input_grad(k_proj, key, saved.dk, grads.key, "key");
  input_grad(v_proj, value, saved.dv, grads.value, "value");
}

template <class T>
void MultiHeadAttention<T>::forward(TensorView<const T, 3> x, TensorView<T, 3> out,
                                    Saved& saved, const AttentionMasking& masking,
                                    View4<T> weights) const {
  forward(x, x, x, out, saved, masking, weights);
}

template <class T>
void MultiHeadAttention<T>::backward(TensorView<const T, 3> x, Saved& saved,
                                     TensorView<const T, 3> dout, TensorView<T, 3> dx) {
  backward(x, x, x, saved, dout, AttentionInputGrads<T>{.query = dx, .key = dx, .value = dx});
}

template <class T>
void MultiHeadAttention<T>::check_cache(const KVCache& cache, int64_t batch,
                                        int64_t new_tokens) const {
  const std::string fn = "MultiHeadAttention::check_cache";
  const KVCacheConfig& cc = cache.config();
  auto expect_equal = [&](const char* field, int64_t expected, int64_t got, const char* why) {
    detail::expect(got == expected, fn,
                   std::string("cache.config().") + field + ": expected " + str(expected) + " (" +
                       why + "), got " + str(got));
  };
  expect_equal("batch", batch, cc.batch, "the batch of the new tokens");
  expect_equal("kv_heads", config_.num_kv_heads, cc.kv_heads, "the layer's num_kv_heads");
  expect_equal("head_dim", head_dim(), cc.head_dim, "the layer's embed_dim / num_heads");
  expect_equal("v_dim", head_dim(), cc.v_dim, "the layer's embed_dim / num_heads");
  detail::expect(new_tokens >= 1, fn, "new_tokens: expected ≥ 1, got " + str(new_tokens));
  // KVCache::append checks these too, but a model appends to one cache per layer: checking
  // them here first lets a caller reject a step before any layer's cache has changed.
  int64_t blocks_needed = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = cache.lengths()[static_cast<std::size_t>(b)];
    detail::expect(length + new_tokens <= cc.capacity, fn,
                   "cache: sequence " + str(b) + " holds " + str(length) + " of " +
                       str(cc.capacity) + " keys (capacity); " + str(new_tokens) +
                       " more do not fit");
    if (cc.paged) {
      const int64_t bs = cc.block_size;
      blocks_needed += (length + new_tokens + bs - 1) / bs - (length + bs - 1) / bs;
    }
  }
  detail::expect(!cc.paged || blocks_needed <= cache.free_blocks(), fn,
                 "cache: the pool has " + str(cache.free_blocks()) + " free blocks, " +
                     str(blocks_needed) + " are needed for " + str(new_tokens) +
                     " more tokens per sequence (config.num_blocks)");
}

template <class T>
void MultiHeadAttention<T>::forward_cached(TensorView<const T, 3> x, TensorView<T, 3> out,
                                           KVCache& cache, Saved& scratch) const
  requires std::same_as<T, float>
{
  const std::string fn = "MultiHeadAttention::forward_cached";
  const auto& c = config_;
  const int64_t batch = x.shape[0], tokens = x.shape[1];
  const int64_t d = head_dim(), hd = c.num_heads * d, kv_hd = c.num_kv_heads * d;
  detail::expect(c.key_dim == c.embed_dim && c.value_dim == c.embed_dim, fn,
                 "self-attention only: config.key_dim and value_dim must equal embed_dim");
  check_3d(fn, "x", x, -1, -1, c.embed_dim);
  check_3d(fn, "out", out, batch, tokens, c.embed_dim);
  const Matrix<const T> x_rows = detail::flatten_rows(fn, "x", x);
  const Matrix<T> out_rows = detail::flatten_rows(fn, "out", out);
  check_cache(cache, batch, tokens);

  detail::ensure_shape(scratch.q, {batch * tokens, hd});
  detail::ensure_shape(scratch.k, {batch * tokens, kv_hd});
  detail::ensure_shape(scratch.v, {batch * tokens, kv_hd});
  detail::ensure_shape(scratch.context, {batch * tokens, hd});
  scratch.batch = scratch.q_len = scratch.k_len = 0;  // nothing here for a backward

  // Q, K, V of the new tokens only; K and V join the cache (checked above: cannot throw).
  q_proj.forward(x_rows, scratch.q.view());
  k_proj.forward(x_rows, scratch.k.view());
  v_proj.forward(x_rows, scratch.v.view());
  cache.append(heads_view(std::as_const(scratch.k), batch, tokens, c.num_kv_heads, d),
               heads_view(std::as_const(scratch.v), batch, tokens, c.num_kv_heads, d));

  // C = softmax(Q·K_cacheᵀ·scale)·V_cache, the new queries aligned with the newest keys.
  AttentionOptions options;
  options.scale = c.scale;
  options.causal = c.causal == Causal::none ? Causal::none : Causal::bottom_right;
  options.execution.threads = c.execution.threads;
  cache.attend(heads_view(std::as_const(scratch.q), batch, tokens, c.num_heads, d),
               heads_view(scratch.context, batch, tokens, c.num_heads, d), {}, options);

  // out = C·W_Oᵀ + b_O.
  out_proj.forward(scratch.context.view(), out_rows);
}

template <class T>
void MultiHeadAttention<T>::collect(ParameterList<T>& list, const std::string& prefix) {
  q_proj.collect(list, prefix + ".q_proj");
  k_proj.collect(list, prefix + ".k_proj");
  v_proj.collect(list, prefix + ".v_proj");
  out_proj.collect(list, prefix + ".out_proj");
}

template class MultiHeadAttention<float>;
template class MultiHeadAttention<double>;

}  // namespace qkv::nn
