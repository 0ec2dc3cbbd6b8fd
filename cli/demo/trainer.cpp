#include "demo/trainer.hpp"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <string>

#include "demo/check.hpp"
#include "qkv/nn/checkpoint.hpp"
#include "qkv/nn/clip.hpp"

namespace qkv::demo {
namespace {

// Separate streams for initialization, batches and (in demo.cpp) sampling, so changing
// how one is used never shifts the others.
constexpr uint64_t kDataStream = 0x6461746173747265ULL;  // "datastre"

std::string exact(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", value);
  return text;
}

std::string hex_state(const nn::Rng::State& state) {
  std::string text;
  for (uint64_t word : state) {
    char buffer[17];
    std::snprintf(buffer, sizeof buffer, "%016" PRIx64, word);
    text += buffer;
  }
  return text;
}

nn::Rng::State parse_state(const std::string& text, const std::string& what) {
  nn::Rng::State state{};
  bool ok = text.size() == 64 &&
            text.find_first_not_of("0123456789abcdef") == std::string::npos;
  for (std::size_t i = 0; ok && i < 4; ++i) {
    state[i] = std::stoull(text.substr(16 * i, 16), nullptr, 16);
  }
  if (!ok) throw Error(what + ": metadata \"demo.data_rng\" is not 64 hex digits");
  return state;
}

}  // namespace

Trainer::Trainer(const Corpus& corpus, const TrainSettings& settings)
    : corpus_(corpus),
      settings_(settings),
      model_(settings.model),
      parameters_(model_.parameters()),
      optimizer_(parameters_, nn::AdamWConfig{.lr = settings.schedule.peak,
                                          .beta1 = 0.9,
                                          .beta2 = 0.95,
                                          .eps = 1e-8,
                                          .weight_decay = settings.weight_decay}),
      data_rng_(settings.seed ^ kDataStream) {
  expect(static_cast<int64_t>(corpus.train().size()) > settings.model.context + 1, "demo",
         "context: the training text is shorter than one window");
  nn::Rng init(settings.seed);
  model_.reset_parameters(init);
}

double Trainer::step() {
  const int64_t batch = settings_.batch, seq = settings_.model.context;
  const auto& text = corpus_.train();
  inputs_.resize(static_cast<std::size_t>(batch * seq));
  targets_.resize(inputs_.size());
  const auto windows = static_cast<uint64_t>(text.size()) - static_cast<uint64_t>(seq);
  for (int64_t b = 0; b < batch; ++b) {
    const auto start = static_cast<std::ptrdiff_t>(data_rng_.below(windows));
    std::copy_n(text.begin() + start, seq, inputs_.begin() + b * seq);
    std::copy_n(text.begin() + start + 1, seq, targets_.begin() + b * seq);
  }
  nn::zero_grad(parameters_);
  const double loss = model_.forward_loss(inputs_, targets_, batch, seq);
  model_.backward();
  last_grad_norm_ = nn::clip_grad_norm(parameters_, settings_.clip);
  optimizer_.step(settings_.schedule.at(optimizer_.steps()));
  return loss;
}

ModelHealth Trainer::health() {
  const int64_t batch = settings_.batch, seq = settings_.model.context;
  const int64_t layers = settings_.model.num_layers, heads = settings_.model.num_heads;
  if (inputs_.empty()) return {};  // no step yet
  ModelHealth health(static_cast<std::size_t>(layers), std::vector<HeadHealth>(heads));
  // Per layer, [B, H] views its forward fills, then averaged over the batch (every row
  // of a causal self-attention sees a key, so each entry counts `seq` rows).
  std::vector<Tensor<float, 2>> max_weight, entropy, saturated;
  std::vector<AttentionStats<float>> views;
  views.reserve(static_cast<std::size_t>(layers));
  for (int64_t l = 0; l < layers; ++l) {
    max_weight.emplace_back(Tensor<float, 2>::Shape{batch, heads});
    entropy.emplace_back(Tensor<float, 2>::Shape{batch, heads});
    saturated.emplace_back(Tensor<float, 2>::Shape{batch, heads});
    views.push_back({.max_weight_mean = max_weight.back().view(),
                     .entropy_mean = entropy.back().view(),
                     .saturated_share = saturated.back().view()});
  }
  for (int64_t l = 0; l < layers; ++l) model_.blocks[l].attn.stats = &views[l];
  model_.forward_loss(inputs_, targets_, batch, seq);
  for (auto& block : model_.blocks) block.attn.stats = nullptr;
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t h = 0; h < heads; ++h) {
      HeadHealth& head = health[l][h];
      for (int64_t b = 0; b < batch; ++b) {
        head.max_weight += max_weight[l](b, h) / static_cast<double>(batch);
        head.entropy += entropy[l](b, h) / static_cast<double>(batch);
        head.saturated += saturated[l](b, h) / static_cast<double>(batch);
      }
    }
  return health;
}

double Trainer::evaluate(const std::vector<int32_t>& tokens, int64_t max_windows) {
  const int64_t seq = settings_.model.context;
  const int64_t available = static_cast<int64_t>(tokens.size()) - 1 - seq;
  if (available < 0 || max_windows < 1) return NAN;
  const int64_t count = std::min<int64_t>(max_windows, available / seq + 1);
  double total = 0;
  int64_t done = 0;
  while (done < count) {
    const int64_t batch = std::min<int64_t>(settings_.batch, count - done);
    std::vector<int32_t> inputs(static_cast<std::size_t>(batch * seq)), targets(inputs.size());
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t k = done + b;
      const int64_t start = count > 1 ? k * available / (count - 1) : 0;
      std::copy_n(tokens.begin() + start, seq, inputs.begin() + b * seq);
      std::copy_n(tokens.begin() + start + 1, seq, targets.begin() + b * seq);
    }
    total += model_.forward_loss(inputs, targets, batch, seq) * static_cast<double>(batch);
    done += batch;
  }
  return total / static_cast<double>(count);
}

std::string Trainer::generate(const std::string& prompt, int64_t count, double temperature,
                              nn::Rng& rng) {
  expect(temperature > 0, "demo", "temperature: expected > 0, got " + std::to_string(temperature));
  std::vector<int32_t> ids = corpus_.encode(prompt, "prompt");
  expect(!ids.empty(), "demo", "prompt: expected at least one character");
  const int64_t context = settings_.model.context, vocab = corpus_.vocab_size();
  std::string out;
  std::vector<double> weights(static_cast<std::size_t>(vocab));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = std::min<int64_t>(context, static_cast<int64_t>(ids.size()));
    const std::span<const int32_t> window(ids.data() + ids.size() - n, static_cast<std::size_t>(n));
    const nn::Matrix<const float> logits = model_.forward(window, 1, n);
    // p ∝ exp((z − max)/T), sampled by inverting the cumulative sum.
    double max = -INFINITY;
    for (int64_t v = 0; v < vocab; ++v) max = std::max(max, static_cast<double>(logits(n - 1, v)));
    double sum = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      weights[v] = std::exp((static_cast<double>(logits(n - 1, v)) - max) / temperature);
      sum += weights[v];
    }
    double u = rng.uniform() * sum;
    int32_t next = static_cast<int32_t>(vocab - 1);
    for (int64_t v = 0; v < vocab; ++v) {
      u -= weights[v];
      if (u < 0) {
        next = static_cast<int32_t>(v);
        break;
      }
    }
    ids.push_back(next);
    out += corpus_.decode(next);
  }
  return out;
}

Tensor<float, 4> Trainer::attention(const std::string& text, int64_t layer) {
  std::vector<int32_t> ids = corpus_.encode(text, "phrase");
  expect(!ids.empty() && static_cast<int64_t>(ids.size()) <= settings_.model.context, "demo",
         "phrase: expected 1 to " + std::to_string(settings_.model.context) +
             " characters, got " + std::to_string(ids.size()));
  return model_.attention_weights(ids, layer);
}

std::map<std::string, std::string> Trainer::settings_metadata() const {
  const auto& m = settings_.model;
  return {
      {"demo.vocab", corpus_.vocab()},
      {"demo.text_chars", std::to_string(corpus_.text_size())},
      {"demo.layers", std::to_string(m.num_layers)},
      {"demo.embed_dim", std::to_string(m.embed_dim)},
      {"demo.heads", std::to_string(m.num_heads)},
      {"demo.kv_heads", std::to_string(m.num_kv_heads == 0 ? m.num_heads : m.num_kv_heads)},
      {"demo.mlp_dim", std::to_string(m.mlp_dim == 0 ? 4 * m.embed_dim : m.mlp_dim)},
      {"demo.context", std::to_string(m.context)},
      {"demo.batch", std::to_string(settings_.batch)},
      {"demo.lr", exact(settings_.schedule.peak)},
      {"demo.warmup_steps", std::to_string(settings_.schedule.warmup)},
      {"demo.schedule_steps", std::to_string(settings_.schedule.total)},
      {"demo.weight_decay", exact(settings_.weight_decay)},
      {"demo.clip", exact(settings_.clip)},
      {"demo.seed", std::to_string(settings_.seed)},
      {"demo.attention_scale", m.attention_scale ? exact(*m.attention_scale) : "1/sqrt(d)"},
  };
}

void Trainer::save(const std::filesystem::path& path) const {
  auto metadata = settings_metadata();
  metadata["demo.data_rng"] = hex_state(data_rng_.state());
  nn::save_checkpoint(path, parameters_, optimizer_, metadata);
}

void Trainer::resume(const std::filesystem::path& path) {
  const std::string what = "checkpoint " + path.string();
  const auto stored = nn::read_checkpoint_metadata(path);
  std::string differences;
  for (const auto& [key, value] : settings_metadata()) {
    const auto found = stored.find(key);
    const std::string name = key.substr(5);  // without "demo."
    // Checkpoints from before --unscaled existed were trained with the default scale.
    if (found == stored.end() && key == "demo.attention_scale" && value == "1/sqrt(d)") continue;
    if (found == stored.end()) {
      differences += "\n  " + name + ": missing from the checkpoint (this run: " + value + ")";
    } else if (found->second != value) {
      const bool long_value = name == "vocab";
      differences += "\n  " + name + ": checkpoint " +
                     (long_value ? "has another character set" : found->second) +
                     (long_value ? "" : ", this run " + value);
    }
  }
  if (!differences.empty()) {
    throw Error(what + " does not match this run's settings:" + differences +
                "\nResume with the settings it was trained with, or train from scratch.");
  }
  const auto rng = stored.find("demo.data_rng");
  if (rng == stored.end()) throw Error(what + ": metadata \"demo.data_rng\" is missing");
  nn::Rng restored;
  restored.set_state(parse_state(rng->second, what));
  nn::load_checkpoint(path, parameters_, optimizer_);
  data_rng_ = restored;
}

}  // namespace qkv::demo
