// qkv demo: train a small character-level transformer on "Alice's Adventures in
// Wonderland" (built into the library), then show generated text, one head's attention
// as a heatmap, and the final loss next to the text's unigram entropy.
// The work is qkv::nn::run_demo (include/qkv/nn/demo.hpp); this file is its flags.
#include <unistd.h>

#include <iostream>
#include <memory>
#include <ostream>
#include <string>

#include "command.hpp"
#include "qkv/nn/demo.hpp"

namespace qkv::cli {

Command register_demo(CLI::App& parent) {
  auto options = std::make_shared<nn::DemoOptions>();
  auto progress = std::make_shared<std::string>("auto");
  CLI::App* app = parent.add_subcommand(
      "demo", "Train a small transformer on Alice in Wonderland, in C++ (≈ 1–2 minutes)");
  app->footer(
      "A 4-layer character-level decoder-only transformer (qkv::nn: BLAS projections around\n"
      "qkv's attention) learns the book from scratch, then writes a few lines and draws one\n"
      "head's attention. The same flags give the same bits on any machine with the same\n"
      "kernels, for any --threads. --steps N --save f, then --resume f --steps N+M, is bit for\n"
      "bit the run --steps N+M (the learning-rate schedule depends on --schedule-steps only).\n"
      "Checkpoints are safetensors files, written atomically.\n"
      "Example: qkv demo --steps 200 --save alice.safetensors");
  app->add_option("--seed", options->seed, "Seed of initialization, batches and sampling")
      ->capture_default_str();
  app->add_option("--steps", options->steps, "Stop after this many optimizer steps (in total)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app->add_option("--seconds", options->seconds,
                  "Also stop when this much training time is spent (not reproducible)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--threads", options->threads, "Threads (0: all cores); results never depend on it")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app->add_option("--save", options->save, "Write a checkpoint here at the end")->type_name("FILE");
  app->add_option("--resume", options->resume, "Continue from this checkpoint")->type_name("FILE");

  const char* model = "Model and training (a resumed run must use the checkpoint's)";
  app->add_option("--layers", options->layers, "Transformer blocks")->capture_default_str()->group(model)->check(CLI::PositiveNumber);
  app->add_option("--embed-dim", options->embed_dim, "Width of the residual stream")->capture_default_str()->group(model)->check(CLI::PositiveNumber);
  app->add_option("--heads", options->heads, "Query heads per layer")->capture_default_str()->group(model)->check(CLI::PositiveNumber);
  app->add_option("--kv-heads", options->kv_heads, "Key/value heads (0: = heads; fewer: GQA)")->capture_default_str()->group(model)->check(CLI::NonNegativeNumber);
  app->add_option("--context", options->context, "Characters per sequence")->capture_default_str()->group(model)->check(CLI::PositiveNumber);
  app->add_option("--batch", options->batch, "Sequences per step")->capture_default_str()->group(model)->check(CLI::PositiveNumber);
  app->add_option("--lr", options->lr, "Peak learning rate (AdamW)")->capture_default_str()->group(model)->check(CLI::PositiveNumber);
  app->add_option("--warmup-steps", options->warmup_steps, "Linear warmup steps")->capture_default_str()->group(model)->check(CLI::NonNegativeNumber);
  app->add_option("--schedule-steps", options->schedule_steps, "Cosine decay to lr/10 ends here")->capture_default_str()->group(model)->check(CLI::PositiveNumber);
  app->add_option("--weight-decay", options->weight_decay, "AdamW weight decay")->capture_default_str()->group(model)->check(CLI::NonNegativeNumber);
  app->add_option("--clip", options->clip, "Gradient-norm clipping threshold")->capture_default_str()->group(model)->check(CLI::PositiveNumber);

  const char* show = "What is shown after training";
  app->add_option("--chars", options->sample_chars, "Characters to generate (0: none)")->capture_default_str()->group(show)->check(CLI::NonNegativeNumber);
  app->add_option("--temperature", options->temperature, "Sampling temperature")->capture_default_str()->group(show)->check(CLI::PositiveNumber);
  app->add_option("--prompt", options->prompt, "Text the generation starts from")->capture_default_str()->group(show);
  app->add_option("--phrase", options->phrase, "Phrase of the attention heatmap (\"\": none)")->capture_default_str()->group(show);
  app->add_option("--layer", options->heatmap_layer, "Heatmap layer (-1: the most focused head's)")->capture_default_str()->group(show);
  app->add_option("--head", options->heatmap_head, "Heatmap head (-1: the most focused)")->capture_default_str()->group(show);
  app->add_option("--progress", *progress, "Progress bar: auto (redrawn on a terminal), lines, or bar")
      ->check(CLI::IsMember({"auto", "lines", "bar"}))
      ->capture_default_str()
      ->group(show);

  return {app, [options, progress](Streams streams) {
            nn::DemoOptions run = *options;
            run.interactive = *progress == "bar" ||
                              (*progress == "auto" && &streams.out == &std::cout &&
                               ::isatty(STDOUT_FILENO) == 1);
            return nn::run_demo(run, streams.out);
          }};
}

}  // namespace qkv::cli
