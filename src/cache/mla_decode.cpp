// qkv::mla_decode: validate every argument (nothing is written on a bad call), then run the
// call as qkv::decode's problem — one kv head whose keys come in two parts (c_kv and k_pe,
// core/kv_source.hpp's split keys) and whose values are the keys' latent part, the same
// c_kv rows — on the same backends.
#include "qkv/mla.hpp"

#include <algorithm>
#include <cmath>
#include <utility>
#include <string>
#include <vector>

#include "cache/decode_source.hpp"
#include "cache/mla_queries.hpp"
#include "core/dispatch.hpp"
#include "core/validate.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace {

using detail::Checker;
using detail::Described;
using detail::describe;

template <class T>
void run(const MlaDecodeArgs<T>& a, const AttentionOptions& options) {
  const Checker check("qkv::mla_decode");
  if (!a.indices.empty()) detail::refuse_for_key_lists(check, options);
  detail::require_model_scale(check, options);
  const Described q_nope = describe("q_nope", a.q_nope), q_pe = describe("q_pe", a.q_pe),
                  ckv = describe("ckv_cache", a.ckv_cache), kpe = describe("kpe_cache", a.kpe_cache),
                  out = describe("out", a.out);
  detail::check_latent_queries(check, q_nope, q_pe);
  for (const Described* view : {&ckv, &kpe, &out}) check.expect_well_formed(*view);
  const int64_t batch = a.q_nope.shape[0], q_len = a.q_nope.shape[1], heads = a.q_nope.shape[2];
  const int64_t dc = a.q_nope.shape[3], dr = a.q_pe.shape[3];
  const bool paged = !a.block_table.empty();
  check.expect_extent(ckv, 2, "dc", dc, "as q_nope.shape[3]");
  check.expect_extent(kpe, 0, paged ? "blocks" : "batch", a.ckv_cache.shape[0], "as ckv_cache.shape[0]");
  check.expect_extent(kpe, 1, paged ? "block_size" : "capacity", a.ckv_cache.shape[1], "as ckv_cache.shape[1]");
  check.expect_extent(kpe, 2, "dr", dr, "as q_pe.shape[3]");
  std::vector<Described> inputs{q_nope, q_pe, ckv, kpe};
  const int64_t capacity =
      detail::check_cache_layout(check, ckv, a.block_table, a.cache_lengths, batch, "as q_nope.shape[0]", inputs);
  std::vector<Described> outputs;
  detail::check_decode_outputs(check, out, a.lse, batch, q_len, heads, dc, "as ckv_cache.shape[2]", outputs);
  check.expect_outputs_apart(outputs, inputs);

  // Float8 caches: one scale per tensor for each part. c_kv's is the rows' scale (keys and
  // values); k_pe's enters as kpe_scale / ckv_scale on q_pe, so that one row scale serves
  // both parts of every key. Checked here (two numbers), so every entry point words a bad
  // one alike.
  float rope_factor = 1.0f;
  const float* row_scale = nullptr;
  if constexpr (is_float8(storage_type_of<T>)) {
    for (const auto& [name, value] : {std::pair{"ckv_scale", a.ckv_scale}, std::pair{"kpe_scale", a.kpe_scale}}) {
      if (!value)
        check.fail(std::string(name) + ": a float8 cache needs its scale (one per tensor), got none (vLLM's default "
                   "when a checkpoint has no scales is 1.0)");
      if (!(*value > 0.0f) || !std::isfinite(*value))
        check.fail(std::string(name) + ": expected a positive finite scale, got " + std::to_string(*value));
    }
    rope_factor = *a.kpe_scale / *a.ckv_scale;
    if (!std::isfinite(rope_factor) || !std::isnormal(rope_factor))
      check.fail("kpe_scale: kpe_scale / ckv_scale = " + std::to_string(*a.kpe_scale) + " / " +
                 std::to_string(*a.ckv_scale) + " leaves float32's normal range");
    row_scale = &*a.ckv_scale;
  } else {
    for (const auto& [name, value] : {std::pair{"ckv_scale", a.ckv_scale}, std::pair{"kpe_scale", a.kpe_scale}})
      if (value)
        check.fail(std::string(name) + ": only float8 caches take scales (these caches are " +
                   storage_name(storage_type_of<T>) + ")");
  }

  const int64_t d = dc + dr;
  const std::vector<float> q = detail::latent_query_rows(a.q_nope, a.q_pe, rope_factor);
  const auto q_view = View4<const float>::contiguous(q.data(), {batch, q_len, heads, d});
  detail::ForwardProblem<float> p =
      detail::cache_problem(check, options, q_view, a.out, a.lse, /*kv_heads=*/1, capacity, dc, a.cache_lengths);
  detail::KvSource& kv = p.kv;
  kv.type = storage_type_of<T>;
  kv.k = a.ckv_cache.data;
  kv.v = a.ckv_cache.data;  // the value is the key's latent part: the same rows
  kv.k_strides = kv.v_strides = {a.ckv_cache.strides[0], a.ckv_cache.strides[1], 0};
  kv.k_rope = a.kpe_cache.data;
  kv.k_rope_strides = {a.kpe_cache.strides[0], a.kpe_cache.strides[1], 0};
  kv.rope_from = dc;
  if (row_scale != nullptr) {  // the per-tensor scale repeated along the rows (strides 0)
    kv.k_scale = kv.v_scale = row_scale;
    kv.k_scale_strides = kv.v_scale_strides = {0, 0, 0};
  }
  if (paged) {
    kv.block_table = a.block_table.data;
    kv.table_stride = a.block_table.strides[0];
    kv.page_size = a.ckv_cache.shape[1];
  }
  const Backend backend = resolve_backend(options, false, false);
  if (!a.indices.empty()) return detail::decode_key_lists(check, p, a.indices, backend);
  if (batch == 0 || q_len == 0) return;
  detail::run_forward(p, backend);
}

}  // namespace

void mla_decode(const MlaDecodeArgs<float>& args, const AttentionOptions& options) { run(args, options); }
void mla_decode(const MlaDecodeArgs<bfloat16>& args, const AttentionOptions& options) { run(args, options); }
void mla_decode(const MlaDecodeArgs<float16>& args, const AttentionOptions& options) { run(args, options); }
void mla_decode(const MlaDecodeArgs<float8_e4m3fn>& args, const AttentionOptions& options) { run(args, options); }
void mla_decode(const MlaDecodeArgs<float8_e5m2>& args, const AttentionOptions& options) { run(args, options); }

}  // namespace qkv
