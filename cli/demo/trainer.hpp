// The demo's training loop state: model, optimizer, data stream, schedule; one step at a
// time, checkpointable, and everything it needs to show what the model learned.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "demo/corpus.hpp"
#include "demo/schedule.hpp"
#include "qkv/nn/adamw.hpp"
#include "qkv/nn/random.hpp"
#include "qkv/nn/transformer.hpp"

namespace qkv::demo {

// Everything that decides the bits of a training run (thread count aside). A
// checkpoint records it, and resuming requires the same.
// Attention health of one head over a training step's batch (qkv/attention_stats.hpp):
// the means over its rows of the largest weight and of the entropy (nats), and the share
// of rows whose largest weight exceeds 0.99.
struct HeadHealth {
  double max_weight = 0, entropy = 0, saturated = 0;
};
using ModelHealth = std::vector<std::vector<HeadHealth>>;  // [layer][head]

struct TrainSettings {
  nn::TransformerConfig model;
  int64_t batch = 0;
  Schedule schedule;
  double weight_decay = 0;
  double clip = 0;
  uint64_t seed = 0;
};

class Trainer {
 public:
  // Initializes the model from `settings.seed`.
  Trainer(const Corpus& corpus, const TrainSettings& settings);

  // One optimizer step on a fresh random batch of training windows; returns its loss.
  double step();
  // Every head's attention health on the last step's batch, with the current parameters:
  // one more forward that asks qkv for its softmax statistics. Its own pass, so the
  // training bits never depend on when (or whether) health is measured.
  ModelHealth health();
  int64_t steps_done() const { return optimizer_.steps(); }
  double last_grad_norm() const { return last_grad_norm_; }
  int64_t parameter_count() const { return nn::count_parameters(parameters_); }

  // Mean loss over up to `max_windows` evenly spaced, fixed windows of `tokens`.
  double evaluate(const std::vector<int32_t>& tokens, int64_t max_windows);

  // `count` characters sampled after `prompt` at `temperature` (> 0).
  std::string generate(const std::string& prompt, int64_t count, double temperature, nn::Rng& rng);

  // Attention probabilities [1, H, n, n] of block `layer` over `text`.
  Tensor<float, 4> attention(const std::string& text, int64_t layer);

  void save(const std::filesystem::path& path) const;
  // Checks the checkpoint's settings against this trainer's (all differences in one
  // qkv::Error), then restores model, optimizer and data stream.
  void resume(const std::filesystem::path& path);

  const TrainSettings& settings() const { return settings_; }

 private:
  std::map<std::string, std::string> settings_metadata() const;

  const Corpus& corpus_;
  TrainSettings settings_;
  nn::Transformer<float> model_;
  nn::ParameterList<float> parameters_;
  nn::AdamW<float> optimizer_;
  nn::Rng data_rng_;
  std::vector<int32_t> inputs_, targets_;
  double last_grad_norm_ = 0;
};

}  // namespace qkv::demo
