// qkv explain: the numbers it prints are the numbers the theory predicts.
//
// (a) has a closed form (Var(q·k) = d, Var(q·k/√d) = 1). (b) and (c) do not, so they are
// checked against an independent Monte Carlo that does not use the library or its
// attention kernels: given q, the logits q·k_j of i.i.d. N(0, 1) keys are i.i.d.
// N(0, |q|²) with |q|² ~ χ²_d, so a row's weights can be drawn from L + d normals instead
// of (L + 1)·d; and ∂L/∂q = scale·Σ_j dS_j k_j splits into the part along q, whose norm is
// |Σ_j dS_j z_j| (z_j = q·k_j/|q|), and an independent part orthogonal to q, whose squared
// norm is ‖dS‖²·χ²_{d−1}. Every comparison allows 5 standard errors derived from the two
// sample counts, so a correct program fails one with probability below ~1e-6.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

#include "cli_test_support.hpp"
#include "explain.hpp"
#include "qkv/error.hpp"

namespace qkv::cli {
namespace {

constexpr double kSigmas = 5.0;
// Rows explain draws per d in these tests; every bound below follows from it. The
// sanitizer build runs the library ~20× slower, so it draws fewer (looser bounds, same
// claims).
#if defined(__SANITIZE_ADDRESS__)
constexpr int64_t kSamples = 128;
#else
constexpr int64_t kSamples = 512;
#endif
constexpr int64_t kKeys = 64;
constexpr int64_t kReferenceRows = 20000;  // rows of the independent Monte Carlo

const ExplainResults& results() {
  static const ExplainResults cached = [] {
    ExplainConfig config;
    config.seed = 7;
    config.samples = kSamples;
    config.keys = kKeys;
    config.dims = {4, 64, 1024};
    return run_experiments(config);
  }();
  return cached;
}

// Per-row values of every statistic from the conditional distribution of the logits.
struct Reference {
  std::vector<double> max_weight, entropy, jacobian_norm, grad_norm, query_grad_norm, dead,
      saturated;
};

double chi_square(std::mt19937_64& rng, int64_t k) {
  if (k == 0) return 0.0;
  return std::chi_squared_distribution<double>(static_cast<double>(k))(rng);
}

Reference reference(int64_t d, bool scaled, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  Reference ref;
  const double scale = scaled ? 1.0 / std::sqrt(static_cast<double>(d)) : 1.0;
  std::vector<double> z(kKeys), p(kKeys), g(kKeys), ds(kKeys);
  for (int64_t row = 0; row < kReferenceRows; ++row) {
    const double q_norm = std::sqrt(chi_square(rng, d));
    for (double& v : z) v = normal(rng);
    for (double& v : g) v = normal(rng);
    // Softmax of the logits scale·|q|·z_j, written out here (not qkv::softmax).
    double top = -INFINITY;
    for (double v : z) top = std::max(top, scale * q_norm * v);
    double sum = 0.0;
    for (int64_t j = 0; j < kKeys; ++j) sum += p[j] = std::exp(scale * q_norm * z[j] - top);
    double largest = 0.0, entropy = 0.0, s2 = 0.0, s3 = 0.0, pg = 0.0;
    for (int64_t j = 0; j < kKeys; ++j) {
      p[j] /= sum;
      largest = std::max(largest, p[j]);
      if (p[j] > 0.0) entropy -= p[j] * std::log(p[j]);
      s2 += p[j] * p[j];
      s3 += p[j] * p[j] * p[j];
      pg += p[j] * g[j];
    }
    // ‖diag(p) − p·pᵀ‖_F² = Σ p² − 2 Σ p³ + (Σ p²)², without building the matrix.
    const double j_norm = std::sqrt(std::max(0.0, s2 - 2.0 * s3 + s2 * s2));
    double ds2 = 0.0, along = 0.0;
    for (int64_t j = 0; j < kKeys; ++j) {
      ds[j] = p[j] * (g[j] - pg);
      ds2 += ds[j] * ds[j];
      along += ds[j] * z[j];
    }
    const double dq2 = scale * scale * (along * along + ds2 * chi_square(rng, d - 1));
    ref.max_weight.push_back(largest);
    ref.entropy.push_back(entropy);
    ref.jacobian_norm.push_back(j_norm);
    ref.grad_norm.push_back(std::sqrt(ds2));
    ref.query_grad_norm.push_back(std::sqrt(dq2));
    ref.dead.push_back(j_norm < kDeadJacobian ? 1.0 : 0.0);
    ref.saturated.push_back(largest > kSaturated ? 1.0 : 0.0);
  }
  return ref;
}

double mean(const std::vector<double>& x) {
  double s = 0.0;
  for (double v : x) s += v;
  return s / static_cast<double>(x.size());
}

double sd(const std::vector<double>& x) {
  const double m = mean(x);
  double s = 0.0;
  for (double v : x) s += (v - m) * (v - m);
  return std::sqrt(s / static_cast<double>(x.size() - 1));
}

// explain's mean against the reference's: the difference of two independent sample
// means has standard deviation σ·√(1/n + 1/N), σ estimated from the N reference rows.
// For a share (0/1 values) near 0 the plug-in σ would be 0, so σ² is floored at
// 1/n: a few stray rows in explain's sample are then tolerated, not fatal.
void expect_mean_matches(const Estimate& got, const std::vector<double>& ref, const std::string& what,
                         bool is_share = false) {
  double sigma = sd(ref);
  if (is_share) sigma = std::max(sigma, std::sqrt(1.0 / static_cast<double>(kSamples)));
  const double bound = kSigmas * sigma *
                       std::sqrt(1.0 / static_cast<double>(kSamples) + 1.0 / static_cast<double>(kReferenceRows));
  EXPECT_NEAR(got.mean, mean(ref), bound) << what;
}

// explain's median m against the reference distribution F: F(m) of a sample median of
// n rows has standard deviation 0.5/√n; the reference's empirical F is within
// √(ln(2/δ)/(2N)) of the true one with probability 1 − δ (Dvoretzky–Kiefer–Wolfowitz),
// δ = 1e-6.
void expect_median_matches(const Estimate& got, std::vector<double> ref, const std::string& what) {
  std::sort(ref.begin(), ref.end());
  const double below = static_cast<double>(std::lower_bound(ref.begin(), ref.end(), got.median) - ref.begin()) /
                       static_cast<double>(ref.size());
  const double bound = kSigmas * 0.5 / std::sqrt(static_cast<double>(kSamples)) +
                       std::sqrt(std::log(2.0 / 1e-6) / (2.0 * static_cast<double>(kReferenceRows)));
  EXPECT_NEAR(below, 0.5, bound) << what << ": explain's median " << got.median;
}

TEST(Explain, LogitVarianceIsDWithoutTheScaleAndOneWithIt) {
  for (const DimResult& r : results().dims) {
    // s.e. of a sample variance relative to σ², √((2 + 6/d)/n) (see explain.hpp).
    const double relative = std::sqrt((2.0 + 6.0 / static_cast<double>(r.d)) / static_cast<double>(kSamples));
    EXPECT_DOUBLE_EQ(r.var_relative_std_error, relative);
    EXPECT_NEAR(r.var_unscaled / static_cast<double>(r.d), 1.0, kSigmas * relative) << "d = " << r.d;
    EXPECT_NEAR(r.var_scaled, 1.0, kSigmas * relative) << "d = " << r.d;
  }
}

TEST(Explain, SaturationAndGradientsMatchAnIndependentMonteCarlo) {
  std::uint64_t seed = 1000;
  for (const DimResult& r : results().dims) {
    for (const bool scaled : {false, true}) {
      const RowStats& got = scaled ? r.scaled : r.unscaled;
      const Reference ref = reference(r.d, scaled, ++seed);
      const std::string where = std::string(scaled ? "scaled" : "unscaled") + ", d = " + std::to_string(r.d);
      expect_mean_matches(got.max_weight, ref.max_weight, "largest weight, " + where);
      expect_mean_matches(got.entropy, ref.entropy, "entropy, " + where);
      expect_mean_matches(got.jacobian_norm, ref.jacobian_norm, "‖J‖_F, " + where);
      expect_mean_matches(got.grad_norm, ref.grad_norm, "‖∂L/∂S‖, " + where);
      expect_mean_matches(got.query_grad_norm, ref.query_grad_norm, "‖∂L/∂q‖, " + where);
      expect_mean_matches(got.dead, ref.dead, "dead rows, " + where, true);
      expect_mean_matches(got.saturated, ref.saturated, "saturated rows, " + where, true);
      expect_median_matches(got.grad_norm, ref.grad_norm, "median ‖∂L/∂S‖, " + where);
      expect_median_matches(got.query_grad_norm, ref.query_grad_norm, "median ‖∂L/∂q‖, " + where);
      // The reported standard error is the sample sd over √n. A sample sd from n rows has
      // relative standard deviation ≈ √((β₂ − 1)/(4n)), β₂ = m₄/σ⁴ the kurtosis, here
      // estimated from the reference rows.
      const double sigma = sd(ref.max_weight), m = mean(ref.max_weight);
      double m4 = 0.0;
      for (double v : ref.max_weight) m4 += std::pow(v - m, 4);
      m4 /= static_cast<double>(ref.max_weight.size());
      const double relative = std::sqrt((m4 / std::pow(sigma, 4) - 1.0) / (4.0 * static_cast<double>(kSamples)));
      const double expected = sigma / std::sqrt(static_cast<double>(kSamples));
      EXPECT_NEAR(got.max_weight.std_error, expected, kSigmas * relative * expected) << where;
    }
  }
}

// Inequalities that hold for every sample, not just on average.
TEST(Explain, ExactBoundsBetweenTheStatistics) {
  const double L = static_cast<double>(kKeys);
  constexpr double kRounding = 1e-5;  // weights are float32; rows sum to 1 within ~L·2⁻²⁴
  for (const DimResult& r : results().dims) {
    for (const RowStats* s : {&r.unscaled, &r.scaled}) {
      EXPECT_GE(s->max_weight.mean, 1.0 / L - kRounding);
      EXPECT_LE(s->max_weight.mean, 1.0 + kRounding);
      EXPECT_GE(s->entropy.mean, -kRounding);
      EXPECT_LE(s->entropy.mean, std::log(L) + kRounding);
      // Shannon entropy ≥ min-entropy per row (H ≥ −ln max P), and −ln is convex, so
      // mean H ≥ −ln(mean max P).
      EXPECT_GE(s->entropy.mean, -std::log(s->max_weight.mean) - kRounding);
      // J is positive semi-definite, so ‖J‖_F ≤ trace J = 1 − ΣP² ≤ 1 − (max P)², and
      // mean(max P)² ≥ (mean max P)²: saturation forces the Jacobian to vanish.
      EXPECT_LE(s->jacobian_norm.mean, 1.0 - s->max_weight.mean * s->max_weight.mean + kRounding);
      EXPECT_GE(s->dead.mean, 0.0);
      EXPECT_LE(s->dead.mean, 1.0);
    }
  }
}

// What a reader of the output is told, stated as the tests' own claims.
TEST(Explain, TheStoryTheTablesTell) {
  const auto& dims = results().dims;
  const auto se_diff = [](const Estimate& a, const Estimate& b) {
    return kSigmas * std::hypot(a.std_error, b.std_error);
  };
  for (std::size_t i = 1; i < dims.size(); ++i) {
    // Unscaled: the largest weight grows with d, the entropy falls.
    EXPECT_GT(dims[i].unscaled.max_weight.mean - dims[i - 1].unscaled.max_weight.mean,
              se_diff(dims[i].unscaled.max_weight, dims[i - 1].unscaled.max_weight));
    EXPECT_LT(dims[i].unscaled.entropy.mean - dims[i - 1].unscaled.entropy.mean,
              -se_diff(dims[i].unscaled.entropy, dims[i - 1].unscaled.entropy));
  }
  const DimResult& widest = dims.back();
  // Without the scale most rows are nearly one-hot at d = 1024 and half the rows dead;
  // with it, no row is.
  EXPECT_GT(widest.unscaled.max_weight.mean, 0.9);
  EXPECT_GT(widest.unscaled.dead.mean, 0.4);
  EXPECT_EQ(widest.scaled.dead.mean, 0.0);
  EXPECT_LT(widest.unscaled.grad_norm.median, 0.01 * widest.scaled.grad_norm.median);
}

// (e): soft-capping. With 1/√d the logits are ~N(0, 1), so a cap of 50 changes each
// row's logits by at most |S|³/(3c²) (tanh x = x − x³/3 + …): the capped and uncapped
// scaled rows must agree within a few standard errors. Without 1/√d the cap squeezes
// the largest logits: at d = 1024 it must revive most of the dead rows (measured:
// 57 % → 5 % at c = 50, L = 64).
TEST(Explain, SoftcapLeavesScaledRowsAloneAndRevivesUnscaledOnes) {
  const auto& dims = results().dims;
  for (const DimResult& r : dims) {
    EXPECT_NEAR(r.capped_scaled.max_weight.mean, r.scaled.max_weight.mean,
                kSigmas * r.scaled.max_weight.std_error);
    EXPECT_EQ(r.capped_scaled.dead.mean, 0.0);
  }
  const DimResult& widest = dims.back();
  EXPECT_LT(widest.capped_unscaled.dead.mean, 0.5 * widest.unscaled.dead.mean);
  EXPECT_GT(widest.capped_unscaled.query_grad_norm.median,
            10.0 * widest.unscaled.query_grad_norm.median);
}

// A small cap is a hard bound on every row's largest weight: 1/(1 + (L − 1)e^(−2c)).
TEST(Explain, SoftcapBoundsTheLargestWeight) {
  ExplainConfig config;
  config.samples = 64;
  config.keys = 8;
  config.dims = {256};
  config.softcap = 1.0;
  const ExplainResults r = run_experiments(config);
  const double bound = softcap_weight_bound(1.0, 8);
  EXPECT_NEAR(bound, 1.0 / (1.0 + 7.0 * std::exp(-2.0)), 1e-15);
  // Every row is under the bound, so the mean is too (float32 rounding aside); the
  // uncapped rows at d = 256 are far above it.
  EXPECT_LE(r.dims[0].capped_unscaled.max_weight.mean, bound + 1e-6);
  EXPECT_GT(r.dims[0].unscaled.max_weight.mean, bound + 0.2);
  std::ostringstream text;
  print_softcap_section(r, text);
  EXPECT_NE(text.str().find("(e) Soft-capping"), std::string::npos);
  EXPECT_NE(text.str().find("here c = 1"), std::string::npos);
}

TEST(Explain, DeterministicForASeed) {
  ExplainConfig config;
  config.samples = 64;
  config.keys = 8;
  config.dims = {3, 33};
  const ExplainResults a = run_experiments(config);
  const ExplainResults b = run_experiments(config);
  std::ostringstream ja, jb;
  print_json(a, ja);
  print_json(b, jb);
  EXPECT_EQ(ja.str(), jb.str());
  config.seed = 2;
  std::ostringstream jc;
  print_json(run_experiments(config), jc);
  EXPECT_NE(ja.str(), jc.str());
  // A d's rows depend on (seed, d) only, not on which other dims are measured.
  config.seed = 1;
  config.dims = {33};
  const ExplainResults alone = run_experiments(config);
  EXPECT_EQ(alone.dims[0].var_unscaled, a.dims[1].var_unscaled);
  EXPECT_EQ(alone.dims[0].unscaled.grad_norm.median, a.dims[1].unscaled.grad_norm.median);
}

TEST(Explain, HugeLogitSoftmaxMatchesTheGoldenOutput) {
  ExplainResults r;
  r.huge = softmax_example({1.0, 2.0, 3.0, 1e6});
  r.moderate = softmax_example({1.0, 2.0, 3.0, 4.0});
  EXPECT_EQ(r.huge.s, (std::vector<double>{0, 0, 0, 1}));
  for (double v : r.huge.jacobian) EXPECT_EQ(v, 0.0);
  EXPECT_EQ(r.huge.attention_weights, (std::vector<double>{0, 0, 0, 1}));
  EXPECT_EQ(r.huge.attention_lse, 1e6);
  // The moderate example's Jacobian: symmetric, rows summing to 0, diagonal s(1 − s).
  for (std::size_t i = 0; i < 4; ++i) {
    double row = 0.0;
    for (std::size_t j = 0; j < 4; ++j) {
      row += r.moderate.jacobian[i * 4 + j];
      EXPECT_EQ(r.moderate.jacobian[i * 4 + j], r.moderate.jacobian[j * 4 + i]);
    }
    EXPECT_NEAR(row, 0.0, 1e-16);
    EXPECT_NEAR(r.moderate.jacobian[i * 5], r.moderate.s[i] * (1 - r.moderate.s[i]), 1e-16);
  }
  std::ostringstream text;
  print_softmax_section(r, text);
  EXPECT_EQ(text.str(), test::read_text(std::string(QKV_CLI_TEST_DATA) + "/explain_softmax.golden.txt"));
}

TEST(Explain, CommandPrintsTablesJsonAndPlots) {
  const std::vector<std::string> small{"explain", "--samples", "64", "--keys", "8", "--dims", "2,8"};
  auto args = small;
  const auto text = test::run_cli(args);
  ASSERT_EQ(text.code, 0) << text.err;
  for (const char* section :
       {"(a) The variance", "(b) Large logits", "(c) A saturated", "(d) softmax", "(e) Soft-capping"}) {
    EXPECT_NE(text.out.find(section), std::string::npos) << section;
  }
  args.push_back("--json");
  const auto json = test::run_cli(args);
  ASSERT_EQ(json.code, 0) << json.err;
  EXPECT_EQ(json.out.substr(0, 1), "{");
  EXPECT_NE(json.out.find("\"samples\": 64"), std::string::npos);
  EXPECT_NE(json.out.find("\"softcap\": 50"), std::string::npos);
  EXPECT_NE(json.out.find("\"capped_unscaled\""), std::string::npos);

  test::ScratchDir dir;
  args = small;
  args.insert(args.end(), {"--plot", dir / "bad.txt"});
  const auto bad = test::run_cli(args);
  EXPECT_EQ(bad.code, kExitFailure);
  EXPECT_NE(bad.err.find(".png or .svg"), std::string::npos);
  args.back() = dir / "missing/plot.png";
  EXPECT_EQ(test::run_cli(args).code, kExitFailure);

  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) GTEST_SKIP() << "gnuplot is not installed";
  for (const char* name : {"explain.svg", "explain.png"}) {
    args = small;
    args.insert(args.end(), {"--plot", dir / name});
    const auto plotted = test::run_cli(args);
    ASSERT_EQ(plotted.code, 0) << plotted.err;
    const std::string picture = test::read_text(dir / name);
    if (std::string(name).ends_with(".svg")) {
      EXPECT_NE(picture.find("<svg"), std::string::npos);
      EXPECT_NE(picture.find("Variance of a logit"), std::string::npos);
      EXPECT_NE(picture.find("Softmax saturation"), std::string::npos);
    } else {
      EXPECT_EQ(picture.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
      EXPECT_GT(picture.size(), 20000u);
    }
  }
  EXPECT_EQ(dir.listing(), (std::vector<std::string>{"explain.png", "explain.svg"}));  // no temporaries
}

TEST(Explain, RejectsOutOfRangeConfigurations) {
  ExplainConfig config;
  config.keys = 1;
  EXPECT_THROW(run_experiments(config), Error);
  config = {};
  config.samples = 2;
  EXPECT_THROW(run_experiments(config), Error);
  config = {};
  config.dims = {};
  EXPECT_THROW(run_experiments(config), Error);
  for (double bad : {0.0, -1.0, std::nan(""), 1e7}) {
    config = {};
    config.softcap = bad;
    EXPECT_THROW(run_experiments(config), Error) << bad;
  }
}

}  // namespace
}  // namespace qkv::cli
