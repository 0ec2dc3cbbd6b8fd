// qkv explain [--seed S] [--samples N] [--keys L] [--dims 4,16,...] [--softcap C] [--json]
//             [--plot F.png|.svg]
#include <cmath>
#include <cstdlib>
#include <memory>
#include <ostream>

#include "command.hpp"
#include "explain.hpp"
#include "plot.hpp"

namespace qkv::cli {
namespace {

struct ExplainFlags {
  ExplainConfig config;
  bool json = false;
  std::string plot;
};

constexpr int kPlotWidth = 1400, kPlotHeight = 1000;

int explain(const ExplainFlags& flags, Streams streams) {
  validate(flags.config);
  if (!flags.plot.empty()) check_plot_target(flags.plot);  // before minutes of work, not after
  const ExplainResults results = run_experiments(flags.config);
  if (flags.json) {
    print_json(results, streams.out);
  } else {
    print_text(results, streams.out);
  }
  if (!flags.plot.empty()) {
    render_gnuplot(gnuplot_script(results), flags.plot, kPlotWidth, kPlotHeight);
    // With --json, stdout stays pure JSON.
    (flags.json ? streams.err : streams.out) << "wrote " << flags.plot << "\n";
  }
  return kExitOk;
}

}  // namespace

Command register_explain(CLI::App& parent) {
  auto flags = std::make_shared<ExplainFlags>();
  CLI::App* app = parent.add_subcommand(
      "explain", "Why attention divides its logits by √d, shown with real experiments");
  app->footer(
      "Runs, through qkv's own attention forward/backward and softmax Jacobian, on random\n"
      "N(0, 1) queries and keys for each head dim d, scaled (1/√d) and unscaled:\n"
      "  (a) the variance of q·k and q·k/√d against the theory (d and 1)\n"
      "  (b) softmax saturation: mean largest weight, entropy and saturated share of rows\n"
      "  (c) gradient flow: ‖J‖_F of J = diag(s) − s·sᵀ, ‖∂L/∂S‖ and ‖∂L/∂q‖ for a random\n"
      "      upstream gradient, and the share of rows whose gradient vanished\n"
      "  (d) softmax((1, 2, 3, 10⁶)) and its Jacobian, computed without overflow\n"
      "  (e) soft-capping S ← c·tanh(S/c): what it bounds and what it does not\n"
      "Example: qkv explain --plot explain.png");
  app->add_option("--seed", flags->config.seed, "Random seed (same seed, same numbers)")
      ->capture_default_str();
  app->add_option("--samples", flags->config.samples,
                  "Independent attention rows per head dim (standard errors shrink like 1/√samples)")
      ->capture_default_str()
      ->check(CLI::Range(kMinSamples, kMaxSamples));
  app->add_option("--keys", flags->config.keys, "Keys per row: the length L of each softmax")
      ->capture_default_str()
      ->check(CLI::Range(kMinKeys, kMaxKeys));
  app->add_option("--dims", flags->config.dims, "Head dims d to measure, comma-separated")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, kMaxDim));
  app->add_option("--softcap", flags->config.softcap,
                  "Logit cap c of section (e), as in Gemma 2 (S ← c·tanh(S/c))")
      ->capture_default_str()
      ->check(CLI::Range(1e-6, kMaxSoftcap))
      ->check([](const std::string& text) {  // Range lets NaN through (comparisons are false)
        return std::isnan(std::strtod(text.c_str(), nullptr)) ? std::string("expected a number, got nan")
                                                              : std::string();
      });
  app->add_flag("--json", flags->json, "Print the same numbers as JSON instead of tables");
  app->add_option("--plot", flags->plot,
                  "Also draw the results as charts into FILE.png or FILE.svg (needs gnuplot)")
      ->type_name("FILE");
  return {app, [flags](Streams streams) { return explain(*flags, streams); }};
}

}  // namespace qkv::cli
