// The decode and KV-cache cases of bench/bitwise_digest (see bitwise_digest.cpp):
// qkv::decode over caches the caller owns, in every storage type and layout of
// bench_decode.py and qkv_decode_probe, with its variants, and qkv::KVCache's append and
// attend (the stored rows hashed too: rounding and int8 quantization are results).
#include <algorithm>
#include <array>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "digest_support.hpp"

namespace digest {
namespace {

using qkv::Causal;

// head_major: PyTorch's [B, Hkv, N, d] buffer, bench_decode.py's "contiguous";
// token_major: [B, N, Hkv, d], qkv_decode_probe's PAGE 0 and KVCache's own layout;
// paged: a pool of blocks of 16 or 128 keys in shuffled order (vLLM's layout).
enum class Layout { head_major, token_major, paged16, paged128 };

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::head_major: return "head_major";
    case Layout::token_major: return "token_major";
    case Layout::paged16: return "paged16";
    case Layout::paged128: return "paged128";
  }
  return "?";
}

template <class T>
const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "f32";
  else if constexpr (std::is_same_v<T, qkv::bfloat16>) return "bf16";
  else if constexpr (std::is_same_v<T, qkv::float16>) return "f16";
  else return "i8";
}

struct Variant {
  Causal causal = Causal::bottom_right;
  qkv::Window window;
  float softcap = 0.0f;
  bool alibi = false, sinks = false;
  std::optional<double> scale;
};

// Every decode option the digest sets, set here only.
qkv::AttentionOptions decode_options(const Variant& v, std::span<const float> slopes,
                                     std::span<const float> sinks) {
  qkv::AttentionOptions options;
  options.causal = qkv::Causal::bottom_right;
  options.scale = v.scale;
  options.causal = v.causal;
  options.execution.threads = threads;
  options.window = v.window;
  options.softcap = v.softcap;
  if (v.alibi) options.alibi_slopes = slopes;
  if (v.sinks) options.sinks = sinks;
  return options;
}

template <class T>
T random_element(Rng& rng) {
  if constexpr (std::is_same_v<T, std::int8_t>) {
    return static_cast<std::int8_t>(rng.below(255) - 127);
  } else {
    return from_float<T>(rng.normal());
  }
}

// What no read may see: rows past a sequence's length hold NaN (int8: 127 with a NaN
// scale), so reading one changes the result instead of passing unnoticed.
template <class T>
T poison() {
  if constexpr (std::is_same_v<T, std::int8_t>) {
    return 127;
  } else {
    return from_float<T>(std::numeric_limits<float>::quiet_NaN());
  }
}

// A cache the caller owns: `lengths[b]` random rows per sequence, the rest poisoned.
template <class T>
struct OwnedCache {
  OwnedCache(std::int64_t kv_heads, std::int64_t d, const std::vector<std::int64_t>& lengths_,
             Layout layout, std::uint64_t seed)
      : lengths(lengths_) {
    const auto batch = static_cast<std::int64_t>(lengths.size());
    std::int64_t capacity = 1;
    for (std::int64_t n : lengths) capacity = std::max(capacity, n);
    const std::int64_t block = layout == Layout::paged16 ? 16 : layout == Layout::paged128 ? 128 : 0;
    std::array<std::int64_t, 4> physical{batch, capacity, kv_heads, d};
    if (layout == Layout::head_major) physical = {batch, kv_heads, capacity, d};
    if (block > 0) {
      const std::int64_t per_sequence = (capacity + block - 1) / block;
      physical = {batch * per_sequence + 1, block, kv_heads, d};  // one block spare
      table = qkv::Tensor<std::int32_t, 2>({batch, per_sequence});
      std::vector<std::int32_t> order(static_cast<std::size_t>(batch * per_sequence));
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int32_t>(i);
      Rng shuffle(seed + 7);
      for (std::size_t i = order.size(); i > 1; --i)
        std::swap(order[i - 1], order[static_cast<std::size_t>(shuffle.below(static_cast<std::int64_t>(i)))]);
      for (std::size_t i = 0; i < order.size(); ++i) table[i] = order[i];
    }
    k = qkv::Tensor<T, 4>(physical);
    v = qkv::Tensor<T, 4>(physical);
    const std::array<std::int64_t, 3> scale_shape{physical[0], physical[1], physical[2]};
    k_scale = qkv::Tensor<float, 3>(scale_shape);
    v_scale = qkv::Tensor<float, 3>(scale_shape);
    for (std::size_t i = 0; i < k.size(); ++i) k[i] = v[i] = poison<T>();
    for (std::size_t i = 0; i < k_scale.size(); ++i) k_scale[i] = v_scale[i] = std::numeric_limits<float>::quiet_NaN();

    args.k_cache = block > 0 ? k.cview() : logical_view<const T>(k.data(), physical, layout == Layout::head_major);
    args.v_cache = block > 0 ? v.cview() : logical_view<const T>(v.data(), physical, layout == Layout::head_major);
    if (block > 0) args.block_table = table.cview();
    const auto scales = [&](const qkv::Tensor<float, 3>& s) {
      if (layout != Layout::head_major) return s.cview();
      // [B, Hkv, N] stored, seen as [B, N, Hkv].
      return qkv::View3<const float>(s.data(), {batch, capacity, kv_heads},
                                     {kv_heads * capacity, 1, capacity});
    };
    if constexpr (std::is_same_v<T, std::int8_t>) {
      args.k_scale = scales(k_scale);
      args.v_scale = scales(v_scale);
    }
    args.cache_lengths = lengths;

    Rng rng(seed);
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t j = 0; j < lengths[static_cast<std::size_t>(b)]; ++j)
        for (std::int64_t h = 0; h < kv_heads; ++h) {
          T* k_row = const_cast<T*>(&row(args.k_cache, b, j, h, block));
          T* v_row = const_cast<T*>(&row(args.v_cache, b, j, h, block));
          for (std::int64_t e = 0; e < d; ++e) {
            k_row[e] = random_element<T>(rng);
            v_row[e] = random_element<T>(rng);
          }
          if constexpr (std::is_same_v<T, std::int8_t>) {
            const_cast<float&>(scale_at(args.k_scale, b, j, h, block)) = 0.01f + 0.02f * rng.uniform();
            const_cast<float&>(scale_at(args.v_scale, b, j, h, block)) = 0.01f + 0.02f * rng.uniform();
          }
        }
  }

  // Element 0 of key j's row of kv head h in sequence b.
  const T& row(const qkv::View4<const T>& cache, std::int64_t b, std::int64_t j, std::int64_t h,
               std::int64_t block) const {
    if (block == 0) return cache(b, j, h, 0);
    return cache(table(b, j / block), j % block, h, 0);
  }
  const float& scale_at(const qkv::View3<const float>& s, std::int64_t b, std::int64_t j, std::int64_t h,
                        std::int64_t block) const {
    if (block == 0) return s(b, j, h);
    return s(table(b, j / block), j % block, h);
  }

  std::vector<std::int64_t> lengths;
  qkv::Tensor<T, 4> k, v;
  qkv::Tensor<float, 3> k_scale, v_scale;
  qkv::Tensor<std::int32_t, 2> table;
  qkv::DecodeArgs<T> args;
};

struct Heads {
  std::int64_t q, kv, d;
};

template <class T>
void decode_case(const Heads& heads, std::int64_t nq, const std::vector<std::int64_t>& lengths, Layout layout,
                 const Variant& variant = {}, const std::string& label = "") {
  const auto batch = static_cast<std::int64_t>(lengths.size());
  std::string name = "decode/" + std::to_string(heads.q) + "/" + std::to_string(heads.kv) + "_d" +
                     std::to_string(heads.d) + "/" + type_name<T>() + "/" + layout_name(layout) + "/B" +
                     std::to_string(batch) + "_Nq" + std::to_string(nq) + "_N";
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    if (b > 0) name += ',';
    name += std::to_string(lengths[b]);
  }
  if (!label.empty()) name += "/" + label;
  const std::uint64_t seed = seed_of(name);
  OwnedCache<T> cache(heads.kv, heads.d, lengths, layout, seed);
  // q as PyTorch hands it ([B, Hq, Nq, d]) for the head-major cache, else [B, Nq, Hq, d].
  const bool bhsd = layout == Layout::head_major;
  const std::array<std::int64_t, 4> q_shape = bhsd ? std::array<std::int64_t, 4>{batch, heads.q, nq, heads.d}
                                                   : std::array<std::int64_t, 4>{batch, nq, heads.q, heads.d};
  const auto q = random_tensor<float, 4>(q_shape, seed + 1);
  auto out = output_tensor<float, 4>(q_shape);
  auto lse = output_tensor<float, 3>({batch, heads.q, nq});
  std::vector<float> slopes, sinks;
  for (std::int64_t h = 0; h < heads.q; ++h) {
    slopes.push_back(0.5f / static_cast<float>(h + 1));
    sinks.push_back(0.25f * static_cast<float>(h % 3));
  }
  qkv::DecodeArgs<T> args = cache.args;
  args.q = logical_view<const float>(q.data(), q_shape, bhsd);
  args.out = logical_view<float>(out.data(), q_shape, bhsd);
  args.lse = lse.view();
  qkv::decode(args, decode_options(variant, slopes, sinks));
  Line(name).add("out", out).add("lse", lse).print();
}

template <class T>
void decode_grid(const Heads& heads) {
  for (Layout layout : {Layout::head_major, Layout::token_major, Layout::paged16, Layout::paged128})
    decode_case<T>(heads, 1, {2048}, layout);
  for (Layout layout : {Layout::token_major, Layout::paged16}) decode_case<T>(heads, 1, {1000, 2048, 1}, layout);
}

}  // namespace

void decode_cases() {
  // bench_decode.py: Hq/Hkv/d = 12/12/64, 32/8/128, 64/8/128, one query per head,
  // 4096…131072 keys, batch 1 and 8, fp32 and bf16, contiguous and paged 16/128; the
  // probe adds float16 and int8. Scaled to 2048 keys and a ragged batch of 3.
  for (const Heads& heads : {Heads{12, 12, 64}, Heads{32, 8, 128}, Heads{64, 8, 128}}) {
    decode_grid<float>(heads);
    decode_grid<qkv::bfloat16>(heads);
    decode_grid<qkv::float16>(heads);
    decode_grid<std::int8_t>(heads);
  }
  // --window 4096 at 32768 keys, scaled: a window of 512 keys at 2048.
  const Variant window{.window = {.left = 511, .right = -1}};
  for (const Heads& heads : {Heads{32, 8, 128}, Heads{12, 12, 64}}) {
    decode_case<float>(heads, 1, {2048}, Layout::head_major, window, "window511");
    decode_case<qkv::bfloat16>(heads, 1, {2048}, Layout::head_major, window, "window511");
  }
  // The inference variants, several queries (chunked prefill), the causal modes, and
  // sequences shorter than the query count or empty.
  const Heads gqa{32, 8, 128}, odd{6, 2, 40};
  const Variant all{.window = {.left = 300, .right = -1}, .softcap = 30.0f, .alibi = true, .sinks = true};
  decode_case<float>(gqa, 1, {2048}, Layout::paged16, {.softcap = 30.0f}, "softcap30");
  decode_case<float>(gqa, 1, {2048}, Layout::token_major, {.alibi = true}, "alibi");
  decode_case<float>(gqa, 1, {2048}, Layout::head_major, {.sinks = true}, "sinks");
  decode_case<float>(gqa, 1, {2048}, Layout::head_major, {.scale = 0.2}, "scale0.2");
  decode_case<std::int8_t>(gqa, 1, {1000, 2048, 1}, Layout::paged16, all, "all");
  decode_case<qkv::bfloat16>(odd, 4, {700, 2, 0}, Layout::paged16, all, "all");
  decode_case<float>(odd, 16, {700, 2, 0, 16}, Layout::token_major, {}, "prefill");
  decode_case<qkv::float16>(odd, 16, {700, 33}, Layout::head_major, {.causal = Causal::top_left}, "top_left");
  decode_case<float>(odd, 4, {700, 33}, Layout::paged128, {.causal = Causal::none}, "no_causal");
}

namespace {

// The stored rows of every sequence (and int8 scales), read through views().
template <class T>
void hash_stored(Line& line, const qkv::KVCache& cache) {
  const qkv::DecodeArgs<T> a = cache.views<T>();
  const qkv::KVCacheConfig& c = cache.config();
  std::uint64_t k_hash = fnv1a(nullptr, 0), v_hash = k_hash, s_hash = k_hash;
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t j = 0; j < cache.lengths()[static_cast<std::size_t>(b)]; ++j)
      for (std::int64_t h = 0; h < c.kv_heads; ++h) {
        const std::int64_t block = c.paged ? a.block_table(b, j / c.block_size) : b;
        const std::int64_t r = c.paged ? j % c.block_size : j;
        k_hash = fnv1a(&a.k_cache(block, r, h, 0), static_cast<std::size_t>(c.head_dim) * sizeof(T), k_hash);
        v_hash = fnv1a(&a.v_cache(block, r, h, 0), static_cast<std::size_t>(c.head_dim) * sizeof(T), v_hash);
        if constexpr (std::is_same_v<T, std::int8_t>) {
          s_hash = fnv1a(&a.k_scale(block, r, h), sizeof(float), s_hash);
          s_hash = fnv1a(&a.v_scale(block, r, h), sizeof(float), s_hash);
        }
      }
  line.add_hash("k_rows", k_hash).add_hash("v_rows", v_hash);
  if constexpr (std::is_same_v<T, std::int8_t>) line.add_hash("scales", s_hash);
}

template <class T>
void cache_case(bool paged) {
  const std::string name = std::string("cache/") + type_name<T>() + (paged ? "/paged16" : "/contiguous") +
                           "/B3_H8/2_d64";
  const std::int64_t batch = 3, kv_heads = 2, q_heads = 8, d = 64;
  qkv::KVCache cache({.batch = batch, .capacity = 700, .kv_heads = kv_heads, .head_dim = d,
                      .dtype = qkv::storage_type_of<T>, .paged = paged, .block_size = 16});
  const std::uint64_t seed = seed_of(name);
  Line line(name);
  std::uint64_t step_seed = seed;
  const auto append = [&](std::int64_t tokens, std::vector<std::int64_t> seqs) {
    const auto n = seqs.empty() ? batch : static_cast<std::int64_t>(seqs.size());
    const auto k = random_tensor<float, 4>({n, tokens, kv_heads, d}, ++step_seed, 2.0f);
    const auto v = random_tensor<float, 4>({n, tokens, kv_heads, d}, ++step_seed);
    cache.append(k.cview(), v.cview(), seqs);
  };
  const auto attend = [&](std::int64_t tokens, const char* what) {
    const auto q = random_tensor<float, 4>({batch, tokens, q_heads, d}, ++step_seed);
    auto out = output_tensor<float, 4>(q.shape());
    auto lse = output_tensor<float, 3>({batch, q_heads, tokens});
    cache.attend(q.cview(), out.view(), lse.view());
    line.add(what, out).add("lse", lse);
  };
  append(300, {});        // the prompt
  attend(5, "prefill");   // its last 5 tokens' queries
  append(1, {2, 0});      // one step for two of the sequences
  attend(1, "step");
  cache.reset(1);
  append(4, {1});
  attend(1, "after_reset");
  const std::vector<float> sinks(static_cast<std::size_t>(q_heads), 0.5f);
  const auto q = random_tensor<float, 4>({batch, 1, q_heads, d}, ++step_seed);
  auto out = output_tensor<float, 4>(q.shape());
  cache.attend(q.cview(), out.view(), {},
               decode_options({.window = {.left = 100, .right = -1}, .softcap = 30.0f, .sinks = true}, {}, sinks));
  line.add("variants", out);
  hash_stored<T>(line, cache);
  line.print();
}

}  // namespace

void cache_cases() {
  // qkv::KVCache as bench_decode.py's callers and examples/generate use it.
  for (bool paged : {false, true}) {
    cache_case<float>(paged);
    cache_case<qkv::bfloat16>(paged);
    cache_case<qkv::float16>(paged);
    cache_case<std::int8_t>(paged);
  }
}

}  // namespace digest
