// qkv::decode and KVCache::attend with key lists (DeepSeek sparse attention's top-k on a
// cache) against an fp64 oracle written here: per row, the set of listed keys (−1 and
// repeats dropped) that the causal rule allows, attended densely over the cache's stored
// values (DecodeCase's rounded values; KVCache::stored for the cache's). Every storage
// (float32, bfloat16, float16, int8 per row and per channel, int4, a float window),
// contiguous and paged, Nq 1 and > 1 (bottom_right), GQA, both list layouts, int32 and
// int64, −1 padding, repeats, keys past the causal limit, empty rows, topk ≥ length,
// sinks and soft-cap, every compiled SIMD target, 1/2/3 threads bitwise equal; a bad
// index is a qkv::Error and leaves the outputs untouched.
//
// Tolerance, as test_decode.cpp's: max |got − ref64| ≤ 2·max |plain32 − ref64| + floor,
// plain32 the same gathered attention as an unfused float32 loop over the same stored
// values, floor = 8·ε₃₂·max(1, max |ref64|).
#include <gtest/gtest.h>

#include <qkv/batch_plan.hpp>
#include <qkv/decode.hpp>
#include <qkv/error.hpp>
#include <qkv/kv_cache.hpp>
#include <qkv/sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "decode_case.hpp"
#include "cache_test_support.hpp"
#include "simd_targets.hpp"
#include "test_support.hpp"

namespace qkv {
namespace {

using Values = std::function<double(int64_t b, int64_t j, int64_t h, int64_t c)>;

// Random lists [B, lists, Nq, topk]: positions anywhere in the sequence (so past the
// causal limit too), −1 padding, repeats; row (b, ·, 0) of sequence 0 all −1 (empty).
std::vector<int64_t> random_lists(int64_t batch, int64_t lists, int64_t q_len, int64_t topk,
                                  const std::vector<int64_t>& lengths, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> idx(static_cast<std::size_t>(batch * lists * q_len * topk));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t l = 0; l < lists; ++l)
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t t = 0; t < topk; ++t) {
          const int64_t len = lengths[static_cast<std::size_t>(b)];
          int64_t j = -1;
          const auto pick = rng() % 8;
          if (len > 0 && pick != 0) j = static_cast<int64_t>(rng() % static_cast<uint64_t>(len));
          if (pick == 1 && t > 0) j = idx[static_cast<std::size_t>(((b * lists + l) * q_len + i) * topk + t - 1)];
          if (b == 0 && i == 0 && l == 0) j = -1;
          idx[static_cast<std::size_t>(((b * lists + l) * q_len + i) * topk + t)] = j;
        }
  return idx;
}

struct Lists {
  std::vector<int64_t> i64;
  std::vector<int32_t> i32;
  int64_t batch, lists, q_len, topk;
  bool shared() const { return lists == 0; }
  KeyIndices view(bool int64) const {
    const int64_t l = std::max<int64_t>(lists, 1);
    if (lists == 0) {  // [B, Nq, topk]
      if (int64) return TensorView<const int64_t, 3>::contiguous(i64.data(), {batch, q_len, topk});
      return TensorView<const int32_t, 3>::contiguous(i32.data(), {batch, q_len, topk});
    }
    if (int64) return TensorView<const int64_t, 4>::contiguous(i64.data(), {batch, l, q_len, topk});
    return TensorView<const int32_t, 4>::contiguous(i32.data(), {batch, l, q_len, topk});
  }
  int64_t at(int64_t b, int64_t l, int64_t i, int64_t t) const {
    return i64[static_cast<std::size_t>(((b * std::max<int64_t>(lists, 1) + l) * q_len + i) * topk + t)];
  }
};

Lists make_lists(int64_t batch, int64_t lists, int64_t q_len, int64_t topk, const std::vector<int64_t>& lengths,
                 std::uint64_t seed) {
  Lists r{random_lists(batch, std::max<int64_t>(lists, 1), q_len, topk, lengths, seed), {}, batch, lists, q_len, topk};
  r.i32.assign(r.i64.begin(), r.i64.end());
  return r;
}

struct Expected {
  std::vector<double> out, lse;  // [B, Nq, Hq, dv], [B, Hq, Nq]
  std::vector<float> plain_out, plain_lse;
};

// The oracle: fp64 and plain float32 attention of each row over its attended set.
Expected oracle(const Tensor<float, 4>& q, const Values& key, const Values& value, const std::vector<int64_t>& lengths,
                const Lists& lists, int64_t kv_heads, int64_t dv, Causal causal, const std::vector<float>& sinks,
                float softcap) {
  const auto [batch, q_len, q_heads, d] = q.shape();
  const int64_t group = q_heads / kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Expected e;
  e.out.assign(static_cast<std::size_t>(batch * q_len * q_heads * dv), 0.0);
  e.plain_out.assign(e.out.size(), 0.0f);
  e.lse.assign(static_cast<std::size_t>(batch * q_heads * q_len), -std::numeric_limits<double>::infinity());
  e.plain_lse.assign(e.lse.size(), -std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lengths[static_cast<std::size_t>(b)];
    for (int64_t i = 0; i < q_len; ++i) {
      int64_t end = len;
      if (causal == Causal::bottom_right) end = std::clamp<int64_t>(i + len - q_len + 1, 0, len);
      if (causal == Causal::top_left) end = std::min<int64_t>(i + 1, len);
      for (int64_t h = 0; h < q_heads; ++h) {
        const int64_t g = h / group, list = lists.shared() ? 0 : g;
        std::set<int64_t> keys;
        for (int64_t t = 0; t < lists.topk; ++t) {
          const int64_t j = lists.at(b, list, i, t);
          if (j >= 0 && j < end) keys.insert(j);
        }
        const double sink = sinks.empty() ? -INFINITY : sinks[static_cast<std::size_t>(h)];
        std::vector<double> s;
        std::vector<float> sf;
        for (int64_t j : keys) {
          double x = 0.0;
          float xf = 0.0f;
          for (int64_t c = 0; c < d; ++c) {
            x += static_cast<double>(q(b, i, h, c)) * key(b, j, g, c);
            xf += q(b, i, h, c) * static_cast<float>(key(b, j, g, c));
          }
          x *= scale;
          xf *= static_cast<float>(scale);
          if (softcap > 0.0f) {
            x = softcap * std::tanh(x / softcap);
            xf = softcap * std::tanh(xf / softcap);
          }
          s.push_back(x);
          sf.push_back(xf);
        }
        if (keys.empty() && sinks.empty()) continue;
        double m = sink;
        float mf = static_cast<float>(sink);
        for (std::size_t n = 0; n < s.size(); ++n) {
          m = std::max(m, s[n]);
          mf = std::max(mf, sf[n]);
        }
        double l = sinks.empty() ? 0.0 : std::exp(sink - m);
        float lf = sinks.empty() ? 0.0f : std::exp(static_cast<float>(sink) - mf);
        std::vector<double> acc(static_cast<std::size_t>(dv), 0.0);
        std::vector<float> accf(static_cast<std::size_t>(dv), 0.0f);
        std::size_t n = 0;
        for (int64_t j : keys) {
          const double p = std::exp(s[n] - m);
          const float pf = std::exp(sf[n] - mf);
          l += p;
          lf += pf;
          for (int64_t c = 0; c < dv; ++c) {
            acc[static_cast<std::size_t>(c)] += p * value(b, j, g, c);
            accf[static_cast<std::size_t>(c)] += pf * static_cast<float>(value(b, j, g, c));
          }
          ++n;
        }
        for (int64_t c = 0; c < dv; ++c) {
          const auto at = static_cast<std::size_t>(((b * q_len + i) * q_heads + h) * dv + c);
          e.out[at] = acc[static_cast<std::size_t>(c)] / l;
          e.plain_out[at] = accf[static_cast<std::size_t>(c)] / lf;
        }
        const auto at = static_cast<std::size_t>((b * q_heads + h) * q_len + i);
        e.lse[at] = m + std::log(l);
        e.plain_lse[at] = mf + std::log(lf);
      }
    }
  }
  return e;
}

double worst(const float* got, const std::vector<double>& ref) {
  double w = 0.0;
  for (std::size_t x = 0; x < ref.size(); ++x) {
    if (std::isinf(ref[x]) && got[x] == ref[x]) continue;
    w = std::max(w, std::abs(static_cast<double>(got[x]) - ref[x]));
    if (std::isnan(got[x])) return INFINITY;
  }
  return w;
}
double worst(const std::vector<float>& got, const std::vector<double>& ref) { return worst(got.data(), ref); }
double largest(const std::vector<double>& ref) {
  double w = 0.0;
  for (double x : ref)
    if (std::isfinite(x)) w = std::max(w, std::abs(x));
  return w;
}

void expect_within(const Tensor<float, 4>& out, const Tensor<float, 3>& lse, const Expected& e) {
  const double eps = std::numeric_limits<float>::epsilon();
  const double floor = 8.0 * eps * std::max(1.0, largest(e.out));
  EXPECT_LE(worst(out.data(), e.out), 2.0 * worst(e.plain_out, e.out) + floor)
      << "plain fp32 error " << worst(e.plain_out, e.out);
  const double lse_floor = 8.0 * eps * std::max(1.0, largest(e.lse));
  EXPECT_LE(worst(lse.data(), e.lse), 2.0 * worst(e.plain_lse, e.lse) + lse_floor)
      << "plain fp32 error " << worst(e.plain_lse, e.lse);
}

bool same_bits(const Tensor<float, 4>& a, const Tensor<float, 4>& b) {
  return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
bool same_bits(const Tensor<float, 3>& a, const Tensor<float, 3>& b) {
  return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- qkv::decode over DecodeArgs (DecodeCase: paged pools shuffled, NaN past lengths)

struct ArgsSpec {
  test::DecodeSpec s;
  int64_t topk = 16;
  int64_t lists = 0;  // 0: shared [B, Nq, topk]; else Hkv lists
  bool sinks = false;
  float softcap = 0.0f;
};

template <class T>
void check_args(const ArgsSpec& a, bool int64, int threads = 2) {
  const test::DecodeSpec& s = a.s;
  SCOPED_TRACE(s.name + " storage=" + storage_name(s.type) + " block=" + std::to_string(s.block_size) +
               (int64 ? " int64" : " int32") + (a.lists ? " per-head" : " shared") + " threads=" +
               std::to_string(threads));
  const test::DecodeCase<T> dc(s);
  const Lists lists = make_lists(s.batch, a.lists ? s.kv_heads : 0, s.q_len, a.topk, dc.lengths, 99);
  std::vector<float> sinks;
  for (int64_t h = 0; h < s.q_heads && a.sinks; ++h) sinks.push_back(0.5f * static_cast<float>(h) - 1.0f);
  Tensor<float, 4> out({s.batch, s.q_len, s.q_heads, s.v_dim});
  Tensor<float, 3> lse({s.batch, s.q_heads, s.q_len});
  DecodeArgs<T> args = dc.args(out, lse);
  args.indices = lists.view(int64);
  AttentionOptions options;
  options.causal = s.causal;
  options.execution.threads = threads;
  options.sinks = sinks;
  options.softcap = a.softcap;
  decode(args, options);
  const Values key = [&](int64_t b, int64_t j, int64_t h, int64_t c) { return double(dc.c.k(b, j, h, c)); };
  const Values value = [&](int64_t b, int64_t j, int64_t h, int64_t c) { return double(dc.c.v(b, j, h, c)); };
  const Expected e = oracle(dc.c.q, key, value, dc.lengths, lists, s.kv_heads, s.v_dim, s.causal, sinks, a.softcap);
  expect_within(out, lse, e);
  // The same bits for 1, 2 and 3 threads.
  for (int t : {1, 3}) {
    Tensor<float, 4> out2({s.batch, s.q_len, s.q_heads, s.v_dim});
    Tensor<float, 3> lse2({s.batch, s.q_heads, s.q_len});
    DecodeArgs<T> again = dc.args(out2, lse2);
    again.indices = args.indices;
    options.execution.threads = t;
    decode(again, options);
    EXPECT_TRUE(same_bits(out, out2) && same_bits(lse, lse2)) << t << " threads";
  }
}

template <class T>
void check_args_all(const ArgsSpec& a) {
  for (bool int64 : {false, true}) check_args<T>(a, int64);
}

void check_args_any(const ArgsSpec& a) {
  switch (a.s.type) {
    case StorageType::float32: return check_args_all<float>(a);
    case StorageType::bfloat16: return check_args_all<bfloat16>(a);
    case StorageType::float16: return check_args_all<float16>(a);
    case StorageType::int8: return check_args_all<std::int8_t>(a);
    case StorageType::float8_e4m3fn: return check_args_all<float8_e4m3fn>(a);
    case StorageType::float8_e5m2: return check_args_all<float8_e5m2>(a);
    case StorageType::int4: return;
  }
}

std::vector<ArgsSpec> args_specs() {
  const std::vector<ArgsSpec> shapes{
      {.s = {.name = "gqa4_q1", .batch = 3, .q_len = 1, .capacity = 300, .q_heads = 8, .kv_heads = 2, .head_dim = 64,
             .v_dim = 64, .lengths = {300, 57, 0}},
       .topk = 48},
      {.s = {.name = "gqa2_q3_perhead", .batch = 2, .q_len = 3, .capacity = 120, .q_heads = 4, .kv_heads = 2,
             .head_dim = 32, .v_dim = 48, .lengths = {120, 9}},
       .topk = 20, .lists = 2, .sinks = true},
      // topk ≥ length: every key listed (some twice).
      {.s = {.name = "topk_past_length", .batch = 2, .q_len = 2, .capacity = 40, .q_heads = 2, .kv_heads = 1,
             .head_dim = 16, .v_dim = 16, .lengths = {11, 40}},
       .topk = 64, .softcap = 5.0f},
      // Long lists split into chunks (≥ 512 keys each).
      {.s = {.name = "long_list", .batch = 1, .q_len = 2, .capacity = 3000, .q_heads = 4, .kv_heads = 1,
             .head_dim = 128, .v_dim = 128, .lengths = {2999}},
       .topk = 1800},
      {.s = {.name = "odd_dims", .batch = 1, .q_len = 4, .capacity = 77, .q_heads = 3, .kv_heads = 1, .head_dim = 37,
             .v_dim = 13, .lengths = {70}, .causal = Causal::top_left},
       .topk = 30},
  };
  std::vector<ArgsSpec> specs;
  for (const ArgsSpec& shape : shapes)
    for (StorageType type : {StorageType::float32, StorageType::bfloat16, StorageType::float16, StorageType::int8})
      for (int64_t block : {0, 16, 7}) {
        ArgsSpec a = shape;
        a.s.type = type;
        a.s.block_size = block;
        specs.push_back(a);
      }
  return specs;
}

TEST(DecodeSparse, DecodeArgsMatchTheOracleOnEveryStorageAndLayout) {
  for (const ArgsSpec& a : args_specs()) check_args_any(a);
}

TEST(DecodeSparse, EveryCompiledSimdTargetMatchesTheOracle) {
  const std::vector<ArgsSpec> specs{
      {.s = {.name = "t_bf16", .batch = 2, .q_len = 2, .capacity = 200, .q_heads = 8, .kv_heads = 2, .head_dim = 64,
             .v_dim = 64, .lengths = {200, 31}, .type = StorageType::bfloat16, .block_size = 16},
       .topk = 40},
      {.s = {.name = "t_int8", .batch = 1, .q_len = 1, .capacity = 150, .q_heads = 4, .kv_heads = 1, .head_dim = 37,
             .v_dim = 19, .type = StorageType::int8},
       .topk = 33, .lists = 1},
  };
  test::for_each_simd_target([&](int64_t) {
    for (const ArgsSpec& a : specs) check_args_any(a);
  });
}

// ---- KVCache::attend (every storage, int4 and channel-scaled keys and a float window)

struct CacheSpec {
  std::string name;
  KVCacheConfig config;
  std::vector<int64_t> lengths;  // appended per sequence
  int64_t q_len = 1, q_heads = 1, topk = 16;
  bool per_head = false, sinks = false;
};

void check_cache(const CacheSpec& cs, int threads) {
  SCOPED_TRACE(cs.name + " storage=" + storage_name(cs.config.dtype) + (cs.config.paged ? " paged" : "") +
               " threads=" + std::to_string(threads));
  KVCache cache(cs.config);
  const KVCacheConfig& c = cache.config();
  const int64_t batch = c.batch, hkv = c.kv_heads, d = c.head_dim, dv = c.v_dim;
  const int64_t longest = *std::max_element(cs.lengths.begin(), cs.lengths.end());
  const auto k = test::random_tensor<float, 4>({batch, longest, hkv, d}, 5);
  const auto v = test::random_tensor<float, 4>({batch, longest, hkv, dv}, 6);
  for (int64_t b = 0; b < batch; ++b)
    if (cs.lengths[static_cast<std::size_t>(b)] > 0)
      test::append_sequence(cache, k, v, b, 0, cs.lengths[static_cast<std::size_t>(b)]);
  std::vector<std::vector<float>> ks, vs;
  for (int64_t b = 0; b < batch; ++b) {
    auto [kb, vb] = cache.stored(b);
    ks.push_back(std::move(kb));
    vs.push_back(std::move(vb));
  }
  const auto q = test::random_tensor<float, 4>({batch, cs.q_len, cs.q_heads, d}, 8);
  const Lists lists = make_lists(batch, cs.per_head ? hkv : 0, cs.q_len, cs.topk, cs.lengths, 17);
  std::vector<float> sinks;
  for (int64_t h = 0; h < cs.q_heads && cs.sinks; ++h) sinks.push_back(1.0f - 0.3f * static_cast<float>(h));
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  options.sinks = sinks;
  const auto run = [&](int t, bool int64) {
    std::pair<Tensor<float, 4>, Tensor<float, 3>> r{Tensor<float, 4>({batch, cs.q_len, cs.q_heads, dv}),
                                                    Tensor<float, 3>({batch, cs.q_heads, cs.q_len})};
    options.execution.threads = t;
    cache.attend(q.cview(), r.first.view(), r.second.view(), options, lists.view(int64));
    return r;
  };
  const auto [out, lse] = run(threads, true);
  const Values key = [&](int64_t b, int64_t j, int64_t h, int64_t x) {
    return double(ks[static_cast<std::size_t>(b)][static_cast<std::size_t>((j * hkv + h) * d + x)]);
  };
  const Values value = [&](int64_t b, int64_t j, int64_t h, int64_t x) {
    return double(vs[static_cast<std::size_t>(b)][static_cast<std::size_t>((j * hkv + h) * dv + x)]);
  };
  const Expected e = oracle(q, key, value, cs.lengths, lists, hkv, dv, Causal::bottom_right, sinks, 0.0f);
  expect_within(out, lse, e);
  for (int t : {1, 2, 3}) {
    const auto [out2, lse2] = run(t, false);
    EXPECT_TRUE(same_bits(out, out2) && same_bits(lse, lse2)) << t << " threads, int32 lists";
  }
}

std::vector<CacheSpec> cache_specs() {
  std::vector<CacheSpec> specs;
  const auto config = [](StorageType type, bool paged, KeyScales scales = KeyScales::row, int64_t window = 0) {
    KVCacheConfig c{.batch = 2, .capacity = 256, .kv_heads = 2, .head_dim = 64, .v_dim = 64, .dtype = type,
                    .paged = paged, .block_size = 32, .key_scales = scales, .group_size = 16,
                    .float_window = window};
    return c;
  };
  for (bool paged : {false, true}) {
    for (StorageType type : {StorageType::float32, StorageType::bfloat16, StorageType::float16, StorageType::int8})
      specs.push_back({.name = "rows", .config = config(type, paged), .lengths = {200, 45}, .q_len = 2, .q_heads = 8,
                       .topk = 64});
    specs.push_back({.name = "int8_channel", .config = config(StorageType::int8, paged, KeyScales::channel),
                     .lengths = {233, 70}, .q_len = 3, .q_heads = 4, .topk = 50, .per_head = true, .sinks = true});
    specs.push_back({.name = "int8_channel_window",
                     .config = config(StorageType::int8, paged, KeyScales::channel, 24), .lengths = {233, 70},
                     .q_len = 2, .q_heads = 4, .topk = 80});
    specs.push_back({.name = "int4", .config = config(StorageType::int4, paged, KeyScales::channel),
                     .lengths = {256, 33}, .q_len = 1, .q_heads = 8, .topk = 100});
    specs.push_back({.name = "int4_window_perhead",
                     .config = config(StorageType::int4, paged, KeyScales::channel, 40), .lengths = {180, 90},
                     .q_len = 4, .q_heads = 4, .topk = 70, .per_head = true});
  }
  return specs;
}

TEST(DecodeSparse, KVCacheAttendMatchesTheOracleOnEveryStorage) {
  for (const CacheSpec& cs : cache_specs()) check_cache(cs, 2);
}

// ---- qkv::BatchPlan::run with packed lists [total_q, topk]

void check_plan(StorageType type, bool paged) {
  SCOPED_TRACE(std::string("plan storage=") + storage_name(type) + (paged ? " paged" : ""));
  KVCacheConfig config{.batch = 3, .capacity = 160, .kv_heads = 2, .head_dim = 32, .v_dim = 32, .dtype = type,
                       .paged = paged, .block_size = 16};
  if (type == StorageType::int4) {
    config.key_scales = KeyScales::channel;
    config.group_size = 8;
  }
  KVCache cache(config);
  const std::vector<int64_t> lengths{150, 7, 60}, counts{1, 3, 20};  // new queries per sequence
  const auto k = test::random_tensor<float, 4>({3, 150, 2, 32}, 21);
  const auto v = test::random_tensor<float, 4>({3, 150, 2, 32}, 22);
  for (int64_t b = 0; b < 3; ++b) test::append_sequence(cache, k, v, b, 0, lengths[static_cast<std::size_t>(b)]);
  std::vector<int64_t> cu{0};
  for (int64_t n : counts) cu.push_back(cu.back() + n);
  const int64_t total = cu.back(), heads = 4, topk = 24;
  BatchLayout layout;
  layout.cu_seqlens_q = std::span<const int64_t>(cu);
  layout.cache_lengths = std::span<const int64_t>(lengths);
  std::vector<int32_t> table;
  if (paged) {
    table.assign(cache.block_table().begin(), cache.block_table().end());
    layout.block_table = TensorView<const int32_t, 2>::contiguous(table.data(), {3, cache.blocks_per_sequence()});
    layout.block_size = 16;
  }
  layout.num_heads = heads;
  layout.num_kv_heads = 2;
  layout.head_dim = 32;
  layout.storage = type;
  AttentionOptions options;
  options.causal = Causal::bottom_right;
  const std::vector<float> sinks{0.5f, -1.0f, 2.0f, 0.0f};
  options.sinks = sinks;
  const auto q = test::random_tensor<float, 3>({total, heads, 32}, 23);
  // Packed lists: each sequence's rows drawn over its own length.
  std::vector<int64_t> packed(static_cast<std::size_t>(total * topk));
  std::vector<Lists> per_sequence;
  for (int64_t b = 0; b < 3; ++b) {
    const std::vector<int64_t> one{lengths[static_cast<std::size_t>(b)]};
    per_sequence.push_back(make_lists(1, 0, counts[static_cast<std::size_t>(b)], topk, one, 31 + b));
    std::copy(per_sequence.back().i64.begin(), per_sequence.back().i64.end(),
              packed.begin() + cu[static_cast<std::size_t>(b)] * topk);
  }
  for (int threads : {1, 2, 3}) {
    options.execution.threads = threads;
    const BatchPlan plan(layout, options);
    Tensor<float, 3> out({total, heads, 32});
    Tensor<float, 2> lse({heads, total});
    plan.run(q.cview(), cache, out.view(), lse.view(),
             TensorView<const int64_t, 2>::contiguous(packed.data(), {total, topk}));
    for (int64_t b = 0; b < 3; ++b) {
      const int64_t n = counts[static_cast<std::size_t>(b)], begin = cu[static_cast<std::size_t>(b)];
      Tensor<float, 4> qb({1, n, heads, 32});
      for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t c = 0; c < 32; ++c) qb(0, i, h, c) = q(begin + i, h, c);
      const auto [kb, vb] = cache.stored(b);
      const Values key = [&](int64_t, int64_t j, int64_t h, int64_t x) {
        return double(kb[static_cast<std::size_t>((j * 2 + h) * 32 + x)]);
      };
      const Values value = [&](int64_t, int64_t j, int64_t h, int64_t x) {
        return double(vb[static_cast<std::size_t>((j * 2 + h) * 32 + x)]);
      };
      const std::vector<int64_t> one{lengths[static_cast<std::size_t>(b)]};
      const Expected e = oracle(qb, key, value, one, per_sequence[static_cast<std::size_t>(b)], 2, 32,
                                Causal::bottom_right, sinks, 0.0f);
      Tensor<float, 4> got({1, n, heads, 32});
      Tensor<float, 3> got_lse({1, heads, n});
      for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t c = 0; c < 32; ++c) got(0, i, h, c) = out(begin + i, h, c);
          got_lse(0, h, i) = lse(h, begin + i);
        }
      SCOPED_TRACE("sequence " + std::to_string(b) + ", threads " + std::to_string(threads));
      expect_within(got, got_lse, e);
    }
  }
}

TEST(DecodeSparse, BatchPlanRunsPackedListsOnEveryStorage) {
  for (StorageType type : {StorageType::float32, StorageType::bfloat16, StorageType::int8, StorageType::int4})
    for (bool paged : {false, true}) check_plan(type, paged);
}

// ---- errors

TEST(DecodeSparse, AnIndexPastTheCacheLengthIsAnErrorAndWritesNothing) {
  test::DecodeSpec s{.name = "err", .batch = 2, .q_len = 2, .capacity = 64, .q_heads = 2, .kv_heads = 1,
                     .head_dim = 16, .v_dim = 16, .lengths = {64, 10}, .block_size = 16};
  const test::DecodeCase<float> dc(s);
  for (int64_t bad : {10, -2}) {
    Lists lists = make_lists(2, 0, 2, 8, dc.lengths, 3);
    lists.i64[static_cast<std::size_t>((1 * 2 + 1) * 8 + 5)] = bad;  // batch 1, row 1
    lists.i32.assign(lists.i64.begin(), lists.i64.end());
    Tensor<float, 4> out({2, 2, 2, 16});
    Tensor<float, 3> lse({2, 2, 2});
    for (std::size_t x = 0; x < out.size(); ++x) out[x] = 7.0f;
    for (std::size_t x = 0; x < lse.size(); ++x) lse[x] = 7.0f;
    DecodeArgs<float> args = dc.args(out, lse);
    args.indices = lists.view(false);
    AttentionOptions options;
    options.causal = Causal::bottom_right;
    try {
      decode(args, options);
      ADD_FAILURE() << "no error for index " << bad;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("qkv::decode"), std::string::npos) << what;
      EXPECT_NE(what.find("indices[1, 1, 5] (batch 1, query row 1)"), std::string::npos) << what;
      EXPECT_NE(what.find("cache_lengths[1] = 10"), std::string::npos) << what;
    }
    for (std::size_t x = 0; x < out.size(); ++x) ASSERT_EQ(out[x], 7.0f);
    for (std::size_t x = 0; x < lse.size(); ++x) ASSERT_EQ(lse[x], 7.0f);
  }
}

TEST(DecodeSparse, WindowAlibiAndBadShapesAreRefusedByName) {
  test::DecodeSpec s{.name = "refuse", .batch = 1, .q_len = 1, .capacity = 32, .q_heads = 2, .kv_heads = 1,
                     .head_dim = 8, .v_dim = 8};
  const test::DecodeCase<float> dc(s);
  Tensor<float, 4> out({1, 1, 2, 8});
  Tensor<float, 3> lse({1, 2, 1});
  const Lists lists = make_lists(1, 0, 1, 4, dc.lengths, 1);
  const auto expect_error = [&](const AttentionOptions& options, const KeyIndices& indices, const char* needle) {
    DecodeArgs<float> args = dc.args(out, lse);
    args.indices = indices;
    try {
      decode(args, options);
      ADD_FAILURE() << "no error: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  AttentionOptions window;
  window.window = Window{4, 0};
  expect_error(window, lists.view(true), "options.window");
  const std::vector<float> slopes{0.5f, 0.25f};
  AttentionOptions alibi;
  alibi.alibi_slopes = slopes;
  expect_error(alibi, lists.view(true), "options.alibi_slopes");
  const std::vector<int64_t> wrong(2 * 4, 0);
  expect_error(AttentionOptions{}, TensorView<const int64_t, 3>::contiguous(wrong.data(), {1, 2, 4}),
               "indices.shape[1]");
  expect_error(AttentionOptions{}, TensorView<const int64_t, 4>::contiguous(wrong.data(), {1, 2, 1, 4}),
               "indices.shape[1]");
}

}  // namespace
}  // namespace qkv
