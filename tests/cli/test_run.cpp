// qkv run: results against the library's fp64 reference, exact golden cases, and every
// error path (each must leave the output directory exactly as it was).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "cli_test_support.hpp"
#include "npy.hpp"
#include "qkv/qkv.hpp"

namespace qkv::cli {
namespace {

using test::run_cli;
using test::ScratchDir;

std::vector<float> random_values(int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> values(static_cast<std::size_t>(n));
  for (float& v : values) v = normal(rng);
  return values;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t e : shape) n *= e;
  return n;
}

std::vector<float> write_random(const std::string& path, const std::vector<int64_t>& shape, std::uint64_t seed) {
  auto values = random_values(numel(shape), seed);
  npy::write(path, shape, values);
  return values;
}

// The fp32 kernels accumulate d- and Nk-long sums of O(1) products; with d, Nk ≤ 16 their
// error against the fp64 reference is a few units of 2⁻²⁴·(d + Nk) ≈ 2e-6. 2e-5 leaves
// a factor of ten and still catches any wrong index, mask or scale (errors of O(0.1)).
constexpr double kTolerance = 2e-5;

void expect_close(const std::vector<float>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]));
    if (std::isnan(got[i])) worst = INFINITY;
  }
  EXPECT_LE(worst, kTolerance) << what;
}

// q, k, v and dout in [B, S, H, D] (bshd), the reference in double through the library.
struct Problem {
  int64_t B = 2, Nq = 5, Nk = 7, Hq = 4, Hkv = 2, d = 8, dv = 6;
  std::vector<float> q, k, v, dout;

  Problem() {
    q = random_values(B * Nq * Hq * d, 1);
    k = random_values(B * Nk * Hkv * d, 2);
    v = random_values(B * Nk * Hkv * dv, 3);
    dout = random_values(B * Nq * Hq * dv, 4);
  }

  struct Expected {
    std::vector<double> out, lse, weights, dq, dk, dv;
  };
  Expected reference(AttentionOptions options) const {
    options.execution.backend = Backend::reference;
    const auto as_double = [](const std::vector<float>& x, std::array<int64_t, 4> shape) {
      Tensor<double, 4> t(shape);
      for (std::size_t i = 0; i < x.size(); ++i) t[i] = x[i];
      return t;
    };
    auto tq = as_double(q, {B, Nq, Hq, d}), tk = as_double(k, {B, Nk, Hkv, d}),
         tv = as_double(v, {B, Nk, Hkv, dv}), tdo = as_double(dout, {B, Nq, Hq, dv});
    Tensor<double, 4> out({B, Nq, Hq, dv}), w({B, Hq, Nq, Nk}), dq({B, Nq, Hq, d}), dk({B, Nk, Hkv, d}),
        dvv({B, Nk, Hkv, dv});
    Tensor<double, 3> lse({B, Hq, Nq});
    attention_forward({.q = tq.cview(), .k = tk.cview(), .v = tv.cview(), .out = out.view(), .lse = lse.view(),
                       .weights = w.view()},
                      options);
    attention_backward({.q = tq.cview(), .k = tk.cview(), .v = tv.cview(), .out = out.cview(),
                        .lse = lse.cview(), .dout = tdo.cview(), .dq = dq.view(), .dk = dk.view(),
                        .dv = dvv.view()},
                       options);
    const auto flat = [](const auto& t) { return std::vector<double>(t.data(), t.data() + t.size()); };
    return {flat(out), flat(lse), flat(w), flat(dq), flat(dk), flat(dvv)};
  }
};

// [B, S, H, D] → [B, H, S, D] and back.
std::vector<float> swap_seq_heads(const std::vector<float>& x, int64_t B, int64_t S, int64_t H, int64_t D) {
  std::vector<float> y(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t c = 0; c < D; ++c) y[((b * H + h) * S + s) * D + c] = x[((b * S + s) * H + h) * D + c];
  return y;
}

TEST(Run, ForwardAndBackwardMatchTheReference) {
  ScratchDir dir;
  Problem p;
  npy::write(dir / "q.npy", std::vector<int64_t>{p.B, p.Nq, p.Hq, p.d}, p.q);
  npy::write(dir / "k.npy", std::vector<int64_t>{p.B, p.Nk, p.Hkv, p.d}, p.k);
  npy::write(dir / "v.npy", std::vector<int64_t>{p.B, p.Nk, p.Hkv, p.dv}, p.v);
  npy::write(dir / "dout.npy", std::vector<int64_t>{p.B, p.Nq, p.Hq, p.dv}, p.dout);
  // A boolean mask [B, 1, 1, Nk] (key padding: batch 1 drops its last two keys).
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(p.B * p.Nk), 1);
  keep[static_cast<std::size_t>(p.Nk + 5)] = keep[static_cast<std::size_t>(p.Nk + 6)] = 0;
  npy::write(dir / "mask.npy", std::vector<int64_t>{p.B, 1, 1, p.Nk}, keep, npy::DType::bool8);

  const auto result = run_cli({"run", "--q", dir / "q.npy", "--k", dir / "k.npy", "--v", dir / "v.npy",
                               "--mask", dir / "mask.npy", "--causal", "bottom_right", "--scale", "0.3",
                               "-o", dir / "out.npy", "--lse", dir / "lse.npy", "--weights", dir / "w.npy",
                               "--grad", dir / "dout.npy", "--dq", dir / "dq.npy", "--dk", dir / "dk.npy",
                               "--dv", dir / "dv.npy"});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_NE(result.out.find("wrote " + dir / "out.npy" + "  float32 (2, 5, 4, 6)"), std::string::npos) << result.out;

  AttentionOptions options;
  options.scale = 0.3;
  options.causal = Causal::bottom_right;
  options.mask.keep = TensorView<const std::uint8_t, 4>::contiguous(keep.data(), {p.B, 1, 1, p.Nk});
  const auto want = p.reference(options);
  const auto read = [&](const std::string& name, const std::vector<int64_t>& shape) {
    auto array = npy::read_float32(dir / name);
    EXPECT_EQ(array.shape, shape) << name;
    return array.data;
  };
  expect_close(read("out.npy", {p.B, p.Nq, p.Hq, p.dv}), want.out, "out");
  expect_close(read("lse.npy", {p.B, p.Hq, p.Nq}), want.lse, "lse");
  expect_close(read("w.npy", {p.B, p.Hq, p.Nq, p.Nk}), want.weights, "weights");
  expect_close(read("dq.npy", {p.B, p.Nq, p.Hq, p.d}), want.dq, "dq");
  expect_close(read("dk.npy", {p.B, p.Nk, p.Hkv, p.d}), want.dk, "dk");
  expect_close(read("dv.npy", {p.B, p.Nk, p.Hkv, p.dv}), want.dv, "dv");
}

TEST(Run, PyTorchLayoutGivesTheSameNumbersTransposed) {
  ScratchDir dir;
  Problem p;
  npy::write(dir / "q.npy", std::vector<int64_t>{p.B, p.Hq, p.Nq, p.d}, swap_seq_heads(p.q, p.B, p.Nq, p.Hq, p.d));
  npy::write(dir / "k.npy", std::vector<int64_t>{p.B, p.Hkv, p.Nk, p.d}, swap_seq_heads(p.k, p.B, p.Nk, p.Hkv, p.d));
  npy::write(dir / "v.npy", std::vector<int64_t>{p.B, p.Hkv, p.Nk, p.dv}, swap_seq_heads(p.v, p.B, p.Nk, p.Hkv, p.dv));
  npy::write(dir / "dout.npy", std::vector<int64_t>{p.B, p.Hq, p.Nq, p.dv},
             swap_seq_heads(p.dout, p.B, p.Nq, p.Hq, p.dv));
  // A float bias [Hq, Nq, Nk] with some -inf entries, broadcast over batch.
  std::vector<float> bias = random_values(p.Hq * p.Nq * p.Nk, 9);
  for (std::size_t i = 0; i < bias.size(); i += 5) bias[i] = -INFINITY;
  npy::write(dir / "bias.npy", std::vector<int64_t>{p.Hq, p.Nq, p.Nk}, bias);

  const auto result = run_cli({"run", "--layout", "bhsd", "--q", dir / "q.npy", "--k", dir / "k.npy", "--v",
                               dir / "v.npy", "--mask", dir / "bias.npy", "--causal", "top_left", "-o",
                               dir / "out.npy", "--grad", dir / "dout.npy", "--dk", dir / "dk.npy", "--quiet"});
  ASSERT_EQ(result.code, 0) << result.err;
  EXPECT_TRUE(result.out.empty());

  AttentionOptions options;
  options.causal = Causal::top_left;
  options.mask.bias = TensorView<const float, 4>::contiguous(bias.data(), {1, p.Hq, p.Nq, p.Nk});
  const auto want = p.reference(options);
  const auto out = npy::read_float32(dir / "out.npy");
  EXPECT_EQ(out.shape, (std::vector<int64_t>{p.B, p.Hq, p.Nq, p.dv}));
  expect_close(swap_seq_heads(out.data, p.B, p.Hq, p.Nq, p.dv), want.out, "out (bhsd)");
  const auto dk = npy::read_float32(dir / "dk.npy");
  EXPECT_EQ(dk.shape, (std::vector<int64_t>{p.B, p.Hkv, p.Nk, p.d}));
  expect_close(swap_seq_heads(dk.data, p.B, p.Hkv, p.Nk, p.d), want.dk, "dk (bhsd)");
  EXPECT_EQ(dir.listing(), (std::vector<std::string>{"bias.npy", "dk.npy", "dout.npy", "k.npy", "out.npy", "q.npy", "v.npy"}));
}

// Exact answers: with q = k = 0 every logit is 0, so each row averages the values it
// sees and its log-sum-exp is ln(number of keys). 3-D inputs [seq, heads, dim].
TEST(Run, GoldenUniformAttention) {
  ScratchDir dir;
  const int64_t N = 4, H = 2, d = 3;
  npy::write(dir / "q.npy", std::vector<int64_t>{N, H, d}, std::vector<float>(N * H * d, 0.0f));
  npy::write(dir / "k.npy", std::vector<int64_t>{N, H, d}, std::vector<float>(N * H * d, 0.0f));
  std::vector<float> v(N * H * 1);
  for (int64_t j = 0; j < N; ++j)
    for (int64_t h = 0; h < H; ++h) v[j * H + h] = static_cast<float>((j + 1) * (h == 0 ? 1 : 10));  // 1,2,3,4 / 10..40
  npy::write(dir / "v.npy", std::vector<int64_t>{N, H, 1}, v);
  ASSERT_EQ(run_cli({"run", "--q", dir / "q.npy", "--k", dir / "k.npy", "--v", dir / "v.npy", "--causal",
                     "top_left", "-o", dir / "out.npy", "--lse", dir / "lse.npy"})
                .code,
            0);
  const auto out = npy::read_float32(dir / "out.npy");
  EXPECT_EQ(out.shape, (std::vector<int64_t>{N, H, 1}));
  // Row i sees keys 0..i: mean of 1..i+1 = (i + 2)/2.
  EXPECT_EQ(out.data, (std::vector<float>{1, 10, 1.5f, 15, 2, 20, 2.5f, 25}));
  const auto lse = npy::read_float32(dir / "lse.npy");
  EXPECT_EQ(lse.shape, (std::vector<int64_t>{H, N}));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < N; ++i)
      EXPECT_NEAR(lse.data[static_cast<std::size_t>(h * N + i)], std::log(static_cast<float>(i + 1)), 1e-6);
}

// ---- errors ---------------------------------------------------------------------------

class RunErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    write_random(dir / "q.npy", {2, 5, 4, 8}, 1);
    write_random(dir / "k.npy", {2, 7, 2, 8}, 2);
    write_random(dir / "v.npy", {2, 7, 2, 6}, 3);
    write_random(dir / "dout.npy", {2, 5, 4, 6}, 4);
    // An existing output that a failed run must leave alone.
    npy::write(dir / "out.npy", std::vector<int64_t>{1}, std::vector<float>{42.0f});
    before = dir.listing();
    before_out = test::read_text(dir / "out.npy");
  }

  std::vector<std::string> base() const {
    return {"run", "--q", dir / "q.npy", "--k", dir / "k.npy", "--v", dir / "v.npy", "-o", dir / "out.npy"};
  }

  // Runs, expects failure with `fragment` (and `name`) on stderr, and an untouched directory.
  void expect_failure(std::vector<std::string> extra, const std::string& fragment, const std::string& name = "",
                      int code = kExitFailure, std::vector<std::string> replace_base = {}) {
    auto args = replace_base.empty() ? base() : replace_base;
    args.insert(args.end(), extra.begin(), extra.end());
    const auto result = run_cli(args);
    EXPECT_EQ(result.code, code) << fragment << "\n" << result.err;
    EXPECT_NE(result.err.find(fragment), std::string::npos) << result.err;
    if (!name.empty()) {
      EXPECT_NE(result.err.find(name), std::string::npos) << result.err;
    }
    EXPECT_TRUE(result.out.empty()) << result.out;
    EXPECT_EQ(dir.listing(), before) << fragment;
    EXPECT_EQ(test::read_text(dir / "out.npy"), before_out) << fragment;
  }

  ScratchDir dir;
  std::vector<std::string> before;
  std::string before_out;
};

TEST_F(RunErrors, UnreadableInputs) {
  auto args = base();
  args[2] = dir / "missing.npy";
  expect_failure({}, "no such file", "missing.npy", kExitFailure, args);

  test::write_text(dir / "junk.npy", "this is not numpy");
  before = dir.listing();
  args[2] = dir / "junk.npy";
  expect_failure({}, "not a .npy file", "junk.npy", kExitFailure, args);

  const std::string full = test::read_text(dir / "k.npy");
  test::write_text(dir / "short.npy", full.substr(0, full.size() - 3));
  before = dir.listing();
  args = base();
  args[4] = dir / "short.npy";
  expect_failure({}, "truncated", "short.npy", kExitFailure, args);

  args = base();
  args[6] = std::string(QKV_CLI_TEST_DATA) + "/f8_2.npy";
  expect_failure({}, "'<f8' is not supported", "f8_2.npy", kExitFailure, args);
  args[6] = std::string(QKV_CLI_TEST_DATA) + "/f4_fortran_2x3.npy";
  expect_failure({}, "Fortran order", "f4_fortran_2x3.npy", kExitFailure, args);

  // A header promising 2⁴⁰ elements: refused from the header, before any allocation.
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1024, 1024, 1024, 1024), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string absurd = "\x93NUMPY\x01";
  absurd += '\0';
  absurd += static_cast<char>(header.size());
  absurd += '\0';
  test::write_text(dir / "absurd.npy", absurd + header + full.substr(128));
  before = dir.listing();
  args = base();
  args[4] = dir / "absurd.npy";
  expect_failure({}, "truncated: float32 (1024, 1024, 1024, 1024) needs", "absurd.npy", kExitFailure, args);
}

TEST_F(RunErrors, ShapesThatDoNotFitTogether) {
  write_random(dir / "q2d.npy", {5, 8}, 5);
  write_random(dir / "k3d.npy", {7, 2, 8}, 6);
  write_random(dir / "k_batch3.npy", {3, 7, 2, 8}, 7);
  write_random(dir / "v_seq6.npy", {2, 6, 2, 6}, 8);
  write_random(dir / "v_heads1.npy", {2, 7, 1, 6}, 9);
  write_random(dir / "k_dim4.npy", {2, 7, 2, 4}, 10);
  write_random(dir / "q_heads3.npy", {2, 5, 3, 8}, 11);
  write_random(dir / "q_heads0.npy", {2, 5, 0, 8}, 12);
  write_random(dir / "dout_bad.npy", {2, 5, 4, 7}, 13);
  before = dir.listing();
  const auto with = [&](int index, const std::string& file) {
    auto args = base();
    args[static_cast<std::size_t>(index)] = dir / file;
    return args;
  };
  expect_failure({}, "expected 3-D", "q2d.npy", kExitFailure, with(2, "q2d.npy"));
  expect_failure({}, "has 3 axes but", "k3d.npy", kExitFailure, with(4, "k3d.npy"));
  expect_failure({}, "the batch size is 3", "k_batch3.npy", kExitFailure, with(4, "k_batch3.npy"));
  expect_failure({}, "the number of keys (seq) is 6", "v_seq6.npy", kExitFailure, with(6, "v_seq6.npy"));
  expect_failure({}, "the number of heads is 1", "v_heads1.npy", kExitFailure, with(6, "v_heads1.npy"));
  expect_failure({}, "the head dim is 4", "k_dim4.npy", kExitFailure, with(4, "k_dim4.npy"));
  expect_failure({}, "3 query heads is not a multiple", "q_heads3.npy", kExitFailure, with(2, "q_heads3.npy"));
  expect_failure({}, "has 0 heads", "q_heads0.npy", kExitFailure, with(2, "q_heads0.npy"));
  expect_failure({"--grad", dir / "dout_bad.npy", "--dq", dir / "dq.npy"}, "expected the output's shape (2, 5, 4, 6)",
                 "dout_bad.npy");
}

TEST_F(RunErrors, BadMasks) {
  npy::write(dir / "m_keys.npy", std::vector<int64_t>{5, 6}, std::vector<std::uint8_t>(30, 1), npy::DType::bool8);
  npy::write(dir / "m_heads.npy", std::vector<int64_t>{3, 5, 7}, std::vector<float>(105, 0.0f));
  npy::write(dir / "m_rank5.npy", std::vector<int64_t>{1, 1, 1, 5, 7}, std::vector<std::uint8_t>(35, 1));
  npy::write(dir / "m_scalar.npy", std::vector<int64_t>{}, std::vector<float>{0.0f});
  std::string bool_two = test::read_text(dir / "m_keys.npy");
  bool_two.back() = '\x02';
  test::write_text(dir / "m_two.npy", bool_two);
  before = dir.listing();
  expect_failure({"--mask", dir / "m_keys.npy"}, "keys axis is 6", "m_keys.npy");
  expect_failure({"--mask", dir / "m_heads.npy"}, "heads axis is 3", "m_heads.npy");
  expect_failure({"--mask", dir / "m_rank5.npy"}, "expected 1 to 4 axes", "m_rank5.npy");
  expect_failure({"--mask", dir / "m_scalar.npy"}, "expected 1 to 4 axes", "m_scalar.npy");
  expect_failure({"--mask", dir / "m_two.npy"}, "is the byte 2", "m_two.npy");
  expect_failure({"--mask", std::string(QKV_CLI_TEST_DATA) + "/f8_2.npy"}, "is not supported", "f8_2.npy");
}

TEST_F(RunErrors, InconsistentFlags) {
  expect_failure({"--grad", dir / "dout.npy"}, "--grad needs at least one of --dq, --dk, --dv");
  expect_failure({"--dq", dir / "dq.npy"}, "need --grad");
  expect_failure({"--lse", dir / "out.npy"}, "--lse and -o both name");
  expect_failure({"--grad", dir / "dout.npy", "--dq", dir / "x.npy", "--dk", dir / "./x.npy"}, "--dk and --dq both name");
  expect_failure({"--scale", "-1"}, "scale");
  expect_failure({"--scale", "nan"}, "scale");
  expect_failure({"--scale", "1e39"}, "options.scale: expected a finite value > 0, got 1e+39");  // inf as a float
  expect_failure({"--weights", dir / "w.npy", "--backend", "cpu"}, "weights");
  expect_failure({"--threads", "-2"}, "--threads", "", kExitUsage);
  expect_failure({"--causal", "diagonal"}, "--causal", "", kExitUsage);
}

TEST_F(RunErrors, CheckFiniteNamesTheElement) {
  auto v = npy::read_float32(dir / "v.npy");
  v.data[5] = NAN;
  npy::write(dir / "v_nan.npy", v.shape, v.data);
  before = dir.listing();
  auto args = base();
  args[6] = dir / "v_nan.npy";
  expect_failure({"--check-finite"}, "check_finite", "", kExitFailure, args);
}

// A failure while writing (here: the directory of the second output does not exist)
// leaves no output at all, not even the ones whose write had succeeded.
TEST_F(RunErrors, NothingIsWrittenWhenOneOutputCannotBe) {
  auto args = base();
  args[8] = dir / "fresh_out.npy";
  expect_failure({"--lse", dir / "no_such_dir/lse.npy"}, "no_such_dir/lse.npy", "cannot create", kExitFailure, args);
}

TEST_F(RunErrors, OversizedOutputsAreRefusedNotAllocated) {
  // 3 × 30000 queries and keys: the weights would be 3·30000² = 2.7e9 floats.
  write_random(dir / "q_long.npy", {30000, 3, 1}, 20);
  before = dir.listing();
  auto args = base();
  args[2] = args[4] = args[6] = dir / "q_long.npy";
  expect_failure({"--weights", dir / "w.npy"}, "more than 2147483648 elements", "w.npy", kExitFailure, args);
}

}  // namespace
}  // namespace qkv::cli
