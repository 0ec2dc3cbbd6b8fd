// qkv::mla_decode — multi-head latent attention (DeepSeek V2/V3/V3.2, Kimi K2, GLM-5) in
// its absorbed form, over latent caches read in place: the step engines run.
//
// The cache keeps one latent row per token, c_kv (dc values, 512 in DeepSeek), and one
// rotary key k_pe (dr values, 64). The key up-projection is folded into the query
// (q_nope = q_nope_head · W_UK, dc wide) and the value up-projection is applied to the
// output by the caller, so every query head attends the one latent head:
//
//   S[h, j] = scale · (q_nope[h] · c_kv[j] + q_pe[h] · k_pe[j])
//   out[h]  = Σ_j softmax_j(S[h, ·]) · c_kv[j]          (dc wide: the value is the key's latent part)
//
//   q_nope [B, Nq, H, dc]    q_pe [B, Nq, H, dr]        float32, any strides (last axis contiguous)
//   ckv_cache  contiguous [B, capacity, dc]  or paged [num_blocks, block_size, dc]
//   kpe_cache  contiguous [B, capacity, dr]  or paged [num_blocks, block_size, dr]
//              (same storage type: float32, bfloat16 or float16, widened exactly; or
//              float8_e4m3fn / float8_e5m2 with a scale per tensor, ckv_scale and kpe_scale)
//   block_table [B, max_blocks] int32 (paged): key j of sequence b is row j % block_size
//              of pool block block_table[b, j / block_size], in both pools
//   cache_lengths [B]   keys held per sequence, the new tokens' own included
//   out [B, Nq, H, dc] float32;  lse [B, H, Nq] optional
//   indices (optional): DeepSeek-V3.2's sparse attention, which runs in this latent mode —
//              [B, Nq, topk] int32 or int64 cache positions (qkv/sparse.hpp's rules: −1 none,
//              repeats once, an index outside [−1, cache_lengths[b]) is a qkv::Error).
//
// Options read: scale (required: the model's own, e.g. DeepSeek's 1/√(qk_nope + qk_rope
// head dims) with its YaRN factor — the default 1/√(dc + dr) would be silently wrong, so
// it is refused), causal (Causal::bottom_right for the usual step: query i of Nq sees
// keys j ≤ i + cache_lengths[b] − Nq — speculative / multi-token-prediction steps),
// softcap, sinks, execution (threads; backend reference: the fp64 oracle over the same
// caches). mask, key_lengths, window, alibi_slopes, dropout and modifiers are refused by
// name. A query that sees no key gets out 0 and lse −inf. Every argument is validated
// before anything is written; results are bitwise identical for every thread count.
//
// Float8 caches (vLLM's and SGLang's FP8 latent caches kept as two arrays): c_kv's values
// are ckv_cache · ckv_scale and k_pe's kpe_cache · kpe_scale, one positive finite float32
// scale per tensor each (required for float8, refused for the other types); the result is
// attention over those stored values. c_kv's scale multiplies each score and each weight
// (as qkv::decode's per-tensor k_scale / v_scale do); k_pe's enters as the factor
// kpe_scale / ckv_scale on q_pe (one float32 rounding), so equal scales give the bits of
// qkv::decode over the combined [c_kv | k_pe] pool with that scale. FlashMLA's FP8 layout
// (a scale per 128 latent values, k_pe in bf16, one record per token) is MlaRecordArgs below.
//
// Arithmetic: float32 (caches widened exactly), except a bfloat16 or float8 cache (every
// float8 value is a bfloat16 value) with options.precision fast, at least 16 heads and no
// softcap, on a CPU with AVX512-BF16 or AMX: the products on vdpbf16ps or the AMX tiles, q
// rounded to bfloat16 once and each weight P once, float32 sums — the bf16 contract (docs/numerics.md); Precision::exact keeps
// float32 bit for bit. (qkv::decode and qkv::BatchPlan do the same for any one-kv-head
// bfloat16 cache: a combined latent pool gives these bits.)
//
// The kernel is qkv::decode's split-K schedule: the H·Nq query rows of a sequence stacked
// into one tile against each block of latent keys (each c_kv row read once, for its
// score and for its value), split over keys across threads with the LSE merge.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "qkv/float8.hpp"
#include "qkv/half.hpp"
#include "qkv/options.hpp"
#include "qkv/sparse.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

template <class T>  // the caches' storage type: float, bfloat16, float16, float8_e4m3fn or float8_e5m2
struct MlaDecodeArgs {
  View4<const float> q_nope, q_pe;
  View3<const T> ckv_cache, kpe_cache;
  std::span<const int64_t> cache_lengths;
  TensorView<const int32_t, 2> block_table;  // empty: contiguous caches
  View4<float> out;
  View3<float> lse;  // optional
  KeyIndices indices;  // optional, [B, Nq, topk]
  // float8 caches only (required for them): the stored values' per-tensor scales.
  std::optional<float> ckv_scale, kpe_scale;
};

// FlashMLA's FP8 latent cache (vLLM's kv_cache_dtype "fp8_ds_mla", DeepSeek-V3.2 and GLM-5
// with DeepSeek sparse attention): one record of dc + 4·dc/128 + 2·dr bytes per token —
//   bytes [0, dc)                  c_kv as float8_e4m3fn
//   bytes [dc, dc + 4·dc/128)      dc/128 float32 scales, one per 128 latent values
//   the last 2·dr bytes            k_pe as bfloat16 (not quantized)
// (656 bytes at DeepSeek's dc 512, dr 64); dc a multiple of 128. Latent value c of token j
// is e4m3(c) · scale[c / 128] rounded to float32 once (exact when the scales are powers of
// two, as DeepSeek's UE8M0 scales are); the result is attention over those stored values.
//   ckv_cache  contiguous [B, capacity, record] or paged [num_blocks, block_size, record]
//             uint8, rows contiguous (strides in bytes)
// The rest as MlaDecodeArgs (no per-tensor scales: the records carry theirs). The same
// options and errors; backend reference computes in double over the stored values.
// Arithmetic: each block of records is widened into float32 rows in L1 (the stored
// values) and the float32 kernels run on them; with options.precision fast, ≥ 16 heads,
// no softcap and a bf16 unit (vdpbf16ps or AMX), a block whose stored values are all
// bfloat16 values (power-of-two scales) takes the bf16 products instead (q rounded once, P once: the bf16 contract).
struct MlaRecordArgs {
  View4<const float> q_nope, q_pe;
  View3<const std::uint8_t> ckv_cache;
  std::span<const int64_t> cache_lengths;
  TensorView<const int32_t, 2> block_table;  // empty: contiguous
  View4<float> out;
  View3<float> lse;    // optional
  KeyIndices indices;  // optional, [B, Nq, topk]
};

// Bytes of one FlashMLA FP8 record for latent width dc and rotary width dr.
constexpr int64_t mla_record_bytes(int64_t dc, int64_t dr) { return dc + 4 * (dc / 128) + 2 * dr; }

// Writes FlashMLA's FP8 records from float rows: records[n] from c_kv[n] (dc values, dc a
// multiple of 128) and k_pe[n] (dr values), n < N — the rows an engine appends to its
// cache each step (any row strides; records [N, mla_record_bytes(dc, dr)], rows
// contiguous). Per 128 latent values the scale max|x| / 448 (≥ 1e-4 / 448), or with
// RecordScales::power_of_two (DeepSeek's UE8M0; every stored value is then a bfloat16
// value, which mla_decode's fast path needs) the power of two at or above it; each value
// x / scale rounded to float8_e4m3fn (nearest even), k_pe to bfloat16 (nearest even): the
// bytes of the same steps in PyTorch. A non-finite c_kv value is a qkv::Error naming its
// row (its group's scale could not hold it); nothing is written on an error.
enum class RecordScales { power_of_two, amax };
void pack_mla_records(TensorView<const float, 2> c_kv, TensorView<const float, 2> k_pe,
                      TensorView<std::uint8_t, 2> records, RecordScales scales = RecordScales::power_of_two);

void mla_decode(const MlaDecodeArgs<float>& args, const AttentionOptions& options);
void mla_decode(const MlaDecodeArgs<bfloat16>& args, const AttentionOptions& options);
void mla_decode(const MlaDecodeArgs<float16>& args, const AttentionOptions& options);
void mla_decode(const MlaDecodeArgs<float8_e4m3fn>& args, const AttentionOptions& options);
void mla_decode(const MlaDecodeArgs<float8_e5m2>& args, const AttentionOptions& options);
void mla_decode(const MlaRecordArgs& args, const AttentionOptions& options);

}  // namespace qkv
