// The same bad value gives the same error from every entry point: attention_forward
// (dense), varlen_attention_forward, decode and KVCache::attend all check a window, a
// scale, a thread count and the grouped-query head rule through one function each
// (core/attention_rules.hpp, core/validate_variants.cpp), so the messages agree but for the
// function's name and, where the option lives elsewhere, the option's path.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "qkv/qkv.hpp"

namespace qkv {
namespace {

// One bad setting; everything else about the call is valid.
struct Setting {
  Window window;
  std::optional<double> scale;
  int threads = 1;
  int64_t q_heads = 4;  // with 2 key/value heads
  Precision precision = Precision::fast;
};

constexpr int64_t kKvHeads = 2, kDim = 8, kKeys = 4;
constexpr float kSentinel = 7.0f;

// Runs `call`; returns the message of the qkv::Error it threw, or "" when none.
std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

template <class T, int R>
Tensor<T, R> filled(const std::array<int64_t, R>& shape, T value) {
  Tensor<T, R> t(shape);
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = value;
  return t;
}

template <class T, int R>
bool untouched(const Tensor<T, R>& t) {
  for (std::size_t i = 0; i < t.size(); ++i)
    if (t[i] != kSentinel) return false;
  return true;
}

AttentionOptions attention_options(const Setting& s) {
  AttentionOptions options;
  options.window = s.window;
  options.scale = s.scale;
  options.execution.threads = s.threads;
  options.precision = s.precision;
  return options;
}

AttentionOptions decode_options(const Setting& s) {
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  options.window = s.window;
  options.scale = s.scale;
  options.execution.threads = s.threads;
  options.precision = s.precision;
  return options;
}

std::string dense(const Setting& s) {
  const auto q = filled<float, 4>({1, kKeys, s.q_heads, kDim}, 0.5f);
  const auto k = filled<float, 4>({1, kKeys, kKvHeads, kDim}, 0.25f);
  auto out = filled<float, 4>({1, kKeys, s.q_heads, kDim}, kSentinel);
  const std::string error = error_of([&] {
    attention_forward({.q = q.cview(), .k = k.cview(), .v = k.cview(), .out = out.view()},
                      attention_options(s));
  });
  EXPECT_TRUE(error.empty() || untouched(out)) << "dense wrote out on an error";
  return error;
}

std::string varlen(const Setting& s) {
  const auto q = filled<float, 3>({kKeys, s.q_heads, kDim}, 0.5f);
  const auto k = filled<float, 3>({kKeys, kKvHeads, kDim}, 0.25f);
  auto out = filled<float, 3>({kKeys, s.q_heads, kDim}, kSentinel);
  const std::vector<int32_t> cu{0, 1, kKeys};
  const std::string error = error_of([&] {
    varlen_attention_forward({.q = q.cview(), .k = k.cview(), .v = k.cview(), .out = out.view(),
                              .cu_seqlens_q = std::span<const int32_t>(cu),
                              .cu_seqlens_k = std::span<const int32_t>(cu)},
                             attention_options(s));
  });
  EXPECT_TRUE(error.empty() || untouched(out)) << "varlen wrote out on an error";
  return error;
}

std::string decode_call(const Setting& s) {
  const auto q = filled<float, 4>({1, 1, s.q_heads, kDim}, 0.5f);
  const auto cache = filled<float, 4>({1, 2 * kKeys, kKvHeads, kDim}, 0.25f);
  auto out = filled<float, 4>({1, 1, s.q_heads, kDim}, kSentinel);
  const std::vector<int64_t> lengths{kKeys};
  DecodeArgs<float> args;
  args.q = q.cview();
  args.k_cache = cache.cview();
  args.v_cache = cache.cview();
  args.cache_lengths = lengths;
  args.out = out.view();
  const std::string error = error_of([&] { decode(args, decode_options(s)); });
  EXPECT_TRUE(error.empty() || untouched(out)) << "decode wrote out on an error";
  return error;
}

std::string cache_attend(const Setting& s) {
  KVCache cache({.batch = 1, .capacity = 2 * kKeys, .kv_heads = kKvHeads, .head_dim = kDim});
  const auto kv = filled<float, 4>({1, kKeys, kKvHeads, kDim}, 0.25f);
  cache.append(kv.cview(), kv.cview());
  const auto q = filled<float, 4>({1, 1, s.q_heads, kDim}, 0.5f);
  auto out = filled<float, 4>({1, 1, s.q_heads, kDim}, kSentinel);
  const std::string error =
      error_of([&] { cache.attend(q.cview(), out.view(), {}, decode_options(s)); });
  EXPECT_TRUE(error.empty() || untouched(out)) << "KVCache::attend wrote out on an error";
  return error;
}

struct EntryPoint {
  const char* function;  // the name each message starts with
  std::function<std::string(const Setting&)> call;
};

const std::vector<EntryPoint>& entry_points() {
  static const std::vector<EntryPoint> all{
      {"qkv::attention_forward", dense},
      {"qkv::varlen_attention_forward", varlen},
      {"qkv::decode", decode_call},
      {"qkv::decode", cache_attend},  // KVCache::attend checks through qkv::decode
  };
  return all;
}

// The message of every entry point without its "function: " prefix, checking the prefix.
std::vector<std::string> bodies(const Setting& s) {
  std::vector<std::string> out;
  for (const EntryPoint& entry : entry_points()) {
    const std::string error = entry.call(s);
    const std::string prefix = std::string(entry.function) + ": ";
    EXPECT_EQ(error.rfind(prefix, 0), 0u) << "expected an error from " << entry.function
                                          << ", got \"" << error << "\"";
    out.push_back(error.size() >= prefix.size() ? error.substr(prefix.size()) : error);
  }
  return out;
}

void expect_all_equal(const std::vector<std::string>& messages, const std::string& needle) {
  for (const std::string& message : messages) {
    EXPECT_EQ(message, messages[0]);
    EXPECT_NE(message.find(needle), std::string::npos) << message;
  }
}

TEST(SameErrors, Window) {
  expect_all_equal(bodies({.window = {-2, 0}}),
                   "options.window: expected left and right >= 0, or -1 for unbounded, got (-2, 0)");
  expect_all_equal(bodies({.window = {3, -5}}), "got (3, -5)");
}

TEST(SameErrors, Scale) {
  expect_all_equal(bodies({.scale = 0.0}), "options.scale: expected a finite value > 0, got 0");
  expect_all_equal(bodies({.scale = -1.5}), "options.scale: expected a finite value > 0, got -1.5");
  expect_all_equal(bodies({.scale = std::nan("")}), "options.scale: expected a finite value > 0, got nan");
  expect_all_equal(bodies({.scale = INFINITY}), "options.scale: expected a finite value > 0, got inf");
}

// Issue 22, item 5: a scale finite in double but not in float (the kernels multiply in
// float) used to pass and give all-NaN outputs (1e39 → inf) or all-uniform ones (1e-46 → 0).
TEST(SameErrors, ScaleIsCheckedAsAFloat) {
  expect_all_equal(bodies({.scale = 1e39}),
                   "options.scale: expected a finite value > 0, got 1e+39 (inf as a float");
  expect_all_equal(bodies({.scale = 1e-46}),
                   "options.scale: expected a finite value > 0, got 1e-46 (0 as a float");
  expect_all_equal(bodies({.scale = -std::numeric_limits<double>::max()}), "got -1.79769e+308");
  // The largest and smallest scales float holds are accepted by every entry point.
  for (const double fine : {static_cast<double>(std::numeric_limits<float>::max()),
                            static_cast<double>(std::numeric_limits<float>::denorm_min()), 0.125}) {
    for (const EntryPoint& entry : entry_points())
      EXPECT_EQ(entry.call({.scale = fine}), "") << entry.function << " scale " << fine;
  }
}

// The backward entry points resolve the scale through the same function.
TEST(SameErrors, ScaleIsCheckedAsAFloatInTheBackward) {
  const auto q = filled<float, 4>({1, kKeys, 2, kDim}, 0.5f);
  const auto lse = filled<float, 3>({1, 2, kKeys}, 0.0f);
  auto dq = filled<float, 4>({1, kKeys, 2, kDim}, kSentinel);
  auto dk = dq, dv = dq;
  const std::string error = error_of([&] {
    attention_backward({.q = q.cview(), .k = q.cview(), .v = q.cview(), .out = q.cview(),
                        .lse = lse.cview(), .dout = q.cview(), .dq = dq.view(), .dk = dk.view(),
                        .dv = dv.view()},
                       attention_options({.scale = 1e39}));
  });
  EXPECT_EQ(error.rfind("qkv::attention_backward: options.scale: expected a finite value > 0, "
                        "got 1e+39 (inf as a float",
                        0),
            0u)
      << error;
  EXPECT_TRUE(untouched(dq) && untouched(dk) && untouched(dv));
}

TEST(SameErrors, Threads) {
  // The thread count lives in options.execution.threads (AttentionOptions) and
  // options.execution.threads: the same words after the field's name.
  const std::vector<std::string> messages = bodies({.threads = -1});
  std::vector<std::string> after_field;
  for (const std::string& message : messages) {
    const std::size_t at = message.find("threads: ");
    ASSERT_NE(at, std::string::npos) << message;
    EXPECT_EQ(message.rfind("options.", 0), 0u) << message;
    after_field.push_back(message.substr(at));
  }
  expect_all_equal(after_field, "threads: expected >= 0 (0 = all hardware threads), got -1");
}

TEST(SameErrors, Precision) {
  expect_all_equal(bodies({.precision = static_cast<Precision>(7)}),
                   "options.precision: expected fast or exact, got value 7");
  for (const EntryPoint& entry : entry_points())
    EXPECT_EQ(entry.call({.precision = Precision::exact}), "") << entry.function;
}

TEST(SameErrors, HeadCountMismatch) {
  // q's heads axis is 2 in [B, N, H, d] views and 1 in packed ones; the key/value view is
  // k or k_cache: the rule and its numbers read the same.
  for (const std::string& message : bodies({.q_heads = 3})) {
    EXPECT_NE(message.find("(heads): expected a multiple of "), std::string::npos) << message;
    EXPECT_NE(message.find("= 2 for grouped-query attention, got 3"), std::string::npos) << message;
    EXPECT_EQ(message.rfind("q.shape[", 0), 0u) << message;
  }
}

TEST(SameErrors, ValidSettingPassesEverywhere) {
  for (const EntryPoint& entry : entry_points())
    EXPECT_EQ(entry.call({.window = {2, 0}, .scale = 0.3, .threads = 0}), "") << entry.function;
}

}  // namespace
}  // namespace qkv
