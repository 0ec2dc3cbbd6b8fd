// `qkv demo`: describe the run, train, save, generate, show attention, report.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "demo/check.hpp"
#include "demo/corpus.hpp"
#include "demo/display.hpp"
#include "demo/trainer.hpp"
#include "qkv/attention.hpp"
#include "demo/demo.hpp"
#include "qkv/nn/threads.hpp"

namespace qkv::demo {
namespace {

using Clock = std::chrono::steady_clock;

constexpr double kHeldOutFraction = 0.1;   // the last 10% of the book is never trained on
constexpr int64_t kEvalWindows = 128;      // fixed windows of the final held-out loss
constexpr uint64_t kSampleStream = 0x73616d706c696e67ULL;  // "sampling"

std::string fixed(double value, int digits) {
  char text[32];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

void check_options(const DemoOptions& o) {
  const std::string fn = "run_demo";
  auto positive = [&](int64_t value, const char* name) {
    expect(value >= 1, fn, std::string(name) + ": expected ≥ 1, got " + std::to_string(value));
  };
  expect(o.steps >= 0, fn, "steps: expected ≥ 0, got " + std::to_string(o.steps));
  expect(o.seconds >= 0 && std::isfinite(o.seconds), fn,
                 "seconds: expected ≥ 0, got " + std::to_string(o.seconds));
  expect(o.threads >= 0, fn, "threads: expected ≥ 0, got " + std::to_string(o.threads));
  expect(o.save_every >= 0, fn, "save_every: expected ≥ 0, got " + std::to_string(o.save_every));
  expect(o.save_every == 0 || !o.save.empty(), fn,
         "save_every: needs save, the checkpoint file to write");
  positive(o.layers, "layers");
  positive(o.embed_dim, "embed_dim");
  positive(o.heads, "heads");
  positive(o.context, "context");
  positive(o.batch, "batch");
  positive(o.schedule_steps, "schedule_steps");
  expect(o.kv_heads >= 0, fn, "kv_heads: expected ≥ 0, got " + std::to_string(o.kv_heads));
  expect(o.warmup_steps >= 0, fn,
                 "warmup_steps: expected ≥ 0, got " + std::to_string(o.warmup_steps));
  expect(o.lr > 0 && std::isfinite(o.lr), fn, "lr: expected > 0, got " + std::to_string(o.lr));
  expect(o.weight_decay >= 0, fn,
                 "weight_decay: expected ≥ 0, got " + std::to_string(o.weight_decay));
  expect(o.clip > 0, fn, "clip: expected > 0, got " + std::to_string(o.clip));
  expect(o.sample_chars >= 0, fn,
                 "sample_chars: expected ≥ 0, got " + std::to_string(o.sample_chars));
  expect(o.temperature > 0, fn,
                 "temperature: expected > 0, got " + std::to_string(o.temperature));
}

// The (layer, head) whose attention over the phrase is most focused: the highest mean
// top weight per row (rows after the first, which can only see itself).
std::pair<int64_t, int64_t> pick_head(Trainer& trainer, const std::string& phrase,
                                      int64_t layers, int64_t heads, double& focus) {
  std::pair<int64_t, int64_t> best{0, 0};
  focus = -1;
  for (int64_t l = 0; l < layers; ++l) {
    const Tensor<float, 4> w = trainer.attention(phrase, l);
    const int64_t n = w.shape()[2];
    for (int64_t h = 0; h < heads; ++h) {
      double sum = 0;
      for (int64_t i = 1; i < n; ++i) {
        float top = 0;
        for (int64_t j = 0; j <= i; ++j) top = std::max(top, w(0, h, i, j));
        sum += top;
      }
      const double mean = n > 1 ? sum / static_cast<double>(n - 1) : 1.0;
      if (mean > focus) {
        focus = mean;
        best = {l, h};
      }
    }
  }
  return best;
}

// The model and training settings the options describe.
TrainSettings settings_for(const DemoOptions& options, const Corpus& corpus) {
  TrainSettings settings;
  settings.model = nn::TransformerConfig{.vocab_size = corpus.vocab_size(),
                                     .context = options.context,
                                     .embed_dim = options.embed_dim,
                                     .num_heads = options.heads,
                                     .num_kv_heads = options.kv_heads,
                                     .num_layers = options.layers,
                                     .mlp_dim = 0,
                                     .execution = {.backend = Backend::automatic,
                                                   .threads = options.threads}};
  if (options.unscaled) settings.model.attention_scale = 1.0;
  settings.batch = options.batch;
  settings.schedule = {.peak = options.lr, .warmup = options.warmup_steps,
                       .total = options.schedule_steps};
  settings.weight_decay = options.weight_decay;
  settings.clip = options.clip;
  settings.seed = options.seed;
  return settings;
}

// What is shown after training is checked before any time is spent training.
void check_display_options(const DemoOptions& options, const Corpus& corpus) {
  const std::string fn = "run_demo";
  corpus.encode(options.prompt, "prompt");
  corpus.encode(options.phrase, "phrase");
  expect(!options.prompt.empty(), fn, "prompt: expected at least one character");
  expect(static_cast<int64_t>(options.phrase.size()) <= options.context, fn,
                 "phrase: expected at most " + std::to_string(options.context) +
                     " characters (the context), got " + std::to_string(options.phrase.size()));
  expect(options.heatmap_layer < options.layers, fn,
                 "heatmap_layer: expected < " + std::to_string(options.layers) + ", got " +
                     std::to_string(options.heatmap_layer));
  expect(options.heatmap_head < options.heads, fn,
                 "heatmap_head: expected < " + std::to_string(options.heads) + ", got " +
                     std::to_string(options.heatmap_head));
}

std::string plural(int64_t count, const char* word) {
  return std::to_string(count) + " " + word + (count == 1 ? "" : "s");
}

void describe(std::ostream& out, const DemoOptions& options, const Corpus& corpus,
              const Trainer& trainer) {
  const AttentionOptions attention{.execution = trainer.settings().model.execution};
  const Backend backend = resolve_backend(attention, /*is_double=*/false, false);
  const int64_t kv_heads = options.kv_heads == 0 ? options.heads : options.kv_heads;
  out << "qkv demo: a character-level transformer learns \"Alice's Adventures in Wonderland\"\n"
      << "  text     Lewis Carroll, 1865 (public domain): " << corpus.text_size()
      << " characters, " << corpus.vocab_size() << " distinct; last "
      << fixed(100 * kHeldOutFraction, 0) << "% held out\n"
      << "  model    " << plural(options.layers, "layer") << " × " << options.embed_dim
      << " wide, " << plural(options.heads, "head") << " of " << options.embed_dim / options.heads;
  if (kv_heads != options.heads) out << " (" << kv_heads << " key/value heads, GQA)";
  out << ", context " << options.context << ", "
      << si(static_cast<double>(trainer.parameter_count())) << " parameters\n"
      << "  train    " << options.batch << " × " << options.context
      << " characters a step, AdamW lr " << options.lr << " (warmup " << options.warmup_steps
      << ", cosine to step " << options.schedule_steps << "), seed " << options.seed << ", "
      << plural(options.threads, "thread") << "\n";
  if (options.unscaled) {
    out << "  scale    none: logits q·k are not divided by √" << options.embed_dim / options.heads
        << " (--unscaled; watch the heads saturate)\n";
  }
  out
      << "  kernels  attention: qkv " << (backend == Backend::cpu ? "cpu" : "reference")
      << " backend; GEMM: " << nn::blas_kernels() << "\n";
  if (!options.resume.empty()) {
    out << "  resumed  from " << options.resume << " at step " << trainer.steps_done() << "\n";
  }
  out << "\n";
}

struct TrainingRun {
  int64_t steps = 0;           // steps taken in this run
  double seconds = 0;          // their wall time
  std::vector<double> losses;  // one per step
  bool stopped = false;        // by options.stop, before the target
  ModelHealth health;          // of the last measured step (at the progress lines)
  int64_t health_step = 0;
};

// Per layer and head: mean largest weight / entropy in nats / share of saturated rows.
void show_health(std::ostream& out, const ModelHealth& health, int64_t step, int64_t context) {
  out << "  attention health at step " << step
      << ", per head: mean largest weight / entropy (nats) / rows with largest weight > 0.99\n"
      << "  (uniform over n keys: 1/n and ln n; collapsed: 1 and 0; the first character sees\n"
      << "  only itself, so at least 1/" << context << " of the rows count as saturated)\n";
  for (std::size_t l = 0; l < health.size(); ++l) {
    out << "    layer " << l << " ";
    for (const HeadHealth& head : health[l]) {
      const std::string share = fixed(100 * head.saturated, 0) + "%";
      out << "  " << fixed(head.max_weight, 2) << " / " << fixed(head.entropy, 2) << " / "
          << std::string(share.size() < 4 ? 4 - share.size() : 0, ' ') << share;
    }
    out << "\n";
  }
}

bool stop_requested(const DemoOptions& options) {
  return options.stop != nullptr && options.stop->load(std::memory_order_relaxed);
}

void save(std::ostream& out, const DemoOptions& options, const Trainer& trainer) {
  trainer.save(options.save);
  out << "  saved    " << options.save << " (step " << trainer.steps_done() << ")\n";
}

// Steps until options.steps (or the time budget, or a stop request between two steps),
// drawing the progress bar and saving every options.save_every steps.
TrainingRun train(std::ostream& out, const DemoOptions& options, Trainer& trainer) {
  const int64_t first = trainer.steps_done();
  const int64_t target = std::max(first, options.steps);
  const double tokens_per_step = static_cast<double>(options.batch * options.context);
  const int64_t print_every = std::max<int64_t>(1, (target - first) / 10);
  TrainingRun run;
  const auto start = Clock::now();
  auto last_draw = start;
  while (trainer.steps_done() < target) {
    if (stop_requested(options)) {
      run.stopped = true;
      break;
    }
    const double loss = trainer.step();
    if (!std::isfinite(loss)) {
      throw Error("qkv::demo::run_demo: the loss became " + std::to_string(loss) + " at step " +
                  std::to_string(trainer.steps_done()) + " (try a lower --lr)");
    }
    run.losses.push_back(loss);
    ++run.steps;
    const auto now = Clock::now();
    run.seconds = std::chrono::duration<double>(now - start).count();
    const bool finished = trainer.steps_done() == target ||
                          (options.seconds > 0 && run.seconds >= options.seconds);
    const double rate = static_cast<double>(run.steps) * tokens_per_step / std::max(run.seconds, 1e-9);
    const std::string line =
        progress_line(trainer.steps_done(), target, loss, rate, run.seconds);
    if (options.interactive) {
      // Redrawn in place at most 10 times a second: \r returns to the line's start and
      // ESC[K clears what a longer line left.
      if (finished || std::chrono::duration<double>(now - last_draw).count() > 0.1) {
        out << "\r  " << line << "\033[K" << (finished ? "\n" : "") << std::flush;
        last_draw = now;
      }
    } else if (finished || run.steps % print_every == 0) {
      out << "  " << line << "\n" << std::flush;
    }
    // The heads' health after the steps that print a progress line, and the last one.
    if (finished || run.steps % print_every == 0) {
      run.health = trainer.health();
      run.health_step = trainer.steps_done();
      if (options.health) {
        if (options.interactive && !finished) out << "\r\033[K";
        show_health(out, run.health, run.health_step, options.context);
      }
    }
    if (finished) break;
    if (options.save_every > 0 && trainer.steps_done() % options.save_every == 0) {
      if (options.interactive) out << "\r\033[K";  // the bar is redrawn at the next step
      save(out, options, trainer);
    }
  }
  if (run.stopped) {
    if (options.interactive) out << "\n";
    out << "  stopped  at step " << trainer.steps_done() << " of " << target
        << " on request (Ctrl-C)\n";
  } else if (options.seconds > 0 && trainer.steps_done() < target) {
    out << "  stopped at step " << trainer.steps_done() << ": the " << options.seconds
        << " s budget is spent (a time budget is not reproducible; --steps is)\n";
  }
  return run;
}

void show_generation(std::ostream& out, const DemoOptions& options, Trainer& trainer) {
  nn::Rng sampler(options.seed ^ kSampleStream);
  const std::string text =
      trainer.generate(options.prompt, options.sample_chars, options.temperature, sampler);
  out << "\nGenerated (prompt \"" << options.prompt << "\", temperature " << options.temperature
      << "):\n\n    " << options.prompt;
  for (const char c : text) out << (c == '\n' ? std::string("\n    ") : std::string(1, c));
  out << "\n";
}

void show_attention(std::ostream& out, const DemoOptions& options, Trainer& trainer) {
  int64_t layer = options.heatmap_layer, head = options.heatmap_head;
  std::string why;
  if (layer < 0 || head < 0) {
    double focus = 0;
    std::tie(layer, head) = pick_head(trainer, options.phrase, options.layers, options.heads, focus);
    why = ", the most focused head (mean top weight " + fixed(focus, 2) + ")";
  }
  out << "\nAttention of layer " << layer << ", head " << head << why << ",\nover \""
      << options.phrase << "\" (each row: where that character looks):\n\n";
  draw_heatmap(out, trainer.attention(options.phrase, layer), head, options.phrase);
}

void report(std::ostream& out, const DemoOptions& options, const Corpus& corpus,
            Trainer& trainer, const TrainingRun& run) {
  constexpr std::size_t kRecent = 20;  // the training loss averages this many steps
  const double entropy = corpus.unigram_entropy();
  const double held_out = trainer.evaluate(corpus.held_out(), kEvalWindows);
  out << "\nResult after " << trainer.steps_done() << " steps:\n"
      << "  unigram entropy of the text   " << fixed(entropy, 3) << " nats/char ("
      << fixed(entropy / std::log(2.0), 2) << " bits): the loss of a model that ignores context\n";
  if (!run.losses.empty()) {
    const std::size_t count = std::min(kRecent, run.losses.size());
    double sum = 0;
    for (std::size_t i = run.losses.size() - count; i < run.losses.size(); ++i) sum += run.losses[i];
    out << "  training loss                 " << fixed(sum / static_cast<double>(count), 3)
        << " nats/char (mean of the last " << count << " steps)\n";
  }
  out << "  held-out loss                 " << fixed(held_out, 3) << " nats/char ("
      << fixed(held_out / std::log(2.0), 2) << " bits), on the last "
      << fixed(100 * kHeldOutFraction, 0) << "% of the book\n";
  if (run.steps > 0) {
    const double tokens = static_cast<double>(run.steps * options.batch * options.context);
    out << "  throughput                    " << si(tokens / run.seconds) << " tokens/s ("
        << run.steps << " steps in " << fixed(run.seconds, 1) << " s, "
        << plural(options.threads, "thread") << ")\n";
  }
  if (!run.health.empty() && !options.health) {
    show_health(out, run.health, run.health_step, options.context);
  }
}

}  // namespace

int run_demo(const DemoOptions& requested, std::ostream& out) {
  check_options(requested);
  DemoOptions options = requested;
  if (options.threads == 0) {
    options.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  nn::set_threads(options.threads);
  const Corpus corpus(demo_text(), kHeldOutFraction);
  check_display_options(options, corpus);

  Trainer trainer(corpus, settings_for(options, corpus));
  if (!options.resume.empty()) trainer.resume(options.resume);
  describe(out, options, corpus, trainer);

  const TrainingRun run = train(out, options, trainer);
  if (!options.save.empty()) save(out, options, trainer);
  if (run.stopped || stop_requested(options)) {
    // The checkpoint holds every bit of the state after the last finished step, so
    // resuming it continues exactly as the uninterrupted run would have.
    if (!run.stopped) {
      out << "  stopped  on request (Ctrl-C) after training, before the samples\n";
    } else if (options.save.empty()) {
      out << "  nothing saved (no --save); the run cannot be resumed\n";
    } else {
      out << "  resume   with --resume " << options.save << " and the same settings\n";
    }
    out << std::flush;
    return 0;
  }
  if (options.sample_chars > 0) show_generation(out, options, trainer);
  if (!options.phrase.empty()) show_attention(out, options, trainer);
  report(out, options, corpus, trainer, run);
  return 0;
}

}  // namespace qkv::demo
