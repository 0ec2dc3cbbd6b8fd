// Writes MultiHeadAttention cases for compare_mha.py: for each, one safetensors file
// with the configuration (metadata), weights, inputs, masks, the upstream gradient, and
// qkv::nn's outputs and gradients. Usage: qkv_nn_torch_case <directory>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/nn/multihead_attention.hpp"
#include "qkv/nn/safetensors.hpp"

namespace {

using namespace qkv;
using namespace qkv::nn;

struct Case {
  std::string name;
  MultiHeadAttentionConfig config;
  int64_t batch, q_len, k_len;
  bool self;
  std::string mask;  // "none", "causal", "keep" (random boolean), "padding" (key lengths)
  bool single;       // float32 (the fast path) instead of float64
};

template <class T>
void add(SafetensorsFile& file, const std::string& name, std::vector<int64_t> shape, const T* data,
         std::size_t count) {
  file.tensors.push_back(SafetensorsTensor::from<T>(name, std::move(shape), std::span<const T>(data, count)));
}

template <class T, int R>
void add(SafetensorsFile& file, const std::string& name, const Tensor<T, R>& t) {
  add<T>(file, name, std::vector<int64_t>(t.shape().begin(), t.shape().end()), t.data(), t.size());
}

template <class T>
void write_case(const Case& c, const std::filesystem::path& directory) {
  Rng rng(2024);
  MultiHeadAttention<T> mha(c.config);
  mha.reset_parameters(rng);
  for (Linear<T>* p : {&mha.q_proj, &mha.k_proj, &mha.v_proj, &mha.out_proj}) {
    if (p->has_bias()) fill_normal(p->bias.values(), 0.0, 0.3, rng);
  }
  const auto& cfg = mha.config();
  const int64_t B = c.batch, Nq = c.q_len, Nk = c.self ? c.q_len : c.k_len;
  Tensor<T, 3> query({B, Nq, cfg.embed_dim}), key({B, Nk, cfg.key_dim}), value({B, Nk, cfg.value_dim});
  Tensor<T, 3> out({B, Nq, cfg.embed_dim}), dout({B, Nq, cfg.embed_dim});
  for (auto* t : {&query, &key, &value, &dout}) fill_normal({t->data(), t->size()}, 0.0, 1.0, rng);

  Tensor<std::uint8_t, 4> keep({1, 1, Nq, Nk});
  std::vector<int64_t> lengths;
  AttentionMasking masking;
  if (c.mask == "keep") {
    for (std::size_t i = 0; i < keep.size(); ++i) keep[i] = rng.uniform() < 0.6 ? 1 : 0;
    for (int64_t i = 0; i < Nq; ++i) keep(0, 0, i, i % Nk) = 1;  // every row keeps a key
    masking.mask.keep = keep.cview();
  } else if (c.mask == "padding") {
    for (int64_t b = 0; b < B; ++b) lengths.push_back(Nk - 1 - b);
    masking.key_lengths = lengths;
  }

  const Tensor<T, 3>& k_in = c.self ? query : key;
  const Tensor<T, 3>& v_in = c.self ? query : value;
  MultiHeadAttentionSaved<T> saved;
  mha.forward(query.cview(), k_in.cview(), v_in.cview(), out.view(), saved, masking);
  ParameterList<T> list;
  mha.collect(list, "");
  zero_grad(list);

  SafetensorsFile file;
  auto& meta = file.metadata;
  meta["embed_dim"] = std::to_string(cfg.embed_dim);
  meta["num_heads"] = std::to_string(cfg.num_heads);
  meta["num_kv_heads"] = std::to_string(cfg.num_kv_heads);
  meta["key_dim"] = std::to_string(cfg.key_dim);
  meta["value_dim"] = std::to_string(cfg.value_dim);
  meta["bias"] = std::to_string(cfg.bias ? 1 : 0);
  meta["causal"] = std::to_string(cfg.causal == Causal::top_left ? 1 : 0);
  meta["self"] = std::to_string(c.self ? 1 : 0);
  meta["mask"] = c.mask;
  meta["dtype"] = std::string("float") + std::to_string(c.single ? 32 : 64);
  add(file, "query", query);
  add(file, "out", out);
  add(file, "dout", dout);
  if (!c.self) {
    add(file, "key", key);
    add(file, "value", value);
  }
  if (c.mask == "keep") {
    std::vector<int64_t> keep64(keep.data(), keep.data() + keep.size());
    add<int64_t>(file, "keep", {Nq, Nk}, keep64.data(), keep64.size());
  }
  if (c.mask == "padding") add<int64_t>(file, "key_lengths", {B}, lengths.data(), lengths.size());

  if (c.self) {
    Tensor<T, 3> dx({B, Nq, cfg.embed_dim});
    mha.backward(query.cview(), saved, dout.cview(), dx.view());
    add(file, "grad.query", dx);
  } else {
    Tensor<T, 3> dq({B, Nq, cfg.embed_dim}), dk({B, Nk, cfg.key_dim}), dv({B, Nk, cfg.value_dim});
    mha.backward(query.cview(), key.cview(), value.cview(), saved, dout.cview(),
                 {.query = dq.view(), .key = dk.view(), .value = dv.view()});
    add(file, "grad.query", dq);
    add(file, "grad.key", dk);
    add(file, "grad.value", dv);
  }
  for (const auto& [name, p] : list) {
    const std::string n = name.substr(1);  // "q_proj.weight", ...
    std::string grad_name = "grad.";
    grad_name += n;
    add<T>(file, n, p->shape, p->value.data(), p->value.size());
    add<T>(file, grad_name, p->shape, p->grad.data(), p->grad.size());
  }
  std::string file_name = c.name;
  file_name += ".safetensors";
  write_safetensors(directory / file_name, file);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <directory>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path directory = argv[1];
  std::filesystem::create_directories(directory);
  const std::vector<Case> cases = {
      {"self_bias", {.embed_dim = 16, .num_heads = 4}, 2, 7, 7, true, "none", false},
      {"self_causal", {.embed_dim = 12, .num_heads = 3, .causal = Causal::top_left}, 2, 9, 9, true,
       "causal", false},
      {"cross_kdim_vdim_padding", {.embed_dim = 16, .num_heads = 2, .key_dim = 10, .value_dim = 6, .bias = false},
       3, 5, 8, false, "padding", false},
      {"cross_bool_mask", {.embed_dim = 8, .num_heads = 2}, 2, 6, 4, false, "keep", false},
      {"gqa_causal", {.embed_dim = 16, .num_heads = 4, .num_kv_heads = 2, .causal = Causal::top_left},
       2, 8, 8, true, "causal", false},
      {"mqa_cross", {.embed_dim = 12, .num_heads = 3, .num_kv_heads = 1, .key_dim = 5, .value_dim = 7},
       2, 4, 6, false, "none", false},
      {"self_causal_fp32", {.embed_dim = 64, .num_heads = 4, .causal = Causal::top_left}, 2, 48, 48,
       true, "causal", true},
      {"gqa_fp32", {.embed_dim = 64, .num_heads = 8, .num_kv_heads = 2}, 2, 40, 40, true, "none", true},
  };
  try {
    for (const Case& c : cases) {
      if (c.single) {
        write_case<float>(c, directory);
      } else {
        write_case<double>(c, directory);
      }
    }
  } catch (const qkv::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
