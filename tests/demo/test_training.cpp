// Training end to end: the loss falls within 50 steps; runs are reproducible; a run
// stopped, saved and resumed is bit for bit the uninterrupted run; the demo's report.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "demo/corpus.hpp"
#include "demo/demo.hpp"
#include "demo/trainer.hpp"
#include "nn_test_support.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/threads.hpp"

namespace qkv::demo {
namespace {

using nn::set_threads;

namespace fs = std::filesystem;

// Small enough for a test (≈ 40k parameters, 256 characters a step), big enough to learn.
DemoOptions small_options() {
  DemoOptions o;
  o.layers = 2;
  o.embed_dim = 32;
  o.heads = 4;
  o.context = 32;
  o.batch = 8;
  o.lr = 1e-2;
  o.warmup_steps = 5;
  o.schedule_steps = 60;
  o.threads = 2;
  o.sample_chars = 0;
  o.phrase = "";
  return o;
}

TrainSettings settings_of(const DemoOptions& o, int64_t vocab) {
  TrainSettings s;
  s.model = {.vocab_size = vocab, .context = o.context, .embed_dim = o.embed_dim,
             .num_heads = o.heads, .num_layers = o.layers, .execution = {.threads = o.threads}};
  s.batch = o.batch;
  s.schedule = {.peak = o.lr, .warmup = o.warmup_steps, .total = o.schedule_steps};
  s.weight_decay = o.weight_decay;
  s.clip = o.clip;
  s.seed = o.seed;
  return s;
}

std::vector<char> file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

TEST(Training, FiftyStepsLowerTheLoss) {
  set_threads(2);
  const Corpus corpus(demo_text(), 0.1);
  const DemoOptions o = small_options();
  Trainer trainer(corpus, settings_of(o, corpus.vocab_size()));
  std::vector<double> losses;
  for (int i = 0; i < 50; ++i) losses.push_back(trainer.step());
  const double first = std::accumulate(losses.begin(), losses.begin() + 5, 0.0) / 5;
  const double last = std::accumulate(losses.end() - 5, losses.end(), 0.0) / 5;
  // Start: ≈ ln 72 = 4.28 (uniform over the alphabet). In 50 steps this model learns
  // at least the character frequencies: the unigram entropy is 3.12 nats. Margins are
  // wide (measured: ≈ 4.2 → ≈ 2.5): failing means training is broken, not unlucky.
  EXPECT_NEAR(first, std::log(72.0), 0.3);
  EXPECT_LT(last, corpus.unigram_entropy());
  EXPECT_LT(last, first - 1.0);
  const double held_out = trainer.evaluate(corpus.held_out(), 32);
  EXPECT_LT(held_out, corpus.unigram_entropy());
}

TEST(Training, SameSeedSameBits) {
  set_threads(2);
  const Corpus corpus(demo_text(), 0.1);
  const DemoOptions o = small_options();
  Trainer a(corpus, settings_of(o, corpus.vocab_size()));
  Trainer b(corpus, settings_of(o, corpus.vocab_size()));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(a.step(), b.step()) << "step " << i;
  DemoOptions other = o;
  other.seed = 2;
  Trainer c(corpus, settings_of(other, corpus.vocab_size()));
  EXPECT_NE(c.step(), Trainer(corpus, settings_of(o, corpus.vocab_size())).step());
}

TEST(Training, ResultsDoNotDependOnTheThreadCount) {
  // GEMM blocks, element-wise blocks and the attention kernels are all split by shape,
  // never by thread count, so 1 and 3 threads must agree to the bit.
  const Corpus corpus(demo_text(), 0.1);
  std::vector<double> losses[2];
  std::vector<float> head_weights[2];
  const int counts[2] = {1, 3};
  for (int run = 0; run < 2; ++run) {
    DemoOptions o = small_options();
    o.threads = counts[run];
    set_threads(o.threads);
    Trainer trainer(corpus, settings_of(o, corpus.vocab_size()));
    for (int i = 0; i < 4; ++i) losses[run].push_back(trainer.step());
    const Tensor<float, 4> w = trainer.attention("the Queen", 1);
    head_weights[run].assign(w.data(), w.data() + w.size());
  }
  set_threads(2);
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(head_weights[0], head_weights[1]);
}

TEST(Training, ResumedRunIsBitForBitTheUninterruptedOne) {
  const fs::path straight = nn::testing::temp_path("qkv_nn_straight");
  const fs::path half = nn::testing::temp_path("qkv_nn_half");
  const fs::path resumed = nn::testing::temp_path("qkv_nn_resumed");
  std::ostringstream log;

  DemoOptions o = small_options();
  o.steps = 24;  // N + M
  o.save = straight.string();
  ASSERT_EQ(run_demo(o, log), 0);

  o.steps = 10;  // N
  o.save = half.string();
  ASSERT_EQ(run_demo(o, log), 0);

  o.steps = 24;  // resume, then M = 14 more
  o.resume = half.string();
  o.save = resumed.string();
  ASSERT_EQ(run_demo(o, log), 0);

  // Parameters, AdamW moments and step, data-stream state, settings: every byte.
  const auto a = file_bytes(straight), b = file_bytes(resumed);
  ASSERT_GT(a.size(), 100'000u);
  EXPECT_TRUE(a == b) << "the resumed checkpoint differs from the uninterrupted one";
  EXPECT_FALSE(file_bytes(half) == a);

  // A resume with other settings is refused, naming every difference.
  DemoOptions mismatched = o;
  mismatched.layers = 3;
  mismatched.lr = 0.5;
  try {
    run_demo(mismatched, log);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("layers: checkpoint 2, this run 3"), std::string::npos) << message;
    EXPECT_NE(message.find("lr: checkpoint 0.01"), std::string::npos) << message;
  }
  DemoOptions missing = o;
  missing.resume = nn::testing::temp_path("qkv_nn_no_such").string();
  EXPECT_THROW(run_demo(missing, log), Error);
  for (const auto& p : {straight, half, resumed}) fs::remove(p);
}

TEST(Training, SaveEveryKeepsTheRunsBits) {
  const fs::path every = nn::testing::temp_path("qkv_demo_every");
  const fs::path plain = nn::testing::temp_path("qkv_demo_plain");
  std::ostringstream log;
  DemoOptions o = small_options();
  o.layers = 1;
  o.embed_dim = 16;
  o.context = 16;
  o.steps = 10;
  o.save = plain.string();
  ASSERT_EQ(run_demo(o, log), 0);
  o.save = every.string();
  o.save_every = 4;
  std::ostringstream out;
  ASSERT_EQ(run_demo(o, out), 0);
  for (const int step : {4, 8, 10}) {
    const std::string line = "saved    " + every.string() + " (step " + std::to_string(step) + ")";
    EXPECT_NE(out.str().find(line), std::string::npos) << line << "\n" << out.str();
  }
  EXPECT_EQ(out.str().find("(step 12)"), std::string::npos);
  // Saving along the way changes nothing in the run.
  EXPECT_TRUE(file_bytes(every) == file_bytes(plain));

  // A stop requested before training (a signal during start-up) saves the start.
  const std::atomic<bool> stop{true};
  o.stop = &stop;
  o.save_every = 0;
  std::ostringstream stopped;
  ASSERT_EQ(run_demo(o, stopped), 0);
  EXPECT_NE(stopped.str().find("stopped  at step 0 of 10 on request"), std::string::npos)
      << stopped.str();
  EXPECT_NE(stopped.str().find("(step 0)"), std::string::npos) << stopped.str();

  DemoOptions bad = small_options();
  bad.save_every = 5;  // and no save
  try {
    run_demo(bad, log);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("save_every: needs save"), std::string::npos) << e.what();
  }
  for (const auto& p : {every, plain}) fs::remove(p);
}

TEST(Training, DemoReportsWhatTheIssueAsksFor) {
  DemoOptions o = small_options();
  o.steps = 6;
  o.sample_chars = 40;
  o.phrase = "the Queen";
  std::ostringstream out;
  ASSERT_EQ(run_demo(o, out), 0);
  const std::string text = out.str();
  for (const char* needle : {"step 6/6", "tok/s", "Generated (prompt \"Alice\"", "Attention of layer",
                             "██ ≥ 0.65", "unigram entropy of the text   3.12", "held-out loss",
                             "training loss", "throughput"}) {
    EXPECT_NE(text.find(needle), std::string::npos) << needle << "\n" << text;
  }
  DemoOptions bad = small_options();
  bad.steps = 1;
  bad.prompt = "Alice ∀";
  EXPECT_THROW(run_demo(bad, out), Error);
  bad = small_options();
  bad.threads = -1;
  EXPECT_THROW(run_demo(bad, out), Error);
}

// Measuring attention health changes no bit of training; without the 1/√d scale the
// heads are more saturated than with it (the demo's --unscaled), and the demo prints the
// per-layer, per-head table.
TEST(Training, AttentionHealthIsFreeAndShowsUnscaledSaturation) {
  set_threads(2);
  const DemoOptions o = small_options();
  const Corpus corpus(demo_text(), 0.1);
  Trainer measured(corpus, settings_of(o, corpus.vocab_size()));
  Trainer plain(corpus, settings_of(o, corpus.vocab_size()));
  ModelHealth health;
  for (int step = 0; step < 4; ++step) {
    const double a = measured.step();
    health = measured.health();
    const double b = plain.step();
    EXPECT_EQ(a, b) << "step " << step;
  }
  ASSERT_EQ(health.size(), 2u);
  ASSERT_EQ(health[0].size(), 4u);
  for (const auto& layer : health)
    for (const HeadHealth& head : layer) {
      // Causal rows see 1..32 keys: the mean largest weight lies in (1/32, 1].
      EXPECT_GT(head.max_weight, 1.0 / 32);
      EXPECT_LE(head.max_weight, 1.0);
      EXPECT_GE(head.entropy, 0.0);
      EXPECT_LE(head.entropy, std::log(32.0));
      EXPECT_GE(head.saturated, 1.0 / 32 - 1e-6);  // row 0 sees one key: weight 1
    }

  // Unscaled logits (q·k instead of q·k/√8) after a few steps: sharper heads.
  DemoOptions unscaled_options = o;
  unscaled_options.unscaled = true;
  TrainSettings unscaled_settings = settings_of(o, corpus.vocab_size());
  unscaled_settings.model.attention_scale = 1.0;
  Trainer scaled(corpus, settings_of(o, corpus.vocab_size())), unscaled(corpus, unscaled_settings);
  ModelHealth with_scale, without_scale;
  for (int step = 0; step < 30; ++step) {
    scaled.step();
    unscaled.step();
  }
  with_scale = scaled.health();
  without_scale = unscaled.health();
  double entropy_scaled = 0, entropy_unscaled = 0;
  for (std::size_t l = 0; l < 2; ++l)
    for (std::size_t h = 0; h < 4; ++h) {
      entropy_scaled += with_scale[l][h].entropy;
      entropy_unscaled += without_scale[l][h].entropy;
    }
  EXPECT_LT(entropy_unscaled, entropy_scaled);

  unscaled_options.steps = 4;
  unscaled_options.health = true;
  std::ostringstream out;
  ASSERT_EQ(run_demo(unscaled_options, out), 0);
  for (const char* needle : {"scale    none", "attention health at step 4", "layer 0", "layer 1"})
    EXPECT_NE(out.str().find(needle), std::string::npos) << needle << "\n" << out.str();
}

TEST(Corpus, VocabularySplitAndEntropy) {
  const Corpus corpus(demo_text(), 0.1);
  EXPECT_EQ(corpus.text_size(), 148476);
  EXPECT_EQ(corpus.vocab_size(), 72);
  EXPECT_EQ(corpus.held_out().size(), 14848u);
  EXPECT_NEAR(corpus.unigram_entropy(), 3.12, 0.01);
  EXPECT_EQ(demo_text().substr(demo_text().size() - 8), "THE END\n");
  const auto ids = corpus.encode("Alice", "test");
  std::string back;
  for (int32_t id : ids) back += corpus.decode(id);
  EXPECT_EQ(back, "Alice");
}

}  // namespace
}  // namespace qkv::demo
