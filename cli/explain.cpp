// The experiments of `qkv explain` and their presentation (text, JSON, gnuplot).
// Every number comes out of the library: attention_forward (log-sum-exp, weights and
// softmax statistics), attention_backward, qkv::softmax and qkv::softmax_jacobian. This file only draws the
// inputs and averages what the library returns.
#include "explain.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <ostream>
#include <sstream>

#include "format.hpp"
#include "json.hpp"
#include "qkv/qkv.hpp"
#include "random.hpp"

namespace qkv::cli {
namespace {

// Rows are processed in chunks of about this many floats of inputs and outputs, so a
// run at d = 1024 with 64 keys needs tens of MB, not the GB the whole sample would.
constexpr int64_t kChunkFloats = int64_t{1} << 22;

// Per-row values of every statistic, for one scaling.
struct RowSamples {
  std::vector<double> max_weight, entropy, jacobian_norm, grad_norm, query_grad_norm, dead,
      saturated;
};

Estimate estimate(std::vector<double> values) {
  Estimate result;
  const auto n = static_cast<double>(values.size());
  result.mean = std::accumulate(values.begin(), values.end(), 0.0) / n;
  double m2 = 0.0;
  for (double v : values) m2 += (v - result.mean) * (v - result.mean);
  result.std_error = values.size() > 1 ? std::sqrt(m2 / (n - 1.0) / n) : 0.0;
  const std::size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  result.median = values[mid];
  if (values.size() % 2 == 0) {
    const double below = *std::max_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid));
    result.median = 0.5 * (result.median + below);
  }
  return result;
}

RowStats summarize(RowSamples samples) {
  RowStats stats;
  stats.max_weight = estimate(std::move(samples.max_weight));
  stats.entropy = estimate(std::move(samples.entropy));
  stats.jacobian_norm = estimate(std::move(samples.jacobian_norm));
  stats.grad_norm = estimate(std::move(samples.grad_norm));
  stats.query_grad_norm = estimate(std::move(samples.query_grad_norm));
  stats.dead = estimate(std::move(samples.dead));
  stats.saturated = estimate(std::move(samples.saturated));
  return stats;
}

double sample_variance(const std::vector<double>& x) {
  const double n = static_cast<double>(x.size());
  const double mean = std::accumulate(x.begin(), x.end(), 0.0) / n;
  double m2 = 0.0;
  for (double v : x) m2 += (v - mean) * (v - mean);
  return m2 / (n - 1.0);
}

AttentionOptions scale_options(bool scaled, double softcap = 0.0) {
  AttentionOptions options;
  options.softcap = static_cast<float>(softcap);
  // One thread: the calls are small and most of the time goes to serial work between them
  // (drawing inputs, the per-row Jacobians), where idle worker threads would only spin.
  options.execution.threads = 1;
  if (!scaled) options.scale = 1.0;  // scaled: the library's default, 1/√d
  return options;
}

// One chunk of `rows` rows: inputs, and outputs reused from chunk to chunk.
struct Chunk {
  int64_t rows, keys, dim;
  // Inputs: q [rows,1,1,d], k [rows,L,1,d], v = I [rows,L,1,L], g = dout [rows,1,1,L].
  Tensor<float, 4> q, k, v, upstream;
  // Outputs of the (a) calls and of the (b)/(c) calls.
  Tensor<float, 4> single_value, single_out;
  Tensor<float, 3> single_lse;
  Tensor<float, 4> out, weights, dq, dk, dv;
  Tensor<float, 3> lse;
  // Softmax statistics: one row per batch entry, so per-entry shares are 0 or 1.
  Tensor<float, 3> row_max_weight, row_entropy;
  Tensor<float, 2> saturated_share;

  Chunk(int64_t rows_, int64_t keys_, int64_t dim_)
      : rows(rows_), keys(keys_), dim(dim_), q({rows_, 1, 1, dim_}), k({rows_, keys_, 1, dim_}),
        v({rows_, keys_, 1, keys_}), upstream({rows_, 1, 1, keys_}), single_value({rows_, 1, 1, 1}),
        single_out({rows_, 1, 1, 1}), single_lse({rows_, 1, 1}), out({rows_, 1, 1, keys_}),
        weights({rows_, 1, 1, keys_}), dq({rows_, 1, 1, dim_}), dk({rows_, keys_, 1, dim_}),
        dv({rows_, keys_, 1, keys_}), lse({rows_, 1, 1}), row_max_weight({rows_, 1, 1}),
        row_entropy({rows_, 1, 1}), saturated_share({rows_, 1}) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < keys; ++j) v(r, j, 0, j) = 1.0f;
  }

  // Row by row, so the values do not depend on the chunk size: q, then its keys, then g.
  void draw(Rng& rng) {
    const auto d = static_cast<std::size_t>(dim), L = static_cast<std::size_t>(keys);
    for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
      rng.fill_normal(q.data() + r * d, d);
      rng.fill_normal(k.data() + r * L * d, L * d);
      rng.fill_normal(upstream.data() + r * L, L);
    }
  }

  // (a): the logit q·k_1·scale of every row, as the log-sum-exp of attention over the
  // single key k_1 (a strided view of the first key of each row: no copy).
  void logits(bool scaled, std::vector<double>& into) {
    const View4<const float> first_key(k.data(), {rows, 1, 1, dim}, {keys * dim, dim, dim, 1});
    attention_forward({.q = q.cview(), .k = first_key, .v = single_value.cview(),
                       .out = single_out.view(), .lse = single_lse.view()},
                      scale_options(scaled));
    for (int64_t r = 0; r < rows; ++r) into.push_back(single_lse(r, 0, 0));
  }

  // (b) and (c) for every row of the chunk.
  void rows_statistics(bool scaled, RowSamples& into, double softcap = 0.0) {
    const AttentionOptions options = scale_options(scaled, softcap);
    const AttentionStats<float> stats{.saturated_share = saturated_share.view(),
                                      .row_max_weight = row_max_weight.view(),
                                      .row_entropy = row_entropy.view(),
                                      .saturation_threshold = kSaturated};
    attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                       .lse = lse.view(), .weights = weights.view(), .stats = &stats},
                      options);
    // With V = I, out = P and dout = g is ∂L/∂P; attention_backward's dq is ∂L/∂q.
    attention_backward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.cview(),
                        .lse = lse.cview(), .dout = upstream.cview(), .dq = dq.view(),
                        .dk = dk.view(), .dv = dv.view()},
                       options);

    const auto n = static_cast<std::size_t>(keys);
    std::vector<double> p(n), g(n), jacobian(n * n);
    for (int64_t r = 0; r < rows; ++r) {
      for (std::size_t j = 0; j < n; ++j) {
        p[j] = weights(r, 0, 0, static_cast<int64_t>(j));
        g[j] = upstream(r, 0, 0, static_cast<int64_t>(j));
      }
      softmax_jacobian(std::span<const double>(p), std::span<double>(jacobian));
      double j_norm2 = 0.0, ds_norm2 = 0.0;
      for (std::size_t i = 0; i < n; ++i) {
        double ds_i = 0.0;  // (J·g)_i
        for (std::size_t j = 0; j < n; ++j) {
          j_norm2 += jacobian[i * n + j] * jacobian[i * n + j];
          ds_i += jacobian[i * n + j] * g[j];
        }
        ds_norm2 += ds_i * ds_i;
      }
      double dq_norm2 = 0.0;
      for (int64_t c = 0; c < dim; ++c) dq_norm2 += static_cast<double>(dq(r, 0, 0, c)) * dq(r, 0, 0, c);

      into.max_weight.push_back(row_max_weight(r, 0, 0));
      into.entropy.push_back(row_entropy(r, 0, 0));
      into.saturated.push_back(saturated_share(r, 0));
      into.jacobian_norm.push_back(std::sqrt(j_norm2));
      into.grad_norm.push_back(std::sqrt(ds_norm2));
      into.query_grad_norm.push_back(std::sqrt(dq_norm2));
      into.dead.push_back(std::sqrt(j_norm2) < kDeadJacobian ? 1.0 : 0.0);
    }
  }
};

DimResult run_dim(const ExplainConfig& config, int64_t d) {
  // Each d has its own stream, so a row's inputs depend on (seed, d, row) only.
  Rng rng(config.seed + 0x9e3779b97f4a7c15ULL * static_cast<std::uint64_t>(d));
  const int64_t L = config.keys;
  const int64_t per_row = (L + 1) * d * 2 + 3 * L * L;  // q, k, dq, dk, v, dv, out...
  const int64_t chunk_rows = std::clamp<int64_t>(kChunkFloats / per_row, 1, config.samples);

  std::vector<double> unscaled_logits, scaled_logits;
  RowSamples unscaled, scaled, capped_unscaled, capped_scaled;
  std::optional<Chunk> chunk;
  for (int64_t done = 0; done < config.samples; done += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, config.samples - done);
    if (!chunk || chunk->rows != rows) chunk.emplace(rows, L, d);
    chunk->draw(rng);
    chunk->logits(false, unscaled_logits);
    chunk->logits(true, scaled_logits);
    chunk->rows_statistics(false, unscaled);
    chunk->rows_statistics(true, scaled);
    chunk->rows_statistics(false, capped_unscaled, config.softcap);
    chunk->rows_statistics(true, capped_scaled, config.softcap);
  }

  DimResult result;
  result.d = d;
  result.var_unscaled = sample_variance(unscaled_logits);
  result.var_scaled = sample_variance(scaled_logits);
  result.var_relative_std_error =
      std::sqrt((2.0 + 6.0 / static_cast<double>(d)) / static_cast<double>(config.samples));
  result.unscaled = summarize(std::move(unscaled));
  result.scaled = summarize(std::move(scaled));
  result.capped_unscaled = summarize(std::move(capped_unscaled));
  result.capped_scaled = summarize(std::move(capped_scaled));
  return result;
}

// ---- text --------------------------------------------------------------------------

std::string pm(double value, double error) {
  return format("%.4g", value) + " ± " + format("%.2g", error);
}

std::string vector_string(const std::vector<double>& x, const char* spec) {
  std::string text = "(";
  for (std::size_t i = 0; i < x.size(); ++i) text += (i ? ", " : "") + format(spec, x[i]);
  return text + ")";
}

void print_matrix(std::ostream& out, const std::vector<double>& m, std::size_t n,
                  const char* label) {
  Table table;
  for (std::size_t j = 0; j < n; ++j) table.add_column("");
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<std::string> row;
    for (std::size_t j = 0; j < n; ++j) row.push_back(format("%.6g", m[i * n + j] == 0.0 ? 0.0 : m[i * n + j]));
    table.add_row(row);
  }
  std::ostringstream text;
  table.print(text, "");
  std::istringstream lines(text.str());
  std::string line;
  std::getline(lines, line);  // the empty header line
  std::size_t index = 0;
  const std::string pad(std::string(label).size(), ' ');
  while (std::getline(lines, line)) {
    out << "    " << (index == n / 2 - (n % 2 == 0 ? 1 : 0) ? label : pad.c_str()) << "│ " << line
        << " │\n";
    ++index;
  }
}

}  // namespace

void validate(const ExplainConfig& config) {
  if (config.samples < kMinSamples || config.samples > kMaxSamples) {
    throw Error("--samples: expected " + std::to_string(kMinSamples) + " to " +
                std::to_string(kMaxSamples) + ", got " + std::to_string(config.samples));
  }
  if (config.keys < kMinKeys || config.keys > kMaxKeys) {
    throw Error("--keys: expected " + std::to_string(kMinKeys) + " to " + std::to_string(kMaxKeys) +
                ", got " + std::to_string(config.keys));
  }
  if (!(config.softcap > 0.0 && config.softcap <= kMaxSoftcap)) {
    throw Error("--softcap: expected a cap c with 0 < c ≤ " + format("%g", kMaxSoftcap) + ", got " +
                format("%g", config.softcap));
  }
  if (config.dims.empty()) throw Error("--dims: expected at least one head dim");
  for (int64_t d : config.dims) {
    if (d < 1 || d > kMaxDim) {
      throw Error("--dims: expected head dims from 1 to " + std::to_string(kMaxDim) + ", got " +
                  std::to_string(d));
    }
  }
}

double softcap_weight_bound(double cap, int64_t keys) {
  // Best case for one key: it sits at +c and the other L − 1 at −c.
  return 1.0 / (1.0 + static_cast<double>(keys - 1) * std::exp(-2.0 * cap));
}

SoftmaxExample softmax_example(const std::vector<double>& x) {
  SoftmaxExample example;
  const std::size_t n = x.size();
  example.x = x;
  example.s.resize(n);
  example.jacobian.resize(n * n);
  softmax(std::span<const double>(x), std::span<double>(example.s));
  softmax_jacobian(std::span<const double>(example.s), std::span<double>(example.jacobian));

  // One attention row whose logits are all 0 (q = k = 0) plus the additive mask x:
  // P = softmax(x), and with V = I, out = P.
  const auto keys = static_cast<int64_t>(n);
  Tensor<double, 4> q({1, 1, 1, 1}), k({1, keys, 1, 1}), v({1, keys, 1, keys}), out({1, 1, 1, keys}),
      weights({1, 1, 1, keys});
  Tensor<double, 3> lse({1, 1, 1});
  Tensor<float, 4> bias({1, 1, 1, keys});
  for (int64_t j = 0; j < keys; ++j) {
    v(0, j, 0, j) = 1.0;
    bias(0, 0, 0, j) = static_cast<float>(x[static_cast<std::size_t>(j)]);
  }
  AttentionOptions options;
  options.mask.bias = bias.cview();
  attention_forward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                     .lse = lse.view(), .weights = weights.view()},
                    options);
  example.attention_weights.assign(weights.data(), weights.data() + n);
  example.attention_lse = lse[0];
  return example;
}

ExplainResults run_experiments(const ExplainConfig& config) {
  validate(config);
  ExplainResults results;
  results.config = config;
  results.weights_backend = backend_name(resolve_backend(AttentionOptions{}, false, true));
  results.backward_backend = backend_name(resolve_backend(AttentionOptions{}, false, false));
  for (int64_t d : config.dims) results.dims.push_back(run_dim(config, d));
  results.huge = softmax_example({1.0, 2.0, 3.0, 1e6});
  results.moderate = softmax_example({1.0, 2.0, 3.0, 4.0});
  return results;
}

void print_softmax_section(const ExplainResults& results, std::ostream& out) {
  const SoftmaxExample& huge = results.huge;
  const SoftmaxExample& moderate = results.moderate;
  out << "(d) softmax((1, 2, 3, 10⁶)) without overflow\n"
      << "    exp(10⁶) is " << format("%g", std::exp(huge.x[3]))
      << " in double precision: the textbook formula exp(x_i)/Σ exp(x_j) gives inf/inf.\n"
      << "    qkv subtracts the row maximum first: every exponent is ≤ 0, nothing overflows.\n\n"
      << "    s = softmax((1, 2, 3, 10⁶)) = " << vector_string(huge.s, "%.6g") << "\n"
      << "    J = diag(s) − s·sᵀ:\n";
  print_matrix(out, huge.jacobian, huge.s.size(), "J = ");
  out << "    A one-hot s has J = 0: no gradient flows back through this row at all.\n\n"
      << "    For contrast, s = softmax((1, 2, 3, 4)) = " << vector_string(moderate.s, "%.6g") << "\n";
  print_matrix(out, moderate.jacobian, moderate.s.size(), "J = ");
  out << "\n    The same logits as the additive mask of one attention row (attention_forward):\n"
      << "    weights " << vector_string(huge.attention_weights, "%.6g") << ", log-sum-exp "
      << format("%.10g", huge.attention_lse) << "\n";
}

void print_softcap_section(const ExplainResults& results, std::ostream& out) {
  const ExplainConfig& c = results.config;
  // 1 − bound, without cancellation: (L − 1)e^(−2c) / (1 + (L − 1)e^(−2c)).
  const double tail = static_cast<double>(c.keys - 1) * std::exp(-2.0 * c.softcap);
  out << "\n(e) Soft-capping: S ← c·tanh(S/c) (AttentionOptions::softcap; Gemma 2 uses c = 50), here c = "
      << format("%g", c.softcap) << "\n"
      << "    It bounds |S| < c, so no weight can exceed 1/(1 + (L − 1)·e^(−2c)) = 1 − "
      << format("%.3g", tail / (1.0 + tail)) << " (L = " << c.keys << ").\n"
      << "    tanh also squeezes the largest logits together, and the gradient reaching q carries\n"
      << "    its slope 1 − tanh²(S/c). The same rows as (b)–(c), with and without the cap:\n\n";
  Table table;
  table.add_column("d");
  table.add_group("largest weight", 3);
  table.add_column("unscaled");
  table.add_column("capped");
  table.add_column("scaled+cap");
  table.add_group("dead rows", 3);
  table.add_column("unscaled");
  table.add_column("capped");
  table.add_column("scaled+cap");
  table.add_group("median ‖∂L/∂q‖", 3);
  table.add_column("unscaled");
  table.add_column("capped");
  table.add_column("scaled+cap");
  const auto percent = [](double share) { return format("%.1f", 100.0 * share) + " %"; };
  for (const DimResult& r : results.dims) {
    table.add_row({std::to_string(r.d), format("%.4f", r.unscaled.max_weight.mean),
                   format("%.4f", r.capped_unscaled.max_weight.mean),
                   format("%.4f", r.capped_scaled.max_weight.mean), percent(r.unscaled.dead.mean),
                   percent(r.capped_unscaled.dead.mean), percent(r.capped_scaled.dead.mean),
                   format("%.3g", r.unscaled.query_grad_norm.median),
                   format("%.3g", r.capped_unscaled.query_grad_norm.median),
                   format("%.3g", r.capped_scaled.query_grad_norm.median)});
  }
  table.print(out, "    ");
  const auto widest = std::max_element(results.dims.begin(), results.dims.end(),
                                       [](const DimResult& a, const DimResult& b) { return a.d < b.d; });
  out << "\n    Without 1/√d, at d = " << widest->d << ", the cap moves the largest weight "
      << format("%.3f", widest->unscaled.max_weight.mean) << " → "
      << format("%.3f", widest->capped_unscaled.max_weight.mean) << ", dead rows "
      << format("%.1f", 100.0 * widest->unscaled.dead.mean) << " % → "
      << format("%.1f", 100.0 * widest->capped_unscaled.dead.mean) << " %\n    and the median ‖∂L/∂q‖ "
      << format("%.3g", widest->unscaled.query_grad_norm.median) << " → "
      << format("%.3g", widest->capped_unscaled.query_grad_norm.median)
      << ".\n    With 1/√d the logits are ~N(0, 1), far inside the cap: it changes almost nothing"
         " (largest\n    weight "
      << format("%.4f", widest->scaled.max_weight.mean) << " uncapped, "
      << format("%.4f", widest->capped_scaled.max_weight.mean)
      << " capped).\n    The cap guards against runaway logits; 1/√d is what keeps them in range.\n";
}

void print_text(const ExplainResults& results, std::ostream& out) {
  const ExplainConfig& c = results.config;
  const double L = static_cast<double>(c.keys);
  out << "qkv explain — why attention divides its logits by √d\n"
      << "  " << c.samples << " rows per head dim d, " << c.keys
      << " keys per row, every entry of q and k i.i.d. N(0, 1), seed " << c.seed << ".\n"
      << "  Unscaled: S = q·kᵀ.  Scaled: S = q·kᵀ/√d (qkv's default).  Same rows for both.\n"
      << "  Weights from attention_forward (" << results.weights_backend
      << " backend), gradients from attention_backward\n  (" << results.backward_backend
      << " backend).\n\n";

  out << "(a) The variance of a logit grows like d\n"
      << "    Var(q·k) = Σ_c Var(q_c·k_c) = d, so unscaled logits are typically ±√d;\n"
      << "    Var(q·k/√d) = 1 for every d. Measured over n = " << c.samples
      << " samples; ± is one standard error,\n    √((2 + 6/d)/n)·theory.\n\n";
  {
    Table table;
    for (const char* h : {"d", "Var(q·k)", "theory", "Var(q·k/√d)", "theory"}) table.add_column(h);
    for (const DimResult& r : results.dims) {
      const double d = static_cast<double>(r.d);
      table.add_row({std::to_string(r.d), pm(r.var_unscaled, r.var_relative_std_error * d),
                     format("%g", d), pm(r.var_scaled, r.var_relative_std_error), "1"});
    }
    table.print(out, "    ");
  }

  out << "\n(b) Large logits saturate the softmax\n"
      << "    Mean over rows of the largest attention weight (uniform " << format("%.4g", 1.0 / L)
      << ", one-hot 1), of the\n    entropy −Σ P·ln P in nats (uniform ln " << c.keys << " = "
      << format("%.4g", std::log(L)) << ", one-hot 0), and the share of saturated rows\n"
      << "    (largest weight > " << format("%g", kSaturated)
      << "), from attention_forward's softmax statistics (return_stats).\n\n";
  {
    Table table;
    table.add_column("d");
    table.add_group("largest weight", 2);
    table.add_column("unscaled");
    table.add_column("scaled");
    table.add_group("entropy", 2);
    table.add_column("unscaled");
    table.add_column("scaled");
    table.add_group("saturated rows", 2);
    table.add_column("unscaled");
    table.add_column("scaled");
    const auto percent = [](double share) { return format("%.1f", 100.0 * share) + " %"; };
    for (const DimResult& r : results.dims) {
      table.add_row({std::to_string(r.d), format("%.4f", r.unscaled.max_weight.mean),
                     format("%.4f", r.scaled.max_weight.mean), format("%.4f", r.unscaled.entropy.mean),
                     format("%.4f", r.scaled.entropy.mean), percent(r.unscaled.saturated.mean),
                     percent(r.scaled.saturated.mean)});
    }
    table.print(out, "    ");
  }

  out << "\n(c) A saturated softmax passes back (almost) no gradient\n"
      << "    J = diag(P) − P·Pᵀ (softmax_jacobian). For an upstream gradient g = ∂L/∂P ~ N(0, I),\n"
      << "    ∂L/∂S = J·g. A row is dead when ‖J‖_F < " << format("%g", kDeadJacobian)
      << ": it passes back under 0.1 % of any g.\n"
      << "    ∂L/∂q is the query gradient attention_backward returns (V = I, dout = g).\n\n";
  {
    Table table;
    table.add_column("d");
    table.add_group("mean ‖J‖_F", 2);
    table.add_column("unscaled");
    table.add_column("scaled");
    table.add_group("median ‖∂L/∂S‖", 2);
    table.add_column("unscaled");
    table.add_column("scaled");
    table.add_group("dead rows", 2);
    table.add_column("unscaled");
    table.add_column("scaled");
    table.add_group("median ‖∂L/∂q‖", 2);
    table.add_column("unscaled");
    table.add_column("scaled");
    const auto percent = [](double share) { return format("%.1f", 100.0 * share) + " %"; };
    for (const DimResult& r : results.dims) {
      table.add_row({std::to_string(r.d), format("%.4f", r.unscaled.jacobian_norm.mean),
                     format("%.4f", r.scaled.jacobian_norm.mean),
                     format("%.3g", r.unscaled.grad_norm.median), format("%.3g", r.scaled.grad_norm.median),
                     percent(r.unscaled.dead.mean), percent(r.scaled.dead.mean),
                     format("%.3g", r.unscaled.query_grad_norm.median),
                     format("%.3g", r.scaled.query_grad_norm.median)});
    }
    table.print(out, "    ");
  }

  // The conclusion, from the numbers of the first and the largest d.
  const auto widest = std::max_element(results.dims.begin(), results.dims.end(),
                                       [](const DimResult& a, const DimResult& b) { return a.d < b.d; });
  const auto narrowest = std::min_element(results.dims.begin(), results.dims.end(),
                                          [](const DimResult& a, const DimResult& b) { return a.d < b.d; });
  out << "\n    Without the scale, from d = " << narrowest->d << " to d = " << widest->d
      << ": largest weight " << format("%.3f", narrowest->unscaled.max_weight.mean) << " → "
      << format("%.3f", widest->unscaled.max_weight.mean) << ",\n    median ‖∂L/∂S‖ "
      << format("%.3g", narrowest->unscaled.grad_norm.median) << " → "
      << format("%.3g", widest->unscaled.grad_norm.median) << ", dead rows "
      << format("%.1f", 100.0 * narrowest->unscaled.dead.mean) << " % → "
      << format("%.1f", 100.0 * widest->unscaled.dead.mean)
      << " %.\n    The few near-tied rows that stay alive get large gradients, so training sees "
         "gradients\n    that are mostly zero and sometimes huge. With 1/√d, at d = "
      << widest->d << " the largest weight is " << format("%.3f", widest->scaled.max_weight.mean)
      << ",\n    the median ‖∂L/∂S‖ " << format("%.3g", widest->scaled.grad_norm.median) << " and "
      << format("%.1f", 100.0 * widest->scaled.dead.mean) << " % of rows are dead.\n\n";

  print_softmax_section(results, out);
  print_softcap_section(results, out);
}

void print_json(const ExplainResults& results, std::ostream& out) {
  const ExplainConfig& c = results.config;
  Json json;
  json["seed"] = static_cast<int64_t>(c.seed);
  json["samples"] = c.samples;
  json["keys"] = c.keys;
  json["dims"] = c.dims;
  json["dead_jacobian_threshold"] = json_number(kDeadJacobian);
  json["saturation_threshold"] = json_number(kSaturated);
  json["softcap"] = json_number(c.softcap);
  json["softcap_weight_bound"] = json_number(softcap_weight_bound(c.softcap, c.keys));
  json["backends"] = {{"weights", results.weights_backend}, {"backward", results.backward_backend}};

  Json& variance = json["variance"] = Json::array();
  for (const DimResult& r : results.dims) {
    variance.push_back({{"d", r.d},
                        {"unscaled", json_number(r.var_unscaled)},
                        {"unscaled_theory", r.d},
                        {"scaled", json_number(r.var_scaled)},
                        {"scaled_theory", 1},
                        {"relative_std_error", json_number(r.var_relative_std_error)}});
  }

  const auto estimate = [](const Estimate& e) {
    return Json{{"mean", json_number(e.mean)}, {"std_error", json_number(e.std_error)},
                {"median", json_number(e.median)}};
  };
  const auto stats = [&](const RowStats& s) {
    return Json{{"max_weight", estimate(s.max_weight)},
                {"entropy", estimate(s.entropy)},
                {"jacobian_norm", estimate(s.jacobian_norm)},
                {"grad_norm", estimate(s.grad_norm)},
                {"query_grad_norm", estimate(s.query_grad_norm)},
                {"dead", estimate(s.dead)},
                {"saturated", estimate(s.saturated)}};
  };
  Json& rows = json["rows"] = Json::array();
  for (const DimResult& r : results.dims) {
    rows.push_back({{"d", r.d},
                    {"unscaled", stats(r.unscaled)},
                    {"scaled", stats(r.scaled)},
                    {"capped_unscaled", stats(r.capped_unscaled)},
                    {"capped_scaled", stats(r.capped_scaled)}});
  }

  Json& softmax = json["softmax"] = Json::array();
  for (const SoftmaxExample* e : {&results.huge, &results.moderate}) {
    Json jacobian = Json::array();
    const std::size_t n = e->x.size();
    for (std::size_t i = 0; i < n; ++i) {
      Json row = Json::array();
      for (std::size_t j = 0; j < n; ++j) row.push_back(json_number(e->jacobian[i * n + j]));
      jacobian.push_back(std::move(row));
    }
    softmax.push_back({{"x", json_numbers(e->x)},
                       {"s", json_numbers(e->s)},
                       {"jacobian", std::move(jacobian)},
                       {"attention_weights", json_numbers(e->attention_weights)},
                       {"attention_lse", json_number(e->attention_lse)}});
  }
  write_json(json, out);
}

std::string gnuplot_script(const ExplainResults& results) {
  const ExplainConfig& c = results.config;
  std::ostringstream s;
  const auto g = [](double v) { return format("%.9g", v); };
  s << "$variance << EOD\n# d  Var(q.k)  s.e.  Var(q.k/sqrt d)  s.e.\n";
  for (const DimResult& r : results.dims) {
    s << r.d << ' ' << g(r.var_unscaled) << ' ' << g(r.var_relative_std_error * static_cast<double>(r.d))
      << ' ' << g(r.var_scaled) << ' ' << g(r.var_relative_std_error) << '\n';
  }
  s << "EOD\n$rows << EOD\n"
    << "# d  maxw_u maxw_s  entropy/lnL_u _s  meanJ_u _s  median_dS_u _s  dead_u _s  median_dq_u _s\n";
  const double log_keys = std::log(static_cast<double>(c.keys));
  for (const DimResult& r : results.dims) {
    s << r.d << ' ' << g(r.unscaled.max_weight.mean) << ' ' << g(r.scaled.max_weight.mean) << ' '
      << g(r.unscaled.entropy.mean / log_keys) << ' ' << g(r.scaled.entropy.mean / log_keys) << ' '
      << g(r.unscaled.jacobian_norm.mean) << ' ' << g(r.scaled.jacobian_norm.mean) << ' '
      << g(r.unscaled.grad_norm.median) << ' ' << g(r.scaled.grad_norm.median) << ' '
      << g(r.unscaled.dead.mean) << ' ' << g(r.scaled.dead.mean) << ' '
      << g(r.unscaled.query_grad_norm.median) << ' ' << g(r.scaled.query_grad_norm.median) << '\n';
  }
  s << "EOD\n";
  const auto [dmin, dmax] = std::minmax_element(c.dims.begin(), c.dims.end());
  s << "set xrange [" << g(static_cast<double>(*dmin) / 1.6) << ":" << g(static_cast<double>(*dmax) * 1.6)
    << "]\n"
    << "set logscale x 2\nset grid\nset key top left box opaque\nset pointsize 1.2\n"
    << "set xlabel 'head dim d'\n"
    << "red = '#c0392b'; blue = '#2563eb'\n"
    << "set multiplot layout 2,2 title \"qkv explain — why attention divides its logits by √d   ("
    << c.samples << " rows per d, " << c.keys << " keys, seed " << c.seed << ")\" font ',13'\n";
  // 1: variance of the logits.
  s << "set title 'Variance of a logit: grows like d without the scale'\n"
    << "set logscale y 10\nset ylabel 'variance'\nset format y '%g'\n"
    << "plot $variance using 1:2:(2*$3) with yerrorbars pt 7 lc rgb red title 'Var(q·k), measured ±2 s.e.', \\\n"
    << "     x with lines dt 2 lc rgb red title 'theory: d', \\\n"
    << "     $variance using 1:4:(2*$5) with yerrorbars pt 5 lc rgb blue title 'Var(q·k/√d), measured', \\\n"
    << "     1 with lines dt 2 lc rgb blue title 'theory: 1'\n";
  // 2: saturation.
  s << "set title 'Softmax saturation: rows go one-hot without the scale'\n"
    << "unset logscale y\nset yrange [0:1.05]\nset ylabel 'mean over rows'\nset key center right\n"
    << "plot $rows using 1:2 with linespoints pt 7 lc rgb red title 'largest weight, unscaled', \\\n"
    << "     $rows using 1:3 with linespoints pt 5 lc rgb blue title 'largest weight, scaled', \\\n"
    << "     $rows using 1:4 with linespoints pt 6 dt 2 lc rgb red title 'entropy / ln L, unscaled', \\\n"
    << "     $rows using 1:5 with linespoints pt 4 dt 2 lc rgb blue title 'entropy / ln L, scaled'\n";
  // 3: gradient norms (log scale: the median collapses by orders of magnitude).
  s << "set title 'Gradient through the softmax: vanishes without the scale'\n"
    << "set autoscale y\nset logscale y 10\nset format y '10^{%T}'\nset ylabel 'norm'\nset key bottom left\n"
    << "plot $rows using 1:8 with linespoints pt 7 lc rgb red title 'median ‖∂L/∂S‖, unscaled', \\\n"
    << "     $rows using 1:9 with linespoints pt 5 lc rgb blue title 'median ‖∂L/∂S‖, scaled', \\\n"
    << "     $rows using 1:6 with linespoints pt 6 dt 2 lc rgb red title 'mean ‖J‖_F, unscaled', \\\n"
    << "     $rows using 1:7 with linespoints pt 4 dt 2 lc rgb blue title 'mean ‖J‖_F, scaled'\n";
  // 4: dead rows.
  s << "set title 'Rows whose softmax passes back < 0.1 % of any gradient (‖J‖_F < 10^{-3})'\n"
    << "unset logscale y\nset format y '%g%%'\nset yrange [-2:102]\nset ylabel 'share of rows'\n"
    << "set key top left\n"
    << "plot $rows using 1:(100*$10) with linespoints pt 7 lc rgb red title 'unscaled', \\\n"
    << "     $rows using 1:(100*$11) with linespoints pt 5 lc rgb blue title 'scaled'\n"
    << "unset multiplot\n";
  return s.str();
}

}  // namespace qkv::cli
