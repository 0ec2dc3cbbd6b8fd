// The experiments of `qkv explain` (their presentation: explain_text.cpp,
// explain_json.cpp, explain_plot.cpp). Every number comes out of the library:
// attention_forward (log-sum-exp, weights and softmax statistics), attention_backward,
// qkv::softmax and qkv::softmax_jacobian. This file only draws the inputs and averages
// what the library returns.
#include "explain.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "format.hpp"
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

}  // namespace qkv::cli
