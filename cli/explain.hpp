// `qkv explain`: the experiments behind the 1/√d argument, run through the library.
//
// For every head dim d, `samples` independent attention rows: a query q and `keys` keys
// k_1..k_L, all entries i.i.d. N(0, 1) (each row has its own q and keys, so rows are
// independent and every standard error below is sample sd / √samples). The same rows are
// used unscaled (scale = 1) and scaled (the library's default 1/√d), so the two columns
// differ only by the scale.
//
//   (a) logit variance: q·k_1 with scale 1 and 1/√d, taken from attention_forward's
//       log-sum-exp over the single key k_1 (lse = scale·q·k_1 exactly);
//   (b) saturation: largest weight and entropy −Σ P log P of each row, and whether its
//       largest weight exceeds kSaturated, all from attention_forward's softmax
//       statistics (qkv/attention_stats.hpp), the same numbers any user gets;
//   (c) gradient flow: J = softmax_jacobian(P) = diag(P) − P·Pᵀ, ‖J‖_F; for a random
//       upstream gradient g = ∂L/∂P ~ N(0, I), ∂L/∂S = J·g; and the gradient that
//       reaches the query, ∂L/∂q from attention_backward with V = I (so out = P and
//       dout = g = ∂L/∂P);
//   (d) softmax((1, 2, 3, 10⁶)) and its Jacobian (qkv::softmax, qkv::softmax_jacobian),
//       and the same row as the additive mask of one attention row;
//   (e) soft-capping, S ← c·tanh(S/c) (AttentionOptions::softcap; Gemma 2 uses c = 50):
//       the same rows, unscaled and scaled, with the cap. It bounds |S| < c, so the
//       largest weight is at most 1/(1 + (L − 1)·e^(−2c)); the table shows how far that
//       goes and what reaches q, whose gradient now also carries tanh's slope 1 − tanh².
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace qkv::cli {

struct ExplainConfig {
  std::uint64_t seed = 1;
  int64_t samples = 2048;  // attention rows per head dim
  int64_t keys = 64;       // keys per row (the softmax length L)
  std::vector<int64_t> dims{4, 16, 64, 256, 1024};
  double softcap = 50.0;   // (e): the cap c (Gemma 2's attention logit cap)
};

// Limits that keep one run within memory and time a user would expect.
inline constexpr int64_t kMinSamples = 16, kMaxSamples = 1 << 22;
inline constexpr int64_t kMinKeys = 2, kMaxKeys = 1024;  // J is L×L per row
inline constexpr int64_t kMaxDim = 1 << 16;
inline constexpr double kMaxSoftcap = 1e6;
// A row is "dead" when ‖J‖_F < this: whatever the upstream gradient g, the softmax
// passes back ‖J·g‖ ≤ ‖J‖₂‖g‖ ≤ ‖J‖_F‖g‖, under 0.1 % of it.
inline constexpr double kDeadJacobian = 1e-3;
// A row is saturated when its largest weight exceeds this (the library's default).
inline constexpr double kSaturated = 0.99;

// Mean of one per-row statistic, its standard error (sample sd / √n) and its median.
struct Estimate {
  double mean = 0.0;
  double std_error = 0.0;
  double median = 0.0;
};

struct RowStats {
  Estimate max_weight;     // max_j P_j            ∈ [1/L, 1]
  Estimate entropy;        // −Σ_j P_j ln P_j      ∈ [0, ln L]
  Estimate jacobian_norm;  // ‖diag(P) − P·Pᵀ‖_F   ∈ [0, 1)
  Estimate grad_norm;      // ‖∂L/∂S‖ = ‖J·g‖
  Estimate query_grad_norm;  // ‖∂L/∂q‖
  Estimate dead;           // share of rows with ‖J‖_F < kDeadJacobian (mean of 0/1)
  Estimate saturated;      // share of rows with largest weight > kSaturated (mean of 0/1)
};

struct DimResult {
  int64_t d = 0;
  // Unbiased sample variances of q·k and q·k/√d over the rows, and the theory (d, 1).
  double var_unscaled = 0.0, var_scaled = 0.0;
  // Standard error of a sample variance relative to the true variance, from the sample
  // count: for X = Σ_c q_c k_c, κ₄(X) = 6d (E[q⁴]E[k⁴] − 3 = 6 per term), so
  // Var(s²) ≈ (κ₄ + 2σ⁴)/n = (6d + 2d²)/n and s.e.(s²)/σ² = √((2 + 6/d)/n).
  double var_relative_std_error = 0.0;
  RowStats unscaled, scaled;
  RowStats capped_unscaled, capped_scaled;  // (e): the same rows with the soft-cap
};

struct SoftmaxExample {
  std::vector<double> x;         // logits
  std::vector<double> s;         // qkv::softmax(x)
  std::vector<double> jacobian;  // qkv::softmax_jacobian(s), n×n row-major
  std::vector<double> attention_weights;  // the weights of one attention row with bias x
  double attention_lse = 0.0;             // its log-sum-exp
};

struct ExplainResults {
  ExplainConfig config;
  std::string weights_backend;   // what attention_forward ran on when weights were asked
  std::string backward_backend;  // what attention_backward ran on
  std::vector<DimResult> dims;
  SoftmaxExample huge;      // x = (1, 2, 3, 10⁶)
  SoftmaxExample moderate;  // x = (1, 2, 3, 4), for contrast
};

// Throws qkv::Error naming the option when the configuration is out of range.
void validate(const ExplainConfig& config);
// Runs every experiment. Deterministic for a given configuration and backend.
ExplainResults run_experiments(const ExplainConfig& config);
// (e)'s bound on the largest weight of a row of L logits capped at c.
double softcap_weight_bound(double cap, int64_t keys);
// (d) alone (cheap, deterministic).
SoftmaxExample softmax_example(const std::vector<double>& x);

void print_text(const ExplainResults& results, std::ostream& out);
void print_softmax_section(const ExplainResults& results, std::ostream& out);
void print_softcap_section(const ExplainResults& results, std::ostream& out);
void print_json(const ExplainResults& results, std::ostream& out);
// gnuplot commands for a 2×2 page of charts (no terminal, no output).
std::string gnuplot_script(const ExplainResults& results);

}  // namespace qkv::cli
