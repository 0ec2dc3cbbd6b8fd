// qkv::decode as one entry point among the others: it takes the same AttentionOptions,
// resolves the backend like attention_forward, and its problem (the cache as the
// problem's key/value source) is read by the reference backend as well as by the cpu
// backend's split-K schedule.
//   - backend = reference over contiguous and shuffled paged caches of every storage type
//     (int8 with row scales included) equals the fp64 attention over the stored values,
//     rounded once to float: |out − ref64| ≤ ε₃₂·max(1, |ref64|) (one rounding of a double).
//   - options that a cache cannot take are refused, naming them, with nothing written.
#include <gtest/gtest.h>

#include <qkv/decode.hpp>
#include <qkv/kv_cache.hpp>

#include <cstring>
#include <limits>
#include <string>

#include "decode_case.hpp"
#include "simd_targets.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

using test::DecodeSpec;
using test::Outputs;

template <class T>
void check_backends(const DecodeSpec& s) {
  SCOPED_TRACE(s.name + " storage=" + storage_name(s.type) + " block=" + std::to_string(s.block_size));
  const test::DecodeCase<T> dc(s);
  AttentionOptions options;
  options.causal = s.causal;
  options.window = s.window;
  options.softcap = s.softcap;
  options.alibi_slopes = dc.alibi_slopes;
  options.sinks = dc.sinks;
  options.execution.threads = s.threads;

  auto run = [&](Backend backend) {
    Outputs r{Tensor<float, 4>({s.batch, s.q_len, s.q_heads, s.v_dim}), Tensor<float, 3>({s.batch, s.q_heads, s.q_len})};
    AttentionOptions o = options;
    o.execution.backend = backend;
    decode(dc.args(r.out, r.lse), o);
    return r;
  };
  const Outputs by_reference = run(Backend::reference);
  const Outputs by_cpu = run(Backend::cpu);
  const Outputs by_default = run(Backend::automatic);
  const Outputs by_helper = test::run_decode(dc, s, s.threads);  // the tests' common path

  const test::Reference64 ref = test::reference_of(dc, s);  // over the stored values
  const Tensor<double, 4>& ref_out = ref.out;
  const Tensor<double, 3>& ref_lse = ref.lse;
  const double eps = std::numeric_limits<float>::epsilon();
  EXPECT_LE(test::error(by_reference.out, ref_out), eps * std::max(1.0, test::max_abs(ref_out)));
  EXPECT_LE(test::error(by_reference.lse, ref_lse), eps * std::max(1.0, test::max_abs(ref_lse)));

  // automatic = cpu = the path the other decode tests take, bit for bit.
  for (const Outputs* other : {&by_default, &by_helper}) {
    EXPECT_EQ(std::memcmp(by_cpu.out.data(), other->out.data(), by_cpu.out.size() * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(by_cpu.lse.data(), other->lse.data(), by_cpu.lse.size() * sizeof(float)), 0);
  }
}

void check_any(const DecodeSpec& s) {
  switch (s.type) {
    case StorageType::float32: return check_backends<float>(s);
    case StorageType::bfloat16: return check_backends<bfloat16>(s);
    case StorageType::float16: return check_backends<float16>(s);
    case StorageType::int8: return check_backends<std::int8_t>(s);
    case StorageType::float8_e4m3fn: return check_backends<float8_e4m3fn>(s);
    case StorageType::float8_e5m2: return check_backends<float8_e5m2>(s);
    case StorageType::int4: ADD_FAILURE() << "int4 has no DecodeArgs (qkv::KVCache only)"; return;
  }
}

TEST(DecodeBackends, ReferenceReadsEveryCacheLayout) {
  test::for_each_simd_target([](int64_t) {
  for (StorageType type : {StorageType::float32, StorageType::bfloat16, StorageType::float16, StorageType::int8,
                              StorageType::float8_e4m3fn, StorageType::float8_e5m2})
    for (int64_t block : {0, 16, 5}) {
      DecodeSpec s{.name = "gqa", .batch = 3, .q_len = 2, .capacity = 70, .q_heads = 8, .kv_heads = 2,
                   .head_dim = 32, .v_dim = 24, .lengths = {70, 1, 33}, .type = type, .block_size = block};
      check_any(s);
    }
  });
}

TEST(DecodeBackends, ReferenceWithVariants) {
  DecodeSpec s{.name = "variants", .batch = 2, .q_len = 3, .capacity = 90, .q_heads = 4, .kv_heads = 2,
               .head_dim = 16, .v_dim = 16, .lengths = {90, 40}, .type = StorageType::int8, .block_size = 16,
               .window = {20, 0}, .softcap = 5.0f, .alibi = true, .sinks = true};
  check_any(s);
  s.type = StorageType::bfloat16;
  s.causal = Causal::top_left;
  check_any(s);
}

TEST(DecodeBackends, RefusesWhatACacheCannotTake) {
  const DecodeSpec s{.name = "refuse", .batch = 1, .q_len = 1, .capacity = 8, .lengths = {8}};
  const test::DecodeCase<float> dc(s);
  Tensor<float, 4> out({1, 1, 1, 64});
  Tensor<float, 3> lse({1, 1, 1});
  test::fill(out, 3.0f);
  const std::vector<int64_t> lengths{8};
  Tensor<float, 4> bias({1, 1, 1, 8});
  const auto expect_refused = [&](const AttentionOptions& options, const std::string& needle) {
    try {
      decode(dc.args(out, lse), options);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], 3.0f) << needle;
  };
  AttentionOptions o;
  o.mask.bias = bias.cview();
  expect_refused(o, "options.mask: not supported for caches");
  o = {};
  o.key_lengths = lengths;
  expect_refused(o, "options.key_lengths: not supported for caches");
  o = {};
  o.dropout.p = 0.1f;
  expect_refused(o, "options.dropout: not supported for caches");
  o = {};
  o.execution.check_finite = true;
  expect_refused(o, "options.execution.check_finite: not supported for caches");
  o = {};
  o.execution.threads = -1;
  expect_refused(o, "threads: expected >= 0");
}

TEST(DecodeBackends, KVCacheAttendTakesAttentionOptions) {
  KVCache cache({.batch = 1, .capacity = 32, .kv_heads = 2, .head_dim = 8});
  const auto k = test::random_tensor<float, 4>({1, 5, 2, 8}, 1), v = test::random_tensor<float, 4>({1, 5, 2, 8}, 2);
  const auto q = test::random_tensor<float, 4>({1, 2, 4, 8}, 3);
  cache.append(k.cview(), v.cview());
  Tensor<float, 4> a({1, 2, 4, 8}), r({1, 2, 4, 8});
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  cache.attend(q.cview(), a.view(), {}, options);
  options.execution.backend = Backend::reference;
  cache.attend(q.cview(), r.view(), {}, options);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], r[i], 1e-5) << i;
}

}  // namespace
}  // namespace qkv
