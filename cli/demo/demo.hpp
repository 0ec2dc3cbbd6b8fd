// `qkv demo`: train a small character-level decoder-only transformer on a public-domain
// text built into the program (Lewis Carroll's "Alice's Adventures in Wonderland", see
// data/README.md), then show what it learned: generated text, one head's attention as a
// Unicode heatmap, and the final loss next to the text's unigram entropy.
//
// Reproducible: the same options (seed, sizes, steps, threads) give the same bits. The
// learning-rate schedule depends only on `schedule_steps`, never on where a run stops,
// so `--steps N --save f` followed by `--resume f --steps N+M` is bit for bit the run
// `--steps N+M`. A `seconds` budget stops wherever the clock says (not reproducible).
// A stop request (Ctrl-C, see `stop`) ends the run after the step in progress and saves
// it like the end of a run, so resuming it gives the bits of a run never interrupted.
#pragma once

#include <atomic>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>

namespace qkv::demo {

struct DemoOptions {
  uint64_t seed = 1;
  int64_t steps = 1200;         // stop after this many optimizer steps (in total)
  double seconds = 0;           // > 0: also stop when this much training time is spent
  int threads = 0;              // 0: every hardware thread. Results never depend on it.
  std::string save;             // checkpoint to write at the end ("" none)
  int64_t save_every = 0;       // > 0: also write `save` after every this many steps
  std::string resume;           // checkpoint to continue from ("" none)
  // Set from elsewhere (a signal handler): finish the step in progress, save if `save`
  // is given, say where, and return 0 without the generation and the report.
  const std::atomic<bool>* stop = nullptr;

  // Model and training. With `resume`, these must match the checkpoint's.
  int64_t layers = 4;
  int64_t embed_dim = 128;
  int64_t heads = 4;
  int64_t kv_heads = 0;         // 0: = heads
  int64_t context = 64;         // characters per training sequence
  int64_t batch = 16;           // sequences per step
  double lr = 3e-3;             // peak learning rate
  int64_t warmup_steps = 100;   // linear warmup from 0
  int64_t schedule_steps = 1200;  // cosine decay to lr/10 at this step, constant after
  double weight_decay = 0.1;
  double clip = 1.0;            // gradient-norm clipping threshold
  bool unscaled = false;        // logits q·k without the 1/√d scale (heads saturate)

  // What is shown after training.
  int64_t sample_chars = 320;   // generated characters (0: none)
  double temperature = 0.8;
  std::string prompt = "Alice";
  std::string phrase = "said the Queen";  // heatmap phrase ("" : no heatmap)
  int64_t heatmap_layer = -1;   // -1: the head with the most focused attention
  int64_t heatmap_head = -1;
  bool interactive = false;     // redraw the progress bar in place (a terminal)
  // Attention health (how saturated each layer's heads are, from the forward's softmax
  // statistics) with every progress line; the report shows the last one anyway.
  bool health = false;
};

// Runs the demo, writing everything to `out`. Returns 0 on success, also when stopped
// through `stop`. Bad options, an unreadable, corrupt or mismatched checkpoint throw
// qkv::Error.
int run_demo(const DemoOptions& options, std::ostream& out);

// The training text built into the program (LF line endings).
std::string_view demo_text();

}  // namespace qkv::demo
