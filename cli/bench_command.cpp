// qkv bench: time attention forward and backward on random inputs, qkv alone.
//
// FLOPs (the convention of FlashAttention's and PyTorch's benchmarks):
//   forward  4·B·H·Nq·Nk·d   (two matmuls, 2 flops per multiply-add; half with a causal mask)
//   backward 2.5 × forward   (five matmuls instead of two)
// Every configuration runs once untimed (warm-up; it also produces out and lse for the
// backward), then repeatedly until both --reps runs and --min-time seconds are done; the
// table reports the median and the fastest run, GFLOP/s from the median, and that as a
// share of the machine's fp32 FMA peak, measured just before with the same threads by
// the probe bench/bench_attention.py uses (bench/fma_probe.hpp). The dot-product units'
// peaks (bf16 vdpbf16ps, int8 vpdpbusd, AMX tdpbf16ps; bench/dot_peak.hpp) are measured and printed next
// to it, so a bf16 or int8 kernel's share of its own unit's peak can be read off them.
#include <algorithm>
#include <chrono>
#include <memory>
#include <ostream>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "command.hpp"
#include "dot_peak.hpp"
#include "fma_probe.hpp"
#include "format.hpp"
#include "json.hpp"
#include "qkv/qkv.hpp"
#include "random.hpp"

namespace qkv::cli {

double attention_flops(const BenchShape& shape, bool backward) {
  double flops = 4.0 * static_cast<double>(shape.batch) * static_cast<double>(shape.heads) *
                 static_cast<double>(shape.seq) * static_cast<double>(shape.seq) *
                 static_cast<double>(shape.dim);
  if (shape.causal != Causal::none) flops *= 0.5;
  return backward ? 2.5 * flops : flops;
}

namespace {

const char* causal_name(Causal causal) { return name_of(causal).data(); }

// The words --causal takes: the library's name table.
std::vector<std::string> causal_names() {
  std::vector<std::string> names;
  for (const EnumName<Causal>& entry : kCausalNames) names.emplace_back(entry.name);
  return names;
}

using Clock = std::chrono::steady_clock;

template <class Work>
std::vector<double> time_runs(Work&& work, const BenchConfig& config) {
  std::vector<double> seconds;
  const auto start = Clock::now();
  while (static_cast<int>(seconds.size()) < config.reps ||
         std::chrono::duration<double>(Clock::now() - start).count() < config.min_time) {
    const auto t0 = Clock::now();
    work();
    seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    if (static_cast<int>(seconds.size()) >= config.max_reps) break;
  }
  return seconds;
}

BenchRow summarize(const BenchShape& shape, bool backward, std::vector<double> seconds) {
  BenchRow row;
  row.shape = shape;
  row.backward = backward;
  row.reps = static_cast<int>(seconds.size());
  std::sort(seconds.begin(), seconds.end());
  const std::size_t mid = seconds.size() / 2;
  row.median_s = seconds.size() % 2 ? seconds[mid] : 0.5 * (seconds[mid - 1] + seconds[mid]);
  row.min_s = seconds.front();
  row.flops = attention_flops(shape, backward);
  row.gflops = row.flops / row.median_s * 1e-9;
  return row;
}

}  // namespace

void validate(const BenchConfig& config) {
  const auto positive = [](const char* flag, int64_t value, int64_t limit) {
    if (value < 1 || value > limit) {
      throw Error(std::string(flag) + ": expected 1 to " + std::to_string(limit) + ", got " +
                  std::to_string(value));
    }
  };
  positive("--batch", config.batch, 1 << 16);
  positive("--heads", config.heads, 1 << 12);
  if (config.seqs.empty() || config.dims.empty() || config.causal.empty()) {
    throw Error("--seq, --dim and --causal each need at least one value");
  }
  for (int64_t n : config.seqs) positive("--seq", n, 1 << 20);
  for (int64_t d : config.dims) positive("--dim", d, 1 << 12);
  // q, k, v, out, dout, dq, dk, dv: 8 tensors of B·N·H·d floats.
  for (int64_t n : config.seqs) {
    for (int64_t d : config.dims) {
      const double bytes = 8.0 * 4.0 * static_cast<double>(config.batch) * static_cast<double>(config.heads) *
                           static_cast<double>(n) * static_cast<double>(d);
      if (bytes > 16e9) {
        throw Error("--batch/--heads/--seq/--dim: the tensors for seq " + std::to_string(n) + ", dim " +
                    std::to_string(d) + " would need " + format("%.0f", bytes / 1e9) + " GB");
      }
    }
  }
  if (!(config.min_time >= 0.0 && config.min_time <= 3600.0)) {
    throw Error("--min-time: expected 0 to 3600 seconds, got " + format("%g", config.min_time));
  }
  positive("--reps", config.reps, 1000000);
  if (config.max_reps < config.reps) {
    throw Error("--max-reps: expected at least --reps (" + std::to_string(config.reps) + "), got " +
                std::to_string(config.max_reps));
  }
  if (config.threads < 0) throw Error("--threads: expected ≥ 0, got " + std::to_string(config.threads));
}

std::vector<BenchRow> run_bench(const BenchConfig& config, const std::function<void(const BenchRow&)>& on_row) {
  validate(config);
  AttentionOptions base;
  base.execution.backend = config.backend;
  base.execution.threads = config.threads;
  std::vector<BenchRow> rows;
  Rng rng(config.seed);
  for (int64_t n : config.seqs) {
    for (int64_t d : config.dims) {
      const int64_t B = config.batch, H = config.heads;
      Tensor<float, 4> q({B, n, H, d}), k({B, n, H, d}), v({B, n, H, d}), out({B, n, H, d}),
          dout({B, n, H, d}), dq({B, n, H, d}), dk({B, n, H, d}), dv({B, n, H, d});
      Tensor<float, 3> lse({B, H, n});
      for (Tensor<float, 4>* t : {&q, &k, &v, &dout}) {
        for (std::size_t i = 0; i < t->size(); ++i) (*t)[i] = static_cast<float>(rng.normal());
      }
      for (Causal causal : config.causal) {
        AttentionOptions options = base;
        options.causal = causal;
        const BenchShape shape{B, H, n, d, causal};
        const auto forward = [&] {
          attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                             .lse = lse.view()},
                            options);
        };
        const auto backward = [&] {
          attention_backward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.cview(),
                              .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(),
                              .dk = dk.view(), .dv = dv.view()},
                             options);
        };
        forward();  // warm-up, and out/lse for the backward
        if (config.forward) {
          rows.push_back(summarize(shape, false, time_runs(forward, config)));
          if (on_row) on_row(rows.back());
        }
        if (config.backward) {
          backward();  // warm-up
          rows.push_back(summarize(shape, true, time_runs(backward, config)));
          if (on_row) on_row(rows.back());
        }
      }
    }
  }
  return rows;
}

namespace {

struct BenchFlags {
  BenchConfig config;
  std::vector<std::string> causal{"none", "top_left"};
  std::string pass = "both";
  bool json = false;
};

// The FMA probe: many short runs (~5 ms each on the CPUs we know, 0.15 s in all), the
// fastest kept. On a busy machine short runs catch the moments the cores are free, so
// the estimate is far steadier than from a few long runs.
constexpr long kPeakIterations = 2'000'000;
constexpr int kPeakRepeats = 30;

std::vector<std::string> row_cells(const BenchRow& r, double peak_gflops) {
  return {std::to_string(r.shape.batch), std::to_string(r.shape.heads), std::to_string(r.shape.seq),
          std::to_string(r.shape.dim), causal_name(r.shape.causal), r.backward ? "backward" : "forward",
          std::to_string(r.reps), format("%.3f", r.median_s * 1e3), format("%.3f", r.min_s * 1e3),
          format("%.2f", r.gflops), format("%.1f%%", 100 * r.gflops / peak_gflops)};
}

int bench(BenchFlags flags, Streams streams) {
  flags.config.causal.clear();
  for (const std::string& name : flags.causal)  // checked against the table when parsed
    flags.config.causal.push_back(causal_from_name(name).value_or(Causal::none));
  flags.config.forward = flags.pass != "backward";
  flags.config.backward = flags.pass != "forward";
  validate(flags.config);
  const BenchConfig& c = flags.config;
  const Backend backend = resolve_backend(AttentionOptions{.execution = {.backend = c.backend}}, false, false);
  const int threads = c.threads > 0 ? c.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const bench::FmaPeak peak = bench::measure_fma_peak(threads, kPeakIterations, kPeakRepeats);
  const double bf16_peak = bench::measure_dot_peak(bench::DotUnit::bf16, threads, kPeakIterations, kPeakRepeats);
  const double int8_peak = bench::measure_dot_peak(bench::DotUnit::int8, threads, kPeakIterations, kPeakRepeats);
  const double amx_peak = bench::measure_dot_peak(bench::DotUnit::amx_bf16, threads, kPeakIterations, kPeakRepeats);
  const auto unit_peak = [](double ops, const char* unit) {
    return ops > 0 ? format("%.1f", ops) + unit : std::string("none on this CPU");
  };
  if (!flags.json) {
    streams.out << "qkv bench — fp32, backend " << backend_name(backend) << ", " << threads
                << (threads == 1 ? " thread" : " threads")
                << "; FLOPs: forward 4·B·H·N²·d (half if causal), backward 2.5× forward\n"
                << "  time: median and fastest of `runs` runs after one warm-up; GFLOP/s from "
                   "the median\n"
                << "  % peak: of the fp32 FMA peak measured now, " << format("%.1f", peak.gflops)
                << " GFLOP/s on " << threads << (threads == 1 ? " thread" : " threads") << " ("
                << peak.target << ")\n"
                << "  dot-product peaks measured now: bf16 (vdpbf16ps) " << unit_peak(bf16_peak, " GFLOP/s")
                << ", int8 (vpdpbusd) " << unit_peak(int8_peak, " GOP/s") << ", AMX bf16 (tdpbf16ps) "
                << unit_peak(amx_peak, " GFLOP/s") << "\n\n";
  }
  // Rows are printed as they finish (slow backends take a while), so the table's widths
  // are fixed here rather than fitted.
  static constexpr int kWidths[] = {3, 3, 6, 5, 12, 8, 5, 11, 11, 9, 7};
  static constexpr const char* kHeaders[] = {"B", "H", "N", "d", "causal", "pass", "runs",
                                             "median ms", "min ms", "GFLOP/s", "% peak"};
  const auto print_cells = [&](const std::vector<std::string>& cells) {
    streams.out << " ";
    for (std::size_t i = 0; i < cells.size(); ++i) {
      const int pad = kWidths[i] - static_cast<int>(cells[i].size());
      streams.out << std::string(static_cast<std::size_t>(std::max(pad, 0)) + 1, ' ') << cells[i];
    }
    streams.out << "\n";
    streams.out.flush();
  };
  if (!flags.json) print_cells(std::vector<std::string>(std::begin(kHeaders), std::end(kHeaders)));
  const std::vector<BenchRow> rows = run_bench(c, [&](const BenchRow& row) {
    if (!flags.json) print_cells(row_cells(row, peak.gflops));
  });
  const bool over_peak = std::any_of(rows.begin(), rows.end(),
                                     [&](const BenchRow& r) { return r.gflops > peak.gflops; });
  if (!flags.json && over_peak) {
    streams.out << "\n  note: a share over 100% means other work slowed the peak probe: the "
                   "machine is busy, so these shares are not meaningful\n";
  }
  if (flags.json) {
    Json json{{"backend", backend_name(backend)},
              {"threads", threads},
              {"seed", static_cast<int64_t>(c.seed)},
              {"fma_peak_gflops", json_number(peak.gflops)},
              {"simd_target", peak.target},
              {"bf16_dot_peak_gflops", json_number(bf16_peak)},
              {"int8_dot_peak_gops", json_number(int8_peak)},
              {"amx_bf16_peak_gflops", json_number(amx_peak)},
              {"rows", Json::array()}};
    for (const BenchRow& r : rows) {
      json["rows"].push_back({{"batch", r.shape.batch},
                              {"heads", r.shape.heads},
                              {"seq", r.shape.seq},
                              {"dim", r.shape.dim},
                              {"causal", causal_name(r.shape.causal)},
                              {"pass", r.backward ? "backward" : "forward"},
                              {"runs", r.reps},
                              {"median_s", json_number(r.median_s)},
                              {"min_s", json_number(r.min_s)},
                              {"flops", json_number(r.flops)},
                              {"gflops", json_number(r.gflops)},
                              {"peak_share", json_number(r.gflops / peak.gflops)}});
    }
    write_json(json, streams.out);
  }
  return kExitOk;
}

}  // namespace

Command register_bench(CLI::App& parent) {
  auto flags = std::make_shared<BenchFlags>();
  BenchConfig& c = flags->config;
  CLI::App* app = parent.add_subcommand(
      "bench", "Time attention forward and backward: GFLOP/s and share of the FMA peak (qkv alone)");
  app->footer(
      "fp32 random inputs [batch, seq, heads, dim], Nq = Nk = N. FLOPs: forward 4·B·H·N²·d\n"
      "(half with a causal mask), backward 2.5× forward. Each row: one warm-up run, then\n"
      "runs until both --reps and --min-time are reached; median and fastest are shown.\n"
      "% peak: GFLOP/s over the fp32 FMA peak, measured first with the same threads.\n"
      "The Python benchmark (bench/) compares with PyTorch in the same process.");
  app->add_option("--batch", c.batch, "Batch size")->capture_default_str();
  app->add_option("--heads", c.heads, "Heads")->capture_default_str();
  app->add_option("--seq", c.seqs, "Sequence lengths N (Nq = Nk), comma-separated")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--dim", c.dims, "Head dims d, comma-separated")->delimiter(',')->capture_default_str();
  app->add_option("--causal", flags->causal, "Causal modes to run, comma-separated: none, top_left, bottom_right")
      ->delimiter(',')
      ->check(CLI::IsMember(causal_names()))
      ->capture_default_str();
  app->add_option("--pass", flags->pass, "forward, backward or both")
      ->check(CLI::IsMember({"forward", "backward", "both"}))
      ->capture_default_str();
  add_choice<Backend>(app, "--backend", c.backend,
                      choices_of(kBackendNames), "Backend (auto: the fastest available)");
  app->add_option("--threads", c.threads, "Threads (0: all)")->capture_default_str();
  app->add_option("--reps", c.reps, "Timed runs at least")->capture_default_str();
  app->add_option("--max-reps", c.max_reps, "Timed runs at most")->capture_default_str();
  app->add_option("--min-time", c.min_time, "Seconds of timed runs at least, per row")->capture_default_str();
  app->add_option("--seed", c.seed, "Seed of the random inputs")->capture_default_str();
  app->add_flag("--json", flags->json, "Print the results as JSON");
  return {app, [flags](Streams streams) { return bench(*flags, streams); }};
}

}  // namespace qkv::cli
