// One pre-norm transformer block:  h = x + Attn(LN₁(x)),  y = h + MLP(LN₂(h)).
#include <algorithm>
#include <string>
#include <utility>

#include "check.hpp"
#include "parallel.hpp"
#include "qkv/nn/transformer.hpp"

namespace qkv::nn {
namespace {

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
TransformerBlock<T>::TransformerBlock(const TransformerConfig& config)
    : ln1(config.embed_dim),
      attn(MultiHeadAttentionConfig{.embed_dim = config.embed_dim,
                                    .num_heads = config.num_heads,
                                    .num_kv_heads = config.num_kv_heads,
                                    .bias = true,
                                    .causal = Causal::top_left,
                                    .execution = config.execution,
                                    .scale = config.attention_scale}),
      ln2(config.embed_dim),
      mlp(config.embed_dim, config.mlp_dim > 0 ? config.mlp_dim : 4 * config.embed_dim) {}

namespace {

// The block's residual structure, shared by the full forward and the cached step:
//   h = x + attend(LN₁(x)),  y = h + MLP(LN₂(h))
// `attend(in, out)` writes the attention branch for in = LN₁(x), both [B, N, E].
template <class T, class Attend>
void run_block(const TransformerBlock<T>& block, const std::string& fn,
               TensorView<const T, 3> x, TensorView<T, 3> y, TransformerBlockSaved<T>& saved,
               Attend&& attend) {
  const int64_t batch = x.shape[0], seq = x.shape[1], dim = x.shape[2];
  const Matrix<const T> x_rows = detail::flatten_rows(fn, "x", x);
  const Matrix<T> y_rows = detail::flatten_rows(fn, "y", y);
  const int64_t rows = x_rows.shape[0];
  for (Tensor<T, 2>* t : {&saved.ln1_out, &saved.attn_out, &saved.mid, &saved.ln2_out,
                          &saved.mlp_out}) {
    detail::ensure_shape(*t, {rows, dim});
  }
  // h = x + Attn(LN₁(x))
  block.ln1.forward(x_rows, saved.ln1_out.view(), saved.ln1);
  attend(as_3d(std::as_const(saved.ln1_out), batch, seq), as_3d(saved.attn_out, batch, seq));
  detail::parallel_blocks(rows, detail::kRowBlock, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < dim; ++c) saved.mid(r, c) = x_rows(r, c) + saved.attn_out(r, c);
    }
  });
  // y = h + MLP(LN₂(h))
  block.ln2.forward(saved.mid.view(), saved.ln2_out.view(), saved.ln2);
  block.mlp.forward(saved.ln2_out.view(), saved.mlp_out.view(), saved.mlp);
  detail::parallel_blocks(rows, detail::kRowBlock, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < dim; ++c) y_rows(r, c) = saved.mid(r, c) + saved.mlp_out(r, c);
    }
  });
}

}  // namespace

template <class T>
void TransformerBlock<T>::forward(TensorView<const T, 3> x, TensorView<T, 3> y, Saved& saved,
                                  View4<T> weights) const {
  run_block(*this, "TransformerBlock::forward", x, y, saved,
            [&](TensorView<const T, 3> in, TensorView<T, 3> out) {
              attn.forward(in, out, saved.attn, {}, weights);
            });
}

template <class T>
void TransformerBlock<T>::forward_step(TensorView<const T, 3> x, TensorView<T, 3> y,
                                       KVCache& cache, Saved& scratch) const
  requires std::same_as<T, float>
{
  // forward_cached checks x and the cache before the cache changes.
  run_block(*this, "TransformerBlock::forward_step", x, y, scratch,
            [&](TensorView<const T, 3> in, TensorView<T, 3> out) {
              attn.forward_cached(in, out, cache, scratch.attn);
            });
}

template <class T>
void TransformerBlock<T>::backward(TensorView<const T, 3> x, Saved& saved, TensorView<T, 3> d,
                                   Tensor<T, 2>& scratch) {
  const std::string fn = "TransformerBlock::backward";
  const int64_t batch = x.shape[0], seq = x.shape[1];
  const Matrix<const T> x_rows = detail::flatten_rows(fn, "x", x);
  const Matrix<T> d_rows = detail::flatten_rows(fn, "d", d);
  detail::ensure_shape(scratch, {x_rows.shape[0], x_rows.shape[1]});
  // In the forward y = h + MLP(LN₂(h)), so now dh = dy + LN₂ᵀ(MLPᵀ(dy)): the MLP branch's
  // gradient is added into d, which already holds the residual's dy.
  mlp.backward(saved.ln2_out.view(), saved.mlp, d_rows, scratch.view());
  ln2.backward(saved.mid.view(), saved.ln2, scratch.view(), d_rows, /*accumulate_dx=*/true);
  // h = x + Attn(LN₁(x)), so now dx = dh + LN₁ᵀ(Attnᵀ(dh)).
  attn.backward(as_3d(std::as_const(saved.ln1_out), batch, seq), saved.attn,
                TensorView<const T, 3>(d), as_3d(scratch, batch, seq));
  ln1.backward(x_rows, saved.ln1, scratch.view(), d_rows, /*accumulate_dx=*/true);
}

template <class T>
void TransformerBlock<T>::collect(ParameterList<T>& list, const std::string& prefix) {
  ln1.collect(list, prefix + ".ln1");
  attn.collect(list, prefix + ".attn");
  ln2.collect(list, prefix + ".ln2");
  mlp.collect(list, prefix + ".mlp");
}

template class TransformerBlock<float>;
template class TransformerBlock<double>;

}  // namespace qkv::nn
