// Incremental decoding with Transformer::forward_step on qkv::KVCache: the logits of every
// step against the full forward over the whole sequence, against the exact (fp64) model,
// paged against contiguous caches, 16-bit caches, batches, and every error path.
//
// Tolerances. Both forward_step and forward compute the same function in float32 but sum
// in different orders (GEMMs over 1 row vs N rows, the decode kernel vs the fused forward
// kernel), so neither is "the" answer: the oracle is the same model in double
// (Transformer<double> with the float weights widened exactly). The project's contract
// (DESIGN.md §3) is that a fast path's error against fp64 is no larger than the fp32
// forward's on the same inputs; as FlashAttention's tests do, we allow a factor 2, since
// both maxima are samples of rounding noise of one size (the ratio measured here is ~1):
//     err_step = max |step − fp64|  ≤  2 · err_full,   err_full = max |forward − fp64|
// and hence, by the triangle inequality, |step − forward| ≤ 3 · err_full. Measured here
// (logits up to 5.8): err_full 3.6e-6 (≈ 7.5 float32 ulps of the largest logit), err_step
// 2.2e-6, |step − forward| 3.8e-6. A step that uses a wrong position, a stale key or the
// wrong causal alignment misses this by orders of magnitude (O(0.1…1) changes of the
// logits; verified by breaking each on purpose).
//
// 16-bit caches: the step logits of a bfloat16 cache differ from float32's by ~1e-2 — the
// rounding of K and V (relative ≤ 2⁻⁹) carried through two blocks. Rather than bound that
// propagation loosely, the test reads the rounded K/V back from the cache and evaluates the
// exact model on exactly those values: the step must then agree within the float32 bound
// above, which is the claim "a 16-bit cache = a float32 computation on K/V rounded once".
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "nn_test_support.hpp"
#include "qkv/attention.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/threads.hpp"
#include "qkv/nn/transformer.hpp"

namespace qkv::nn {
namespace {

constexpr int64_t kVocab = 61, kContext = 48;

TransformerConfig small_config() {
  return {.vocab_size = kVocab, .context = kContext, .embed_dim = 64, .num_heads = 4,
          .num_kv_heads = 2, .num_layers = 2};
}

// Weights of a "trained-looking" scale, so attention is neither uniform nor one-hot and
// logits are O(1) (GPT-2's 0.02 init leaves every logit ~0 and attention ~uniform):
// Linear weights N(0, (1.5/√in)²) give scores q·k/√d of std ~2; embeddings N(0, 1);
// LayerNorm gains 1 + N(0, 0.1²); biases N(0, 0.1²).
void randomize(Transformer<float>& model, uint64_t seed) {
  Rng rng(seed);
  for (const auto& [name, p] : model.parameters()) {
    const bool norm = name.find("ln") != std::string::npos;
    const bool bias = name.ends_with(".bias");
    if (norm && !bias) {
      testing::fill(p->values(), rng, 0.1);
      for (float& g : p->values()) g += 1.0f;
    } else if (bias) {
      testing::fill(p->values(), rng, 0.1);
    } else if (name.starts_with("tok.") || name.starts_with("pos.")) {
      testing::fill(p->values(), rng, 1.0);
    } else {
      testing::fill(p->values(), rng, 1.5 / std::sqrt(static_cast<double>(p->shape[1])));
    }
  }
}

// The same model in double, every weight widened exactly.
Transformer<double> widened(Transformer<float>& model) {
  Transformer<double> wide(model.config());
  const ParameterList<float> from = model.parameters();
  const ParameterList<double> to = wide.parameters();
  for (std::size_t i = 0; i < from.size(); ++i) {
    const auto src = from[i].parameter->values();
    std::ranges::copy(src, to[i].parameter->values().begin());
  }
  return wide;
}

int32_t argmax(const float* row) {
  return static_cast<int32_t>(std::max_element(row, row + kVocab) - row);
}

// A generation: tokens [B, N] (prompt, then greedy picks) and the logits forward_step
// returned for every position [B, N, vocab] — prefill rows for the prompt, one row per step
// after it — laid out as forward()'s [B·N, vocab].
struct Generation {
  int64_t batch = 0, length = 0;
  std::vector<int32_t> tokens;
  std::vector<float> logits;
  float logit(int64_t b, int64_t p, int64_t v) const {
    return logits[static_cast<std::size_t>((b * length + p) * kVocab + v)];
  }
};

Generation generate(Transformer<float>& model, const std::vector<int32_t>& prompt, int64_t batch,
             int64_t length, std::vector<KVCache>& caches) {
  const int64_t prompt_len = static_cast<int64_t>(prompt.size()) / batch;
  Generation run{.batch = batch, .length = length,
          .tokens = std::vector<int32_t>(static_cast<std::size_t>(batch * length)),
          .logits = std::vector<float>(static_cast<std::size_t>(batch * length * kVocab))};
  auto keep = [&](const Matrix<const float>& logits, int64_t position, int64_t rows_each) {
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t t = 0; t < rows_each; ++t) {
        std::copy_n(&logits(b * rows_each + t, 0), kVocab,
                    &run.logits[static_cast<std::size_t>((b * length + position + t) * kVocab)]);
      }
    }
  };
  for (int64_t b = 0; b < batch; ++b) {
    std::copy_n(&prompt[static_cast<std::size_t>(b * prompt_len)], prompt_len,
                &run.tokens[static_cast<std::size_t>(b * length)]);
  }
  keep(model.forward_step(prompt, batch, prompt_len, caches), 0, prompt_len);  // prefill
  std::vector<int32_t> next(static_cast<std::size_t>(batch));
  for (int64_t position = prompt_len; position < length; ++position) {
    for (int64_t b = 0; b < batch; ++b) {
      next[b] = argmax(&run.logits[static_cast<std::size_t>((b * length + position - 1) * kVocab)]);
      run.tokens[static_cast<std::size_t>(b * length + position)] = next[b];
    }
    keep(model.forward_step(next, batch, 1, caches), position, 1);
  }
  return run;
}

Generation generate(Transformer<float>& model, const std::vector<int32_t>& prompt, int64_t batch,
             int64_t length, const TransformerCacheConfig& cache_config) {
  std::vector<KVCache> caches = model.make_caches(cache_config);
  return generate(model, prompt, batch, length, caches);
}

std::vector<int32_t> random_ids(int64_t count, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> ids(static_cast<std::size_t>(count));
  for (auto& id : ids) id = static_cast<int32_t>(rng.below(kVocab));
  return ids;
}

// For RecordProperty: 3 significant digits (std::to_string's fixed 6 decimals hide 1e-7).
std::string sci(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", value);
  return text;
}

template <class A, class B>
double max_abs_difference(const A& a, const B& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  }
  return worst;
}

template <class T>
std::vector<T> copy_of(Matrix<const T> m) {
  std::vector<T> out;
  for (int64_t r = 0; r < m.shape[0]; ++r) out.insert(out.end(), &m(r, 0), &m(r, 0) + m.shape[1]);
  return out;
}

// fp32 forward and fp64 forward over a run's final tokens, and err_full (see the top).
struct Full {
  std::vector<float> fp32;
  std::vector<double> fp64;
  double err_full = 0;
};

Full full_forward(Transformer<float>& model, Transformer<double>& exact, const Generation& run) {
  Full full;
  full.fp32 = copy_of(model.forward(run.tokens, run.batch, run.length));
  full.fp64 = copy_of(exact.forward(run.tokens, run.batch, run.length));
  full.err_full = max_abs_difference(full.fp32, full.fp64);
  return full;
}

TEST(TransformerDecode, StepLogitsMatchTheFullForwardAndGreedyTokensAgree) {
  Transformer<float> model(small_config());
  randomize(model, 1);
  Transformer<double> exact = widened(model);
  const Generation run = generate(model, random_ids(12, 2), 1, kContext, {.batch = 1});
  const Full full = full_forward(model, exact, run);
  const double err_step = max_abs_difference(run.logits, full.fp64);
  const double difference = max_abs_difference(run.logits, full.fp32);
  RecordProperty("err_full", sci(full.err_full));
  RecordProperty("err_step", sci(err_step));
  RecordProperty("step_vs_forward", sci(difference));
  // The oracle is sane: float32 rounding of logits of size ~1 through two blocks.
  const double largest = max_abs_difference(full.fp64, std::vector<double>(full.fp64.size()));
  RecordProperty("largest_logit", sci(largest));
  ASSERT_GT(largest, 1.0);
  ASSERT_LT(full.err_full, 1e-5 * largest);
  EXPECT_LE(err_step, 2 * full.err_full) << "err_full " << full.err_full;
  EXPECT_LE(difference, 3 * full.err_full);

  // Greedy without a cache (argmax of the full forward at each position) picks the same
  // tokens; the margins show the agreement is not luck: every step's top-2 gap is far
  // above the difference between the two paths.
  double smallest_margin = 1e30;
  for (int64_t p = 11; p + 1 < run.length; ++p) {
    const float* row = &full.fp32[static_cast<std::size_t>(p * kVocab)];
    EXPECT_EQ(argmax(row), run.tokens[static_cast<std::size_t>(p + 1)]) << "position " << p;
    std::vector<float> sorted(row, row + kVocab);
    std::ranges::sort(sorted, std::greater<>());
    smallest_margin = std::min(smallest_margin, static_cast<double>(sorted[0] - sorted[1]));
  }
  RecordProperty("smallest_margin", sci(smallest_margin));
  EXPECT_GT(smallest_margin, 10 * difference);
}

TEST(TransformerDecode, PagedCachesGiveBitwiseTheLogitsOfAContiguousOne) {
  // The decode kernel reads a key the same way wherever its row lives, and splits the keys
  // by sequence length only: the layout may not change a single bit.
  Transformer<float> model(small_config());
  randomize(model, 3);
  const std::vector<int32_t> prompt = random_ids(2 * 9, 4);
  for (StorageType dtype : {StorageType::float32, StorageType::bfloat16}) {
    const Generation contiguous = generate(model, prompt, 2, 40, {.batch = 2, .dtype = dtype});
    for (int64_t block_size : {16, 4}) {
      const Generation paged = generate(model, prompt, 2, 40,
                                 {.batch = 2, .dtype = dtype, .paged = true,
                                  .block_size = block_size});
      EXPECT_EQ(paged.tokens, contiguous.tokens) << block_size;
      EXPECT_EQ(std::memcmp(paged.logits.data(), contiguous.logits.data(),
                            paged.logits.size() * sizeof(float)),
                0)
          << "block_size " << block_size << ", largest difference "
          << max_abs_difference(paged.logits, contiguous.logits);
    }
  }
}

// The key or value element the cache holds, widened to double.
template <class S>
double cached(const KVCache& cache, bool value, int64_t b, int64_t j, int64_t h, int64_t c) {
  const DecodeArgs<S> views = cache.views<S>();
  const View4<const S>& pool = value ? views.v_cache : views.k_cache;
  if (views.block_table.empty()) return static_cast<float>(pool(b, j, h, c));
  const int64_t block_size = pool.shape[1];
  return static_cast<float>(pool(views.block_table(b, j / block_size), j % block_size, h, c));
}

// The exact (fp64) model whose attention, in every block, reads the keys and values the
// caches hold — already rounded to their storage type — instead of projecting its own:
// what a float32 forward on K/V rounded to that type computes, without float32's noise.
template <class S>
std::vector<double> exact_on_cached_kv(Transformer<double>& exact, const Generation& run,
                                       const std::vector<KVCache>& caches) {
  const TransformerConfig& c = exact.config();
  const int64_t B = run.batch, N = run.length, E = c.embed_dim, H = c.num_heads;
  const int64_t Hkv = c.num_kv_heads, d = E / H, rows = B * N;
  Tensor<double, 2> x({rows, E}), h({rows, E}), q({rows, E}), context({rows, E}), a({rows, E});
  Tensor<double, 2> mid({rows, E}), m({rows, E}), norm({rows, E}), logits({rows, kVocab});
  Tensor<double, 4> k({B, N, Hkv, d}), v({B, N, Hkv, d});
  LayerNormSaved<double> ln_saved;
  MlpSaved<double> mlp_saved;
  exact.tok.forward(run.tokens, x.view());
  exact.pos.forward(TensorView<double, 3>::contiguous(x.data(), {B, N, E}));
  for (std::size_t l = 0; l < exact.blocks.size(); ++l) {
    const TransformerBlock<double>& block = exact.blocks[l];
    block.ln1.forward(x.view(), h.view(), ln_saved);
    block.attn.q_proj.forward(h.view(), q.view());
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < N; ++j) {
        for (int64_t g = 0; g < Hkv; ++g) {
          for (int64_t e = 0; e < d; ++e) {
            k(b, j, g, e) = cached<S>(caches[l], false, b, j, g, e);
            v(b, j, g, e) = cached<S>(caches[l], true, b, j, g, e);
          }
        }
      }
    }
    AttentionOptions options;
    options.causal = Causal::top_left;
    options.execution.backend = Backend::reference;
    attention_forward(ForwardArgs<double>{.q = View4<const double>::contiguous(q.data(), {B, N, H, d}),
                                          .k = k.cview(), .v = v.cview(),
                                          .out = View4<double>::contiguous(context.data(), {B, N, H, d})},
                      options);
    block.attn.out_proj.forward(context.view(), a.view());
    for (std::size_t i = 0; i < mid.size(); ++i) mid[i] = x[i] + a[i];
    block.ln2.forward(mid.view(), h.view(), ln_saved);
    block.mlp.forward(h.view(), m.view(), mlp_saved);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = mid[i] + m[i];
  }
  exact.ln_f.forward(x.view(), norm.view(), ln_saved);
  exact.head.forward(norm.view(), logits.view());
  return copy_of(logits.cview());
}

struct HalfCase {
  StorageType dtype;
  bool paged;
};

void PrintTo(const HalfCase& c, std::ostream* os) {
  *os << storage_name(c.dtype) << (c.paged ? ", paged" : ", contiguous");
}

class TransformerDecodeHalf : public ::testing::TestWithParam<HalfCase> {};

TEST_P(TransformerDecodeHalf, LogitsAreTheExactModelsOnTheRoundedKeysAndValues) {
  // A 16-bit cache rounds each key and value once (bfloat16: relative error ≤ 2⁻⁹,
  // float16: ≤ 2⁻¹²); everything else is float32. So the step logits must be the exact
  // model's *given those rounded K/V* (read back from the cache) within the float32 bound
  // of the top of this file — and differ from the unrounded exact model by more than that.
  const HalfCase param = GetParam();
  Transformer<float> model(small_config());
  randomize(model, 5);
  Transformer<double> exact = widened(model);
  std::vector<KVCache> caches = model.make_caches(
      {.batch = 2, .dtype = param.dtype, .paged = param.paged, .block_size = 16});
  const Generation run = generate(model, random_ids(2 * 10, 6), 2, 36, caches);
  const Full full = full_forward(model, exact, run);
  const std::vector<double> rounded = param.dtype == StorageType::bfloat16
                                          ? exact_on_cached_kv<bfloat16>(exact, run, caches)
                                          : exact_on_cached_kv<float16>(exact, run, caches);
  const double err_rounded = max_abs_difference(run.logits, rounded);
  const double err_unrounded = max_abs_difference(run.logits, full.fp64);
  RecordProperty("err_full", sci(full.err_full));
  RecordProperty("err_on_rounded_kv", sci(err_rounded));
  RecordProperty("err_on_exact_kv", sci(err_unrounded));
  EXPECT_LE(err_rounded, 2 * full.err_full);
  EXPECT_GT(err_unrounded, 10 * full.err_full) << "the cache did not round K/V";
}

INSTANTIATE_TEST_SUITE_P(, TransformerDecodeHalf,
                         ::testing::Values(HalfCase{StorageType::bfloat16, false},
                                           HalfCase{StorageType::bfloat16, true},
                                           HalfCase{StorageType::float16, false}),
                         [](const auto& test) {
                           return std::string(test.param.dtype == StorageType::bfloat16
                                                  ? "bfloat16"
                                                  : "float16") +
                                  (test.param.paged ? "_paged" : "");
                         });

TEST(TransformerDecode, ResultsDoNotDependOnTheThreadCount) {
  // qkv::nn's GEMMs and loops split work into fixed blocks, and the decode kernel splits
  // keys by sequence length only: 1 thread and 3 give the same bits.
  const int threads_before = threads();
  std::vector<float> logits[2];
  for (int t : {1, 3}) {
    TransformerConfig config = small_config();
    config.execution.threads = t;
    Transformer<float> model(config);
    randomize(model, 20);
    set_threads(t);
    logits[t == 3] = generate(model, random_ids(2 * 7, 21), 2, 40,
                              {.batch = 2, .dtype = StorageType::bfloat16, .paged = true,
                               .block_size = 4})
                         .logits;
  }
  set_threads(threads_before);
  EXPECT_EQ(std::memcmp(logits[0].data(), logits[1].data(), logits[0].size() * sizeof(float)), 0);
}

TEST(TransformerDecode, ABatchMatchesEachSequenceAlone) {
  Transformer<float> model(small_config());
  randomize(model, 7);
  Transformer<double> exact = widened(model);
  const std::vector<int32_t> prompts = random_ids(2 * 8, 8);
  const Generation both = generate(model, prompts, 2, 30, {.batch = 2});
  for (int64_t b = 0; b < 2; ++b) {
    const std::vector<int32_t> prompt(prompts.begin() + b * 8, prompts.begin() + (b + 1) * 8);
    const Generation alone = generate(model, prompt, 1, 30, {.batch = 1});
    const std::vector<int32_t> tokens(both.tokens.begin() + b * 30, both.tokens.begin() + (b + 1) * 30);
    EXPECT_EQ(tokens, alone.tokens) << b;
    // Row b of a batched GEMM need not sum like a one-row GEMM, so not bitwise: within the
    // float32 bound against this sequence's exact logits.
    const Full full = full_forward(model, exact, alone);
    const std::vector<float> rows(both.logits.begin() + b * 30 * kVocab,
                                  both.logits.begin() + (b + 1) * 30 * kVocab);
    EXPECT_LE(max_abs_difference(rows, full.fp64), 2 * full.err_full) << b;
    EXPECT_LE(max_abs_difference(rows, alone.logits), 3 * full.err_full) << b;
    RecordProperty("batch_vs_alone_" + std::to_string(b), sci(max_abs_difference(rows, alone.logits)));
  }
}

TEST(TransformerDecode, SequencesAtDifferentPositionsShareAStep) {
  // After reset(1), sequence 1 starts over while sequence 0 continues: one step feeds a
  // token at position 8 of sequence 0 and position 0 of sequence 1.
  Transformer<float> model(small_config());
  randomize(model, 9);
  Transformer<double> exact = widened(model);
  std::vector<KVCache> caches = model.make_caches({.batch = 2, .paged = true, .block_size = 4});
  const std::vector<int32_t> first = random_ids(2 * 8, 10);
  model.forward_step(first, 2, 8, caches);
  for (KVCache& cache : caches) cache.reset(1);
  const std::vector<int32_t> ids = {5, 17};
  const std::vector<float> step = copy_of(model.forward_step(ids, 2, 1, caches));
  EXPECT_EQ(caches[1].lengths()[0], 9);
  EXPECT_EQ(caches[1].lengths()[1], 1);

  std::vector<int32_t> seq0(first.begin(), first.begin() + 8);
  seq0.push_back(5);
  const std::vector<float> full0 = copy_of(model.forward(seq0, 1, 9));
  const std::vector<double> exact0 = copy_of(exact.forward(seq0, 1, 9));
  const std::vector<float> full1 = copy_of(model.forward(std::vector<int32_t>{17}, 1, 1));
  const std::vector<double> exact1 = copy_of(exact.forward(std::vector<int32_t>{17}, 1, 1));
  const double err_full = std::max(max_abs_difference(full0, exact0), max_abs_difference(full1, exact1));
  const std::vector<float> step0(step.begin(), step.begin() + kVocab);
  const std::vector<float> step1(step.begin() + kVocab, step.end());
  EXPECT_LE(max_abs_difference(step0, std::vector<double>(exact0.end() - kVocab, exact0.end())),
            2 * err_full);
  EXPECT_LE(max_abs_difference(step1, exact1), 2 * err_full);
}

// Everything a cache holds, to show a failed step changed none of it.
struct Snapshot {
  std::vector<int64_t> lengths;
  std::vector<int32_t> table;
  int64_t free_blocks = 0;
  std::vector<unsigned char> k, v;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const KVCache& cache) {
  auto bytes = [&](const void* data, std::array<int64_t, 4> shape) {
    const auto* p = static_cast<const unsigned char*>(data);
    const int64_t n = shape[0] * shape[1] * shape[2] * shape[3] * storage_bytes(cache.config().dtype);
    return std::vector<unsigned char>(p, p + n);
  };
  return {.lengths = {cache.lengths().begin(), cache.lengths().end()},
          .table = {cache.block_table().begin(), cache.block_table().end()},
          .free_blocks = cache.free_blocks(),
          .k = bytes(cache.k_data(), cache.k_shape()),
          .v = bytes(cache.v_data(), cache.v_shape())};
}

std::vector<Snapshot> snapshot(const std::vector<KVCache>& caches) {
  std::vector<Snapshot> all;
  for (const KVCache& cache : caches) all.push_back(snapshot(cache));
  return all;
}

// `step` must throw qkv::Error whose message contains `words`, with no cache changed.
template <class Step>
void expect_rejected(std::vector<KVCache>& caches, Step&& step, const std::string& words) {
  const std::vector<Snapshot> before = snapshot(caches);
  try {
    step();
    ADD_FAILURE() << "no qkv::Error; expected one about: " << words;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
  EXPECT_TRUE(snapshot(caches) == before) << "a failed step changed a cache: " << words;
}

KVCache hand_made(int64_t batch, int64_t capacity, int64_t kv_heads, int64_t head_dim,
                  bool paged = false, int64_t num_blocks = 0) {
  return KVCache({.batch = batch, .capacity = capacity, .kv_heads = kv_heads,
                  .head_dim = head_dim, .paged = paged, .block_size = 4,
                  .num_blocks = num_blocks});
}

TEST(TransformerDecode, BadStepsThrowAndLeaveEveryCacheUnchanged) {
  Transformer<float> model(small_config());
  randomize(model, 11);
  std::vector<KVCache> caches = model.make_caches({.batch = 2, .paged = true, .block_size = 4});
  const std::vector<int32_t> prompt = random_ids(2 * 6, 12);
  model.forward_step(prompt, 2, 6, caches);  // something to keep
  const std::vector<int32_t> two = {1, 2};

  expect_rejected(caches, [&] { model.forward_step(std::vector<int32_t>{1, 2, 3}, 2, 1, caches); },
                  "ids.size(): expected 2");
  expect_rejected(caches, [&] { model.forward_step(std::vector<int32_t>{1, kVocab}, 2, 1, caches); },
                  "ids[1]: expected in [0, 61), got 61");
  expect_rejected(caches, [&] { model.forward_step(std::vector<int32_t>{-1, 0}, 2, 1, caches); },
                  "ids[0]");
  expect_rejected(caches, [&] { model.forward_step(std::vector<int32_t>{1}, 1, 1, caches); },
                  "cache.config().batch: expected 1");
  expect_rejected(caches, [&] { model.forward_step(two, 2, 1, std::span(caches).first(1)); },
                  "caches.size(): expected 2");
  expect_rejected(caches, [&] { model.forward_step({}, 2, 0, caches); }, "new_tokens");
  // Past capacity (= context for make_caches): 6 held + 43 > 48.
  const std::vector<int32_t> long_ids(2 * 43, 3);
  expect_rejected(caches, [&] { model.forward_step(long_ids, 2, 43, caches); },
                  "more do not fit");
  // Blocks' caches out of step with each other.
  caches[1].reset(0);
  expect_rejected(caches, [&] { model.forward_step(two, 2, 1, caches); },
                  "caches[1].lengths(): expected those of caches[0]");

  // Caches the model's blocks do not fit, or that cannot take the step: hand-made.
  std::vector<KVCache> wrong_heads;
  wrong_heads.push_back(hand_made(2, kContext, 2, 16));
  wrong_heads.push_back(hand_made(2, kContext, 4, 16));
  expect_rejected(wrong_heads, [&] { model.forward_step(two, 2, 1, wrong_heads); },
                  "caches[1]: qkv::nn::MultiHeadAttention::check_cache: cache.config().kv_heads: expected 2");
  std::vector<KVCache> wrong_dim;
  wrong_dim.push_back(hand_made(2, kContext, 2, 32));
  wrong_dim.push_back(hand_made(2, kContext, 2, 32));
  expect_rejected(wrong_dim, [&] { model.forward_step(two, 2, 1, wrong_dim); },
                  "cache.config().head_dim: expected 16");
  // A capacity beyond the model's context: the position table ends first.
  std::vector<KVCache> roomy;
  roomy.push_back(hand_made(1, 64, 2, 16));
  roomy.push_back(hand_made(1, 64, 2, 16));
  model.forward_step(random_ids(40, 13), 1, 40, roomy);
  expect_rejected(roomy, [&] { model.forward_step(random_ids(9, 14), 1, 9, roomy); },
                  "pass context (48)");
  // Block 0's pool has room, block 1's does not: block 0 must not take its blocks either.
  std::vector<KVCache> pools;
  pools.push_back(hand_made(1, kContext, 2, 16, true, 12));
  pools.push_back(hand_made(1, kContext, 2, 16, true, 2));
  expect_rejected(pools, [&] { model.forward_step(random_ids(9, 15), 1, 9, pools); },
                  "caches[1]: qkv::nn::MultiHeadAttention::check_cache: cache: the pool has 2 free blocks, 3 are needed");

  // After all that, a valid step still works.
  caches[1].reset(0);
  for (KVCache& cache : caches) cache.reset(0);
  EXPECT_NO_THROW(model.forward_step(two, 2, 1, caches));
  EXPECT_EQ(caches[0].lengths()[0], 1);
  EXPECT_EQ(caches[0].lengths()[1], 7);
}

TEST(TransformerDecode, AStepLeavesAPendingBackwardAlone) {
  // forward_step has its own buffers: forward_loss, a step, backward gives the gradients of
  // forward_loss, backward.
  Transformer<float> model(small_config());
  randomize(model, 16);
  const std::vector<int32_t> ids = random_ids(2 * 10, 17), targets = random_ids(2 * 10, 18);
  ParameterList<float> list = model.parameters();
  auto gradients = [&](bool step_between) {
    zero_grad(list);
    model.forward_loss(ids, targets, 2, 10);
    if (step_between) {
      std::vector<KVCache> caches = model.make_caches({.batch = 1});
      model.forward_step(random_ids(5, 19), 1, 5, caches);
    }
    model.backward();
    std::vector<float> all;
    for (const auto& [name, p] : list) all.insert(all.end(), p->grads().begin(), p->grads().end());
    return all;
  };
  EXPECT_EQ(gradients(true), gradients(false));
}

TEST(TransformerDecode, MakeCachesFitsTheModel) {
  Transformer<float> model(small_config());
  const std::vector<KVCache> caches =
      model.make_caches({.batch = 3, .dtype = StorageType::float16, .paged = true, .block_size = 8});
  ASSERT_EQ(caches.size(), 2u);
  for (const KVCache& cache : caches) {
    EXPECT_EQ(cache.config().batch, 3);
    EXPECT_EQ(cache.config().capacity, kContext);
    EXPECT_EQ(cache.config().kv_heads, 2);
    EXPECT_EQ(cache.config().head_dim, 16);
    EXPECT_EQ(cache.config().dtype, StorageType::float16);
    EXPECT_EQ(cache.free_blocks(), 3 * kContext / 8);
  }
  EXPECT_THROW(model.make_caches({.capacity = kContext + 1}), Error);
  EXPECT_THROW(model.make_caches({.batch = 0}), Error);
}

}  // namespace
}  // namespace qkv::nn
