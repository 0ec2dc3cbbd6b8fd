// Fixed-seed inputs and output buffers for the bench tools that must give the same bytes
// on every build of one machine (qkv_bitwise_digest, qkv_mask_probe): integer arithmetic
// (splitmix64) and exact float sums, not std::normal_distribution, whose algorithm the
// standard leaves open.
#pragma once

#include <qkv/qkv.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace qkv_bench {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {  // splitmix64
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) * 0x1.0p-24f; }  // [0, 1)
  // Irwin–Hall of four uniforms, centred, unit variance: bell-shaped like the benchmarks'
  // randn, with tails to ±3.5.
  float normal() { return (uniform() + uniform() + uniform() + uniform() - 2.0f) * 1.7320508f; }
  std::int64_t below(std::int64_t n) { return static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(n)); }

 private:
  std::uint64_t state_;
};

template <class T>
T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return T(x);
  }
}

// A tensor of normal values × scale (rounded once to T).
template <class T, int R>
qkv::Tensor<T, R> random_tensor(const std::array<std::int64_t, R>& shape, std::uint64_t seed,
                                float scale = 1.0f) {
  qkv::Tensor<T, R> t(shape);
  Rng rng(seed);
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = from_float<T>(scale * rng.normal());
  return t;
}

// An output buffer filled with 777, a value no result takes: an element that a call
// leaves unwritten (or writes where it did not before) changes the hash.
template <class T, int R>
qkv::Tensor<T, R> output_tensor(const std::array<std::int64_t, R>& shape) {
  qkv::Tensor<T, R> t(shape);
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = from_float<T>(777.0f);
  return t;
}

inline std::vector<float> output_vector(std::size_t n) { return std::vector<float>(n, 777.0f); }

// The logical [batch, seq, heads, dim] view of a buffer stored as `physical`:
// [B, H, N, d] (PyTorch's layout, what the Python benchmarks pass) when bhsd, else
// [B, N, H, d].
template <class T, class U>
qkv::View4<T> logical_view(U* data, const std::array<std::int64_t, 4>& physical, bool bhsd) {
  if (bhsd) return qkv::View4<T>::from_bhsd(data, physical[0], physical[1], physical[2], physical[3]);
  return qkv::View4<T>::contiguous(data, physical);
}

// bench_masks.py's masks for a batch whose entry e has lengths[e] valid keys (the
// benchmark: entry 0 full, the others half padding), and the options of each kind.
struct PaddingMasks {
  static constexpr const char* kKinds[] = {"none",       "bool_B11N",  "bool_B1NN",   "float_B1NN",
                                           "causal+pad", "float_bias", "key_lengths", "key_lengths+causal"};

  PaddingMasks(std::int64_t batch, std::int64_t n, std::vector<std::int64_t> lengths_, std::uint64_t seed)
      : lengths(std::move(lengths_)),
        keys({batch, 1, 1, n}),
        dense({batch, 1, n, n}),
        causal_pad({batch, 1, n, n}),
        padding({batch, 1, n, n}),
        bias(random_tensor<float, 4>({batch, 1, n, n}, seed, 0.5f)) {
    for (std::int64_t e = 0; e < batch; ++e)
      for (std::int64_t j = 0; j < n; ++j) {
        const bool valid = j < lengths[static_cast<std::size_t>(e)];
        keys(e, 0, 0, j) = valid ? 1 : 0;
        for (std::int64_t i = 0; i < n; ++i) {
          dense(e, 0, i, j) = valid ? 1 : 0;
          causal_pad(e, 0, i, j) = valid && j <= i ? 1 : 0;
          padding(e, 0, i, j) = valid ? 0.0f : -3.4028234663852886e38f;  // torch.finfo(float32).min
        }
      }
  }

  // none: no mask; bool_B11N / bool_B1NN: key padding as bool [B,1,1,N] / [B,1,N,N];
  // float_B1NN: as float [B,1,N,N] with finfo.min at padding; causal+pad: causality and
  // padding in one bool [B,1,N,N]; float_bias: a dense float bias with no -inf;
  // key_lengths (+causal): the same keys cut by key_lengths instead of a mask.
  qkv::AttentionOptions options(std::string_view kind) const {
    qkv::AttentionOptions o;
    if (kind == "bool_B11N") o.mask.keep = keys.cview();
    else if (kind == "bool_B1NN") o.mask.keep = dense.cview();
    else if (kind == "float_B1NN") o.mask.bias = padding.cview();
    else if (kind == "causal+pad") o.mask.keep = causal_pad.cview();
    else if (kind == "float_bias") o.mask.bias = bias.cview();
    else if (kind == "key_lengths" || kind == "key_lengths+causal") o.key_lengths = lengths;
    else if (kind != "none") throw std::invalid_argument("unknown mask kind " + std::string(kind));
    if (kind == "key_lengths+causal") o.causal = qkv::Causal::top_left;
    return o;
  }

  std::vector<std::int64_t> lengths;
  qkv::Tensor<std::uint8_t, 4> keys, dense, causal_pad;
  qkv::Tensor<float, 4> padding, bias;
};

}  // namespace qkv_bench
