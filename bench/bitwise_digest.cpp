// Bitwise digest of qkv's results on the benchmarks' shapes: one line per case, the case's
// name and a 64-bit FNV-1a hash of each output's bytes (out, lse, gradients, …), so two
// builds can be compared bit for bit (bench/compare_digests.sh). Refactors that promise
// "behaviour unchanged" are checked with it, on every SIMD target:
//
//   QKV_SIMD_TARGET=AVX3 build/release/bench/qkv_bitwise_digest > avx3.txt
//   QKV_SIMD_TARGET=AVX2 build/release/bench/qkv_bitwise_digest > avx2.txt
//   qkv_bitwise_digest [--threads N] [--only SECTION]   (default 1 thread, every section)
//
// The shapes are those of bench/bench_attention.py, bench_masks.py, bench_variants.py,
// bench_decode.py, bench_small_call.py and the C++ probes, scaled down (N ≤ 1024, caches
// ≤ 2048 keys) so a run takes well under a minute on one thread, plus shapes off the
// tile grid (odd lengths, head dims that are not whole vectors, empty sequences). Inputs
// come from fixed seeds (the case name's hash). Only the public API (include/qkv) is
// used, so the same source builds against an older tree to make its baseline. Results
// must not depend on the thread count, so --threads 2 must print the same digest. A
// "(nan:K)" or "(unwritten:K)" after a hash says K elements of that output are NaN or
// still hold the 777 the buffer was filled with; neither appears at 28abe6a.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

#include "digest_support.hpp"

namespace digest {
namespace {

using qkv::Causal;

struct Dims {
  std::int64_t batch, q_heads, kv_heads, nq, nk, d, dv;
};

struct Run {
  bool backward = true;
  bool bhsd = true;  // PyTorch's [B, H, N, d] buffers, as the Python benchmarks pass them
  bool stats = false;
  qkv::Backend backend = qkv::Backend::cpu;  // as the benchmarks ask (small calls: automatic)
};

// The softmax statistics' outputs (qkv/attention_stats.hpp), every view given.
template <class L>
struct StatsBuffers {
  StatsBuffers(std::int64_t batch, std::int64_t heads, std::int64_t rows_per_head)
      : max_weight_mean(output_tensor<L, 2>({batch, heads})),
        max_weight_max(output_tensor<L, 2>({batch, heads})),
        entropy_mean(output_tensor<L, 2>({batch, heads})),
        saturated_share(output_tensor<L, 2>({batch, heads})),
        rows(output_tensor<std::int64_t, 2>({batch, heads})),
        row_max_weight(output_tensor<L, 3>({batch, heads, rows_per_head})),
        row_entropy(output_tensor<L, 3>({batch, heads, rows_per_head})) {}
  qkv::AttentionStats<L> views() {
    return {.max_weight_mean = max_weight_mean.view(), .max_weight_max = max_weight_max.view(),
            .entropy_mean = entropy_mean.view(), .saturated_share = saturated_share.view(),
            .rows = rows.view(), .row_max_weight = row_max_weight.view(),
            .row_entropy = row_entropy.view(), .saturation_threshold = 0.5};
  }
  void hash(Line& line) const {
    line.add("mw_mean", max_weight_mean).add("mw_max", max_weight_max).add("ent_mean", entropy_mean)
        .add("sat", saturated_share).add("rows", rows).add("row_mw", row_max_weight)
        .add("row_ent", row_entropy);
  }
  qkv::Tensor<L, 2> max_weight_mean, max_weight_max, entropy_mean, saturated_share;
  qkv::Tensor<std::int64_t, 2> rows;
  qkv::Tensor<L, 3> row_max_weight, row_entropy;
};

// One dense call (forward, then backward on the forward's out and lse) in storage type T.
template <class T>
void attention_case(const std::string& name, const Dims& s, qkv::AttentionOptions options,
                    const Run& run = {}) {
  options.execution.threads = threads;
  options.execution.backend = run.backend;
  const auto shape = [&](std::int64_t n, std::int64_t h, std::int64_t e) {
    return run.bhsd ? std::array<std::int64_t, 4>{s.batch, h, n, e}
                    : std::array<std::int64_t, 4>{s.batch, n, h, e};
  };
  const auto q_shape = shape(s.nq, s.q_heads, s.d), k_shape = shape(s.nk, s.kv_heads, s.d),
             v_shape = shape(s.nk, s.kv_heads, s.dv), o_shape = shape(s.nq, s.q_heads, s.dv);
  const std::uint64_t seed = seed_of(name);
  const auto q = random_tensor<T, 4>(q_shape, seed), k = random_tensor<T, 4>(k_shape, seed + 1),
             v = random_tensor<T, 4>(v_shape, seed + 2), dout = random_tensor<T, 4>(o_shape, seed + 3);
  auto out = output_tensor<T, 4>(o_shape);
  using L = qkv::LseOf<T>;
  auto lse = output_tensor<L, 3>({s.batch, s.q_heads, s.nq});
  const auto in = [&](const qkv::Tensor<T, 4>& t) { return logical_view<const T>(t.data(), t.shape(), run.bhsd); };
  const auto io = [&](qkv::Tensor<T, 4>& t) { return logical_view<T>(t.data(), t.shape(), run.bhsd); };

  StatsBuffers<L> stats(s.batch, s.q_heads, s.nq);
  const qkv::AttentionStats<L> stats_views = stats.views();
  qkv::attention_forward(qkv::ForwardArgs<T>{.q = in(q), .k = in(k), .v = in(v), .out = io(out),
                                             .lse = lse.view(),
                                             .stats = run.stats ? &stats_views : nullptr},
                         options);
  Line line(name);
  line.add("out", out).add("lse", lse);
  if (run.stats) stats.hash(line);
  if (run.backward) {
    auto dq = output_tensor<T, 4>(q_shape), dk = output_tensor<T, 4>(k_shape), dv = output_tensor<T, 4>(v_shape);
    const auto heads = static_cast<std::size_t>(s.q_heads);
    std::vector<float> dsinks = options.sinks.empty() ? std::vector<float>{} : output_vector(heads);
    std::vector<float> dslopes = options.alibi_slopes.empty() || options.modifiers.score.active()
                                     ? std::vector<float>{}
                                     : output_vector(heads);
    qkv::attention_backward(
        qkv::BackwardArgs<T>{.q = in(q), .k = in(k), .v = in(v), .out = in(out), .lse = lse.cview(),
                             .dout = in(dout), .dq = io(dq), .dk = io(dk), .dv = io(dv),
                             .dsinks = dsinks, .dalibi_slopes = dslopes},
        options);
    line.add("dq", dq).add("dk", dk).add("dv", dv);
    if (!dsinks.empty()) line.add("dsinks", dsinks);
    if (!dslopes.empty()) line.add("dslopes", dslopes);
  }
  line.print();
}

qkv::AttentionOptions causal(Causal mode) {
  qkv::AttentionOptions options;
  options.causal = mode;
  return options;
}

// Off the tile grid: GQA 6/2, Nq ≠ Nk, head dims 40/24 (not whole vectors).
constexpr Dims kRagged{2, 6, 2, 130, 333, 40, 24};

}  // namespace

void dense_cases() {
  // bench_attention.py: [1,8,N,64] N = 512…8192, [1,8,N,128] N = 2048, 4096,
  // [1,32/8,2048,128] and [8,16,512,64], causal and not; scaled down.
  const std::pair<const char*, Dims> rows[] = {
      {"B1_H8_N512_d64", {1, 8, 8, 512, 512, 64, 64}},
      {"B1_H8_N1024_d64", {1, 8, 8, 1024, 1024, 64, 64}},
      {"B1_H8_N512_d128", {1, 8, 8, 512, 512, 128, 128}},
      {"B1_H32/8_N256_d128", {1, 32, 8, 256, 256, 128, 128}},
      {"B4_H4_N256_d64", {4, 4, 4, 256, 256, 64, 64}},
  };
  for (Causal mode : {Causal::none, Causal::top_left})
    for (const auto& [label, dims] : rows)
      attention_case<float>(std::string("dense/") + label + (mode == Causal::none ? "" : "/causal"),
                            dims, causal(mode));
  // qkv_dense_probe's default layout ([B, N, H, d]), explicit scale, and shapes off the
  // tile grid: bottom-right causal, Nq > Nk (its first rows see no key: out 0, lse −inf).
  attention_case<float>("dense/B1_H8_N512_d64/bshd", {1, 8, 8, 512, 512, 64, 64}, {}, {.bhsd = false});
  qkv::AttentionOptions scaled;
  scaled.scale = 0.3;
  attention_case<float>("dense/B1_H8_N256_d64/scale0.3", {1, 8, 8, 256, 256, 64, 64}, scaled);
  attention_case<float>("dense/ragged/bottom_right", kRagged, causal(Causal::bottom_right));
  attention_case<float>("dense/ragged/top_left/bshd", kRagged, causal(Causal::top_left), {.bhsd = false});
  attention_case<float>("dense/B1_H4/2_Nq300_Nk100/bottom_right", {1, 4, 2, 300, 100, 64, 64},
                        causal(Causal::bottom_right));
}

void mask_cases() {
  // bench_masks.py: entry 0 full length, the others half padding, [4,12,512,32] and
  // [8,16,1024,64] (scaled to [4,4,1024,64]); and a ragged shape with an empty entry.
  struct Shape {
    const char* label;
    std::int64_t batch, heads, n, d;
    std::vector<std::int64_t> lengths;
  };
  const Shape shapes[] = {
      {"B4_H12_N512_d32", 4, 12, 512, 32, {512, 256, 256, 256}},
      {"B4_H4_N1024_d64", 4, 4, 1024, 64, {1024, 512, 512, 512}},
      {"B3_H2_N200_d40", 3, 2, 200, 40, {200, 77, 0}},
  };
  for (const Shape& s : shapes) {
    const PaddingMasks masks(s.batch, s.n, s.lengths, seed_of(s.label));
    for (const char* kind : PaddingMasks::kKinds)
      attention_case<float>(std::string("mask/") + s.label + "/" + kind,
                            {s.batch, s.heads, s.heads, s.n, s.n, s.d, s.d}, masks.options(kind));
  }
}

namespace {

// One packed (varlen) call and its backward; Index is the cu_seqlens type.
template <class T, class Index>
void varlen_case(const std::string& name, std::int64_t q_heads, std::int64_t kv_heads, std::int64_t d,
                 const std::vector<std::int64_t>& lengths_q, const std::vector<std::int64_t>& lengths_k,
                 qkv::AttentionOptions options) {
  options.execution.threads = threads;
  options.execution.backend = qkv::Backend::cpu;
  std::vector<Index> cu_q{0}, cu_k{0};
  for (std::size_t s = 0; s < lengths_q.size(); ++s) {
    cu_q.push_back(static_cast<Index>(cu_q.back() + lengths_q[s]));
    cu_k.push_back(static_cast<Index>(cu_k.back() + lengths_k[s]));
  }
  const std::int64_t total_q = cu_q.back(), total_k = cu_k.back();
  const std::uint64_t seed = seed_of(name);
  const auto q = random_tensor<T, 3>({total_q, q_heads, d}, seed), k = random_tensor<T, 3>({total_k, kv_heads, d}, seed + 1),
             v = random_tensor<T, 3>({total_k, kv_heads, d}, seed + 2),
             dout = random_tensor<T, 3>({total_q, q_heads, d}, seed + 3);
  auto out = output_tensor<T, 3>({total_q, q_heads, d});
  auto lse = output_tensor<qkv::LseOf<T>, 2>({q_heads, total_q});
  const std::span<const Index> sq(cu_q), sk(cu_k);
  qkv::varlen_attention_forward(
      qkv::VarlenForwardArgs<T>{.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.view(),
                                .lse = lse.view(), .cu_seqlens_q = sq, .cu_seqlens_k = sk},
      options);
  auto dq = output_tensor<T, 3>(q.shape()), dk = output_tensor<T, 3>(k.shape()), dv = output_tensor<T, 3>(v.shape());
  const auto heads = static_cast<std::size_t>(q_heads);
  std::vector<float> dsinks = options.sinks.empty() ? std::vector<float>{} : output_vector(heads);
  std::vector<float> dslopes = options.alibi_slopes.empty() ? std::vector<float>{} : output_vector(heads);
  qkv::varlen_attention_backward(
      qkv::VarlenBackwardArgs<T>{.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.cview(),
                                 .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(), .dk = dk.view(),
                                 .dv = dv.view(), .dsinks = dsinks, .dalibi_slopes = dslopes,
                                 .cu_seqlens_q = sq, .cu_seqlens_k = sk},
      options);
  Line line(name);
  line.add("out", out).add("lse", lse).add("dq", dq).add("dk", dk).add("dv", dv);
  if (!dsinks.empty()) line.add("dsinks", dsinks);
  if (!dslopes.empty()) line.add("dslopes", dslopes);
  line.print();
}

std::vector<float> slopes_for(std::int64_t heads) {  // ALiBi's 2^-(h+1), as bench_variants.py
  std::vector<float> slopes;
  for (std::int64_t h = 0; h < heads; ++h) slopes.push_back(std::ldexp(1.0f, -static_cast<int>(h + 1)));
  return slopes;
}

}  // namespace

void varlen_cases() {
  // bench_masks.py: 16 sequences of lengths uniform in 16..1024, H=8, d=64; scaled to 8
  // sequences of 16..512. Then causal GQA with more keys than queries and an empty
  // sequence (int64 offsets), with every variant, and bfloat16.
  Rng rng(16);
  std::vector<std::int64_t> lengths;
  for (int s = 0; s < 8; ++s) lengths.push_back(16 + rng.below(497));
  varlen_case<float, std::int32_t>("varlen/8seq_16..512_H8_d64", 8, 8, 64, lengths, lengths, {});
  const std::vector<std::int64_t> lq{70, 0, 129, 1}, lk{100, 5, 129, 300};
  varlen_case<float, std::int64_t>("varlen/H6/2_d40/bottom_right", 6, 2, 40, lq, lk, causal(Causal::bottom_right));
  const std::vector<float> slopes = slopes_for(6), sinks(6, 0.5f);
  qkv::AttentionOptions variants = causal(Causal::bottom_right);
  variants.window = {.left = 50, .right = 0};
  variants.softcap = 20.0f;
  variants.alibi_slopes = slopes;
  variants.sinks = sinks;
  varlen_case<float, std::int64_t>("varlen/H6/2_d40/variants", 6, 2, 40, lq, lk, variants);
  varlen_case<qkv::bfloat16, std::int32_t>("varlen/bf16/8seq_H8_d64/causal", 8, 8, 64, lengths, lengths,
                                           causal(Causal::top_left));
}

void variant_cases() {
  // bench_variants.py: [1,8,2048,64] causal with each variant alone (scaled to N=512),
  // and window 512 at N=16384 (scaled: window 128 at N=1024).
  const Dims dims{1, 8, 8, 512, 512, 64, 64};
  const std::vector<float> slopes = slopes_for(8), sinks(8, 0.5f);
  std::vector<std::pair<std::string, qkv::AttentionOptions>> rows(5, {"", causal(Causal::top_left)});
  rows[0].first = "alibi";
  rows[0].second.alibi_slopes = slopes;
  rows[1].first = "softcap30";
  rows[1].second.softcap = 30.0f;
  rows[2].first = "sinks";
  rows[2].second.sinks = sinks;
  rows[3].first = "dropout0.1";
  rows[3].second.dropout = {.p = 0.1f, .seed = 1, .offset = 0};
  rows[4].first = "window128/N1024";
  rows[4].second.window = {.left = 128, .right = 0};
  for (const auto& [label, options] : rows)
    attention_case<float>("variant/B1_H8_N512_d64/causal/" + label,
                          label.starts_with("window") ? Dims{1, 8, 8, 1024, 1024, 64, 64} : dims, options);
  // A two-sided window without causality; every variant at once off the tile grid.
  qkv::AttentionOptions two_sided;
  two_sided.window = {.left = 64, .right = 64};
  attention_case<float>("variant/B1_H8_N512_d64/window64,64", dims, two_sided);
  const std::vector<float> slopes6 = slopes_for(6), sinks6(6, -0.25f);
  qkv::AttentionOptions all = causal(Causal::bottom_right);
  all.window = {.left = 100, .right = 20};
  all.softcap = 20.0f;
  all.alibi_slopes = slopes6;
  all.sinks = sinks6;
  all.dropout = {.p = 0.2f, .seed = 7, .offset = 3};
  attention_case<float>("variant/ragged/all", kRagged, all);

  // bench_modifiers.cpp: score_mod / mask_mod against the built-ins (N=1024 scaled to 512).
  const auto relative = qkv::score_mod(
      [slopes](auto score, std::int64_t, std::int64_t h, std::int64_t i, std::int64_t j) {
        return score - slopes[static_cast<std::size_t>(h)] * static_cast<float>(i > j ? i - j : j - i);
      },
      [](auto, std::int64_t, std::int64_t, std::int64_t, std::int64_t) { return 1.0f; });
  const auto lower = qkv::mask_mod([](std::int64_t, std::int64_t, std::int64_t i, std::int64_t j) { return j <= i; });
  const auto documents = qkv::mask_mod(
      [](std::int64_t, std::int64_t, std::int64_t i, std::int64_t j) { return i / 128 == j / 128; },
      {.varies_with_head = false});
  qkv::AttentionOptions mods;
  mods.modifiers.score = relative;
  attention_case<float>("modifier/B1_H8_N512_d64/score_mod_alibi", dims, mods);
  mods.modifiers.mask = lower;
  attention_case<float>("modifier/B1_H8_N512_d64/score_mod+mask_mod_causal", dims, mods);
  qkv::AttentionOptions docs;
  docs.modifiers.mask = documents;
  attention_case<float>("modifier/B1_H8_N512_d64/mask_mod_4docs", dims, docs);

  // Softmax statistics (bench_stats.py's shapes, scaled), forward only.
  attention_case<float>("stats/B1_H8_N512_d64", dims, {}, {.backward = false, .stats = true});
  attention_case<float>("stats/B4_H12_N128_d32/causal", {4, 12, 12, 128, 128, 32, 32}, causal(Causal::top_left),
                        {.backward = false, .stats = true});
  attention_case<qkv::bfloat16>("stats/bf16/ragged", kRagged, causal(Causal::bottom_right),
                                {.backward = false, .stats = true});
}

void half_cases() {
  // bench_attention.py --dtype bfloat16|float16: [1,8,4096,d], d 64 and 128, causal and
  // not (scaled to N=512); and every variant at once off the tile grid.
  const std::vector<float> slopes6 = slopes_for(6), sinks6(6, 0.5f);
  qkv::AttentionOptions all = causal(Causal::bottom_right);
  all.window = {.left = 90, .right = -1};
  all.softcap = 15.0f;
  all.alibi_slopes = slopes6;
  all.sinks = sinks6;
  for (const char* type : {"bf16", "fp16"})
    for (Causal mode : {Causal::none, Causal::top_left})
      for (std::int64_t d : {64, 128}) {
        const std::string name = std::string("half/") + type + "/B1_H8_N512_d" + std::to_string(d) +
                                 (mode == Causal::none ? "" : "/causal");
        const Dims dims{1, 8, 8, 512, 512, d, d};
        if (std::string(type) == "bf16") {
          attention_case<qkv::bfloat16>(name, dims, causal(mode));
        } else {
          attention_case<qkv::float16>(name, dims, causal(mode));
        }
      }
  attention_case<qkv::bfloat16>("half/bf16/ragged/variants", kRagged, all, {.bhsd = false});
  attention_case<qkv::float16>("half/fp16/ragged/variants", kRagged, all);
}

void small_call_cases() {
  // bench_small_call.py and small_call.cpp: q [1,12,1,64] against 64 keys through
  // attention_forward with the default backend, as Python calls it (routed to the decode
  // kernel); then Nq 1…16 against a longer GQA cache, the causal modes, variants, padded
  // keys, half storage, and the backward of a small call.
  const Run small{.backward = false, .backend = qkv::Backend::automatic};
  for (std::int64_t nq : {1, 2, 4, 8, 16}) {
    const std::string q = "/Nq" + std::to_string(nq);
    attention_case<float>("small/H12_d64_Nk64" + q, {1, 12, 12, nq, 64, 64, 64}, {}, small);
    attention_case<float>("small/H32/8_d128_Nk1000" + q + "/bottom_right", {1, 32, 8, nq, 1000, 128, 128},
                          causal(Causal::bottom_right), small);
  }
  const Dims gqa{1, 32, 8, 1, 1000, 128, 128};
  attention_case<float>("small/H32/8_d128_Nk1000/Nq4/top_left", {1, 32, 8, 4, 1000, 128, 128},
                        causal(Causal::top_left), small);
  qkv::AttentionOptions window = causal(Causal::bottom_right);
  window.window = {.left = 255, .right = -1};
  attention_case<float>("small/H32/8_d128_Nk1000/Nq1/window255", gqa, window, small);
  const std::vector<float> slopes = slopes_for(32), sinks(32, 0.5f);
  qkv::AttentionOptions variants = causal(Causal::bottom_right);
  variants.softcap = 30.0f;
  variants.alibi_slopes = slopes;
  variants.sinks = sinks;
  attention_case<float>("small/H32/8_d128_Nk1000/Nq1/softcap+alibi+sinks", gqa, variants, small);
  const std::vector<std::int64_t> lengths{64, 30, 0};
  qkv::AttentionOptions padded = causal(Causal::bottom_right);
  padded.key_lengths = lengths;
  attention_case<float>("small/B3_H12_d64_Nk64/Nq1/key_lengths", {3, 12, 12, 1, 64, 64, 64}, padded, small);
  attention_case<qkv::bfloat16>("small/bf16/H12_d64_Nk64/Nq1", {1, 12, 12, 1, 64, 64, 64}, {}, small);
  attention_case<qkv::float16>("small/fp16/H6/2_d40_Nk333/Nq4", {1, 6, 2, 4, 333, 40, 40},
                               causal(Causal::bottom_right), small);
  attention_case<float>("small/H12_d64_Nk64/Nq2/backward", {1, 12, 12, 2, 64, 64, 64}, {},
                        {.backend = qkv::Backend::automatic});
}

}  // namespace digest

namespace {

const std::pair<const char*, void (*)()> kSections[] = {
    {"dense", digest::dense_cases},     {"mask", digest::mask_cases},
    {"varlen", digest::varlen_cases},   {"variant", digest::variant_cases},
    {"half", digest::half_cases},       {"decode", digest::decode_cases},
    {"cache", digest::cache_cases},     {"small", digest::small_call_cases},
};

}  // namespace

int main(int argc, char** argv) try {
  const char* only = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      digest::threads = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: qkv_bitwise_digest [--threads N] [--only dense|mask|varlen|variant|half|decode|cache|small]\n");
      return 2;
    }
  }
  const char* target = std::getenv("QKV_SIMD_TARGET");
  // The header names the target, not the thread count: every thread count must match.
  std::printf("# qkv bitwise digest; QKV_SIMD_TARGET=%s\n", target != nullptr ? target : "(unset: the best)");
  for (const auto& [name, run] : kSections)
    if (only == nullptr || std::strcmp(only, name) == 0) run();
  return 0;
} catch (const std::exception& error) {
  std::fflush(stdout);
  std::fprintf(stderr, "qkv_bitwise_digest: %s\n", error.what());
  return 1;
}
