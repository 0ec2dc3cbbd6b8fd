// Greedy generation with a small causal language model on qkv's KV cache, in C++ with
// qkv::nn: the decode loop an LLM runs (examples/generate.py is the same in PyTorch).
//
// The model is a qkv::nn::Transformer<float> with random weights (no download): token and
// learned position embeddings, pre-norm blocks of grouped-query attention and a GELU MLP,
// a final LayerNorm and an LM head. Generation keeps one qkv::KVCache per block:
//
//   auto caches = model.make_caches({.batch = B, .dtype = ..., .paged = ...});
//   logits = model.forward_step(prompt, B, P, caches);        // prefill: the whole prompt
//   repeat: next = argmax(logits);  logits = model.forward_step(next, B, 1, caches);
//
// Each step projects only the new token, appends its keys and values to every block's
// cache (rounded once to float32, bfloat16 or float16, or quantized to int8 with a scale
// per row; contiguous, or paged like vLLM)
// and attends its queries to everything cached. Then the same tokens are generated again
// without reusing anything — the whole sequence through the model at every step, as a
// model without a cache must — and the two token streams must be identical (the program
// exits with 1 otherwise). Both are timed.
//
// The full pass is Transformer::forward for a float32 cache. A 16-bit or int8 cache rounds K
// and V (bfloat16 by up to 2⁻⁹ relatively, int8 by up to half its row's scale), which moves logits by ~1e-2 here: at a near-tie of
// the two best tokens that may, legitimately, pick the other token than float32 would. So
// for those caches the full pass rounds K and V the same way: the whole sequence goes
// through forward_step into a fresh cache each step (one prefill, nothing reused) — what
// examples/generate.py does with SDPA on rounded K/V. How far the rounding moved the
// logits from float32's forward is printed too.
//
//   generate [--vocab 512] [--embed 256] [--heads 4] [--kv-heads 1] [--layers 4]
//            [--context 256] [--batch 1] [--prompt 32] [--tokens 128]
//            [--cache-dtype float32|bfloat16|float16|int8] [--paged] [--block-size 16]
//            [--threads 1] [--seed 0]
#include <qkv/nn/nn.hpp>
#include <qkv/qkv.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Args {
  int64_t vocab = 512, embed = 256, heads = 4, kv_heads = 1, layers = 4, context = 256;
  int64_t batch = 1, prompt = 32, tokens = 128, block_size = 16;
  int threads = 1;
  uint64_t seed = 0;
  std::string cache_dtype = "float32";
  bool paged = false;
};

void usage() {
  std::puts(
      "usage: generate [--vocab N] [--embed N] [--heads N] [--kv-heads N] [--layers N]\n"
      "                [--context N] [--batch N] [--prompt N] [--tokens N]\n"
      "                [--cache-dtype float32|bfloat16|float16|int8] [--paged] [--block-size N]\n"
      "                [--threads N] [--seed N]");
}

bool parse(int argc, char** argv, Args& a) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--paged") {
      a.paged = true;
      continue;
    }
    if (flag == "--help" || flag == "-h" || i + 1 >= argc) return false;
    const char* value = argv[++i];
    auto integer = [&](int64_t& out) { out = std::strtoll(value, nullptr, 10); };
    if (flag == "--vocab") integer(a.vocab);
    else if (flag == "--embed") integer(a.embed);
    else if (flag == "--heads") integer(a.heads);
    else if (flag == "--kv-heads") integer(a.kv_heads);
    else if (flag == "--layers") integer(a.layers);
    else if (flag == "--context") integer(a.context);
    else if (flag == "--batch") integer(a.batch);
    else if (flag == "--prompt") integer(a.prompt);
    else if (flag == "--tokens") integer(a.tokens);
    else if (flag == "--block-size") integer(a.block_size);
    else if (flag == "--threads") a.threads = std::atoi(value);
    else if (flag == "--seed") a.seed = std::strtoull(value, nullptr, 10);
    else if (flag == "--cache-dtype") a.cache_dtype = value;
    else return false;
  }
  return true;
}

// Weights of a trained-looking scale (GPT-2's 0.02 init gives logits ~0 and attention
// ~uniform, where every token is a near-tie): Linear weights N(0, (1.5/√in)²), embeddings
// N(0, 1), LayerNorm gains 1 + N(0, 0.1²), biases N(0, 0.1²).
void randomize(qkv::nn::Transformer<float>& model, uint64_t seed) {
  qkv::nn::Rng rng(seed);
  for (const auto& [name, p] : model.parameters()) {
    const bool bias = name.ends_with(".bias");
    const bool norm = name.find("ln") != std::string::npos;
    double stddev = 1.5 / std::sqrt(static_cast<double>(p->shape.back()));
    if (bias || norm) stddev = 0.1;
    if (name.starts_with("tok.") || name.starts_with("pos.")) stddev = 1.0;
    qkv::nn::fill_normal(p->values(), 0.0, stddev, rng);
    if (norm && !bias) {
      for (float& gain : p->values()) gain += 1.0f;
    }
  }
}

int32_t argmax(const float* row, int64_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!parse(argc, argv, a)) {
    usage();
    return 2;
  }
  try {
    qkv::StorageType dtype = qkv::StorageType::float32;
    if (a.cache_dtype == "bfloat16") dtype = qkv::StorageType::bfloat16;
    else if (a.cache_dtype == "float16") dtype = qkv::StorageType::float16;
    else if (a.cache_dtype == "int8") dtype = qkv::StorageType::int8;
    else if (a.cache_dtype != "float32")
      throw qkv::Error("--cache-dtype: expected float32, bfloat16, float16 or int8, got " + a.cache_dtype);
    if (a.prompt < 1 || a.tokens < 0 || a.prompt + a.tokens > a.context)
      throw qkv::Error("--prompt + --tokens: expected ≤ --context (" + std::to_string(a.context) + ")");
    qkv::nn::set_threads(a.threads);

    qkv::nn::Transformer<float> model({.vocab_size = a.vocab, .context = a.context,
                                       .embed_dim = a.embed, .num_heads = a.heads,
                                       .num_kv_heads = a.kv_heads, .num_layers = a.layers,
                                       .execution = {.threads = a.threads}});
    randomize(model, a.seed);
    qkv::nn::Rng rng(a.seed + 1);
    std::vector<int32_t> prompt(static_cast<std::size_t>(a.batch * a.prompt));
    for (int32_t& id : prompt) id = static_cast<int32_t>(rng.below(static_cast<uint64_t>(a.vocab)));
    const int64_t length = a.prompt + a.tokens, B = a.batch, V = a.vocab;
    auto token = [&](std::vector<int32_t>& seqs, int64_t b, int64_t p) -> int32_t& {
      return seqs[static_cast<std::size_t>(b * length + p)];
    };
    std::vector<int32_t> cached(static_cast<std::size_t>(B * length)), uncached = cached;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t p = 0; p < a.prompt; ++p) {
        token(cached, b, p) = token(uncached, b, p) = prompt[static_cast<std::size_t>(b * a.prompt + p)];
      }
    }

    // With the cache: prefill, then one token per step. The logits of each step are kept
    // to compare with the full forward's.
    std::vector<float> step_logits(static_cast<std::size_t>(B * length * V));
    auto start = std::chrono::steady_clock::now();
    std::vector<qkv::KVCache> caches = model.make_caches(
        {.batch = B, .capacity = length, .dtype = dtype, .paged = a.paged, .block_size = a.block_size});
    qkv::nn::Matrix<const float> logits = model.forward_step(prompt, B, a.prompt, caches);
    int64_t rows_each = a.prompt;
    std::vector<int32_t> next(static_cast<std::size_t>(B));
    for (int64_t p = a.prompt; p < length; ++p) {
      for (int64_t b = 0; b < B; ++b) {
        const float* row = &logits((b + 1) * rows_each - 1, 0);
        std::copy_n(row, V, &step_logits[static_cast<std::size_t>((b * length + p) * V)]);
        next[static_cast<std::size_t>(b)] = token(cached, b, p) = argmax(row, V);
      }
      if (p + 1 < length) logits = model.forward_step(next, B, 1, caches);
      rows_each = 1;
    }
    const double cached_seconds = seconds_since(start);

    // Without a cache: the whole sequence through the model at every step (see the top).
    std::vector<qkv::KVCache> scratch = model.make_caches(
        {.batch = B, .capacity = length, .dtype = dtype, .paged = a.paged, .block_size = a.block_size});
    auto full_pass = [&](std::span<const int32_t> seqs, int64_t p) {
      if (dtype == qkv::StorageType::float32) return model.forward(seqs, B, p);
      for (qkv::KVCache& cache : scratch) cache.reset();
      return model.forward_step(seqs, B, p, scratch);
    };
    int64_t first_difference = -1;
    double largest_difference = 0, margin_there = 0;
    start = std::chrono::steady_clock::now();
    std::vector<int32_t> ids(static_cast<std::size_t>(B * length));
    for (int64_t p = a.prompt; p < length; ++p) {
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t t = 0; t < p; ++t) ids[static_cast<std::size_t>(b * p + t)] = token(uncached, b, t);
      }
      const qkv::nn::Matrix<const float> full = full_pass(std::span(ids).first(static_cast<std::size_t>(B * p)), p);
      for (int64_t b = 0; b < B; ++b) {
        const float* row = &full(b * p + p - 1, 0);
        token(uncached, b, p) = argmax(row, V);
        const float* stepped = &step_logits[static_cast<std::size_t>((b * length + p) * V)];
        for (int64_t v = 0; v < V; ++v)
          largest_difference = std::max(largest_difference, static_cast<double>(std::fabs(row[v] - stepped[v])));
        if (first_difference < 0 && token(uncached, b, p) != token(cached, b, p)) {
          first_difference = p;
          margin_there = row[token(uncached, b, p)] - row[token(cached, b, p)];
        }
      }
      if (first_difference >= 0) break;  // the sequences part: later steps compare nothing
    }
    const double uncached_seconds = seconds_since(start);

    // A 16-bit or int8 cache: how far its rounding moved the logits from float32's forward.
    double rounding_effect = 0;
    if (dtype != qkv::StorageType::float32 && first_difference < 0 && a.tokens > 0) {
      const qkv::nn::Matrix<const float> exact = model.forward(cached, B, length);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t p = a.prompt; p < length; ++p) {
          const float* row = &exact(b * length + p - 1, 0);
          const float* stepped = &step_logits[static_cast<std::size_t>((b * length + p) * V)];
          for (int64_t v = 0; v < V; ++v)
            rounding_effect = std::max(rounding_effect, static_cast<double>(std::fabs(row[v] - stepped[v])));
        }
      }
    }

    const double generated = static_cast<double>(B * a.tokens);
    std::printf("model: vocab %lld, E %lld, %lld layers, %lld query / %lld kv heads of d = %lld; "
                "%lld thread(s)\n",
                static_cast<long long>(a.vocab), static_cast<long long>(a.embed),
                static_cast<long long>(a.layers), static_cast<long long>(a.heads),
                static_cast<long long>(a.kv_heads), static_cast<long long>(a.embed / a.heads),
                a.threads);
    std::printf("cache: %s, %s; batch %lld, prompt %lld, %lld new tokens each\n",
                a.cache_dtype.c_str(),
                a.paged ? ("paged, block " + std::to_string(a.block_size)).c_str() : "contiguous",
                static_cast<long long>(B), static_cast<long long>(a.prompt),
                static_cast<long long>(a.tokens));
    for (int64_t b = 0; b < B; ++b) {
      std::printf("  sequence %lld:", static_cast<long long>(b));
      for (int64_t p = a.prompt; p < length; ++p) std::printf(" %d", token(cached, b, p));
      std::printf("\n");
    }
    std::printf("with the KV cache:    %8.1f tokens/s (%.3f s, prefill included)\n",
                generated / cached_seconds, cached_seconds);
    std::printf("without (whole sequence each step): %8.1f tokens/s (%.3f s)\n",
                generated / uncached_seconds, uncached_seconds);
    if (first_difference >= 0) {
      std::printf("DIFFERENT tokens from position %lld: the full pass prefers its token by %.3g "
                  "(largest logit difference so far %.3g)\n",
                  static_cast<long long>(first_difference), margin_there, largest_difference);
      return 1;
    }
    std::printf("same tokens as without the cache: yes (largest logit difference %.3g)\n",
                largest_difference);
    if (dtype != qkv::StorageType::float32) {
      std::printf("%s K/V moved the logits from float32's Transformer::forward by up to %.3g\n",
                  a.cache_dtype.c_str(), rounding_effect);
    }
    return 0;
  } catch (const qkv::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
