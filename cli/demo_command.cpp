// qkv demo: train a small character-level transformer on "Alice's Adventures in
// Wonderland" (built into the library), then show generated text, one head's attention
// as a heatmap, and the final loss next to the text's unigram entropy.
// The work is qkv::demo::run_demo (cli/demo/demo.hpp); this file is its flags.
#include <unistd.h>

#include <iostream>
#include <memory>
#include <ostream>
#include <string>

#include "command.hpp"
#include "demo/demo.hpp"
#include "stop_signals.hpp"

namespace qkv::cli {

Command register_demo(CLI::App& parent) {
  auto options = std::make_shared<demo::DemoOptions>();
  auto progress = std::make_shared<std::string>("auto");
  CLI::App* app = parent.add_subcommand(
      "demo", "Train a small transformer on Alice in Wonderland, in C++ (about a minute)");
  app->footer(
      "A 4-layer character-level decoder-only transformer (qkv::nn: BLAS projections around\n"
      "qkv's attention) learns the book from scratch, then writes a few lines and draws one\n"
      "head's attention. The same flags give the same bits on any machine with the same\n"
      "kernels, for any --threads. --steps N --save f, then --resume f --steps N+M, is bit for\n"
      "bit the run --steps N+M (the learning-rate schedule depends on --schedule-steps only).\n"
      "Checkpoints are safetensors files, written atomically. Ctrl-C (or SIGTERM) finishes\n"
      "the step in progress, saves if --save is given and exits; resuming that checkpoint\n"
      "gives the bits of the run never interrupted. A second Ctrl-C stops at once.\n"
      "Example: qkv demo --steps 200 --save alice.safetensors");
  app->add_option("--seed", options->seed, "Seed of initialization, batches and sampling")
      ->capture_default_str();
  app->add_option("--steps", options->steps, "Stop after this many optimizer steps (in total)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app->add_option("--seconds", options->seconds,
                  "Also stop when this much training time is spent (not reproducible)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--threads", options->threads,
                  "Threads (0: all cores); results never depend on it")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  CLI::Option* save =
      app->add_option("--save", options->save, "Write a checkpoint here at the end (and on Ctrl-C)")
          ->type_name("FILE");
  app->add_option("--save-every", options->save_every, "Also write it every N steps")
      ->type_name("N")
      ->check(CLI::PositiveNumber)
      ->needs(save);
  app->add_option("--resume", options->resume, "Continue from this checkpoint")->type_name("FILE");

  const char* model = "Model and training (a resumed run must use the checkpoint's)";
  const char* show = "What is shown after training";
  // Options of one group, with their defaults shown and the values checked.
  const auto add = [app](const char* group, const char* name, auto& value, const char* help,
                         const CLI::Validator& check) {
    app->add_option(name, value, help)->capture_default_str()->group(group)->check(check);
  };
  const auto any = CLI::Validator([](const std::string&) { return std::string(); }, "", "");
  add(model, "--layers", options->layers, "Transformer blocks", CLI::PositiveNumber);
  add(model, "--embed-dim", options->embed_dim, "Width of the residual stream", CLI::PositiveNumber);
  add(model, "--heads", options->heads, "Query heads per layer", CLI::PositiveNumber);
  add(model, "--kv-heads", options->kv_heads, "Key/value heads (0: = heads; fewer: GQA)",
      CLI::NonNegativeNumber);
  add(model, "--context", options->context, "Characters per sequence", CLI::PositiveNumber);
  add(model, "--batch", options->batch, "Sequences per step", CLI::PositiveNumber);
  add(model, "--lr", options->lr, "Peak learning rate (AdamW)", CLI::PositiveNumber);
  add(model, "--warmup-steps", options->warmup_steps, "Linear warmup steps",
      CLI::NonNegativeNumber);
  add(model, "--schedule-steps", options->schedule_steps, "Cosine decay to lr/10 ends here",
      CLI::PositiveNumber);
  add(model, "--weight-decay", options->weight_decay, "AdamW weight decay", CLI::NonNegativeNumber);
  add(model, "--clip", options->clip, "Gradient-norm clipping threshold", CLI::PositiveNumber);
  app->add_flag("--unscaled", options->unscaled,
                "Train without the 1/√d scale of the logits (watch the heads saturate)")
      ->group(model);
  app->add_flag("--health", options->health,
                "Show every layer's and head's attention saturation with each progress line")
      ->group(show);
  add(show, "--chars", options->sample_chars, "Characters to generate (0: none)",
      CLI::NonNegativeNumber);
  add(show, "--temperature", options->temperature, "Sampling temperature", CLI::PositiveNumber);
  add(show, "--prompt", options->prompt, "Text the generation starts from", any);
  add(show, "--phrase", options->phrase, "Phrase of the attention heatmap (\"\": none)", any);
  add(show, "--layer", options->heatmap_layer, "Heatmap layer (-1: the most focused head's)", any);
  add(show, "--head", options->heatmap_head, "Heatmap head (-1: the most focused)", any);
  add(show, "--progress", *progress, "Progress bar: auto (redrawn on a terminal), lines, or bar",
      CLI::IsMember({"auto", "lines", "bar"}));

  return {app, [options, progress](Streams streams) {
            demo::DemoOptions run = *options;
            run.interactive = *progress == "bar" ||
                              (*progress == "auto" && &streams.out == &std::cout &&
                               ::isatty(STDOUT_FILENO) == 1);
            const StopOnSignals signals;
            run.stop = &signals.requested();
            return demo::run_demo(run, streams.out);
          }};
}

}  // namespace qkv::cli
