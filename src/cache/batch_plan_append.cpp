// qkv::BatchPlan::run_appending (qkv/batch_plan.hpp, "Appending"): a serving step's new
// tokens rotated, written into the caller's caches and attended in one call.
//
// Order, so that a bad call writes nothing: every view is checked against the plan first
// (the checks run() makes, then the new tokens', the Rotary's and the writes' own), and
// key lists are checked in full; then q is rotated into scratch (the caller's q is never
// written), the new rows are rotated, quantized and stored (nothing here throws), and the
// step runs over the rotated q exactly as run(BatchArgs) would.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "cache/batch_plan_state.hpp"
#include "cache/decode_source.hpp"
#include "cache/quantize_rows.hpp"
#include "cache/rotary.hpp"
#include "check/checker.hpp"
#include "core/checked_size.hpp"
#include "qkv/batch_plan.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace {

using detail::Checker;
using detail::Described;
using detail::describe;

// The attention half of the call: run()'s arguments over `q` (the rotated queries).
template <class T>
BatchArgs<T> attend_args(const BatchAppendArgs<T>& a, View3<const float> q) {
  BatchArgs<T> b;
  b.q = q;
  b.k_cache = a.k_cache;
  b.v_cache = a.v_cache;
  b.out = a.out;
  b.lse = a.lse;
  b.k_scale = a.k_scale;
  b.v_scale = a.v_scale;
  b.indices = a.indices;
  b.k_rope_cache = a.k_rope_cache;
  return b;
}

// Keys in two parts whose values are the latent rows: v_cache the very view of k_cache's
// rows (same memory and strides), so k_new's write is also the values' and v_new has no
// place of its own.
template <class T>
bool latent_values(const BatchAppendArgs<T>& a) {
  if (a.k_rope_cache.empty() || a.v_cache.data != a.k_cache.data || a.k_cache.empty()) return false;
  for (int axis = 0; axis < 4; ++axis)
    if (a.v_cache.strides[static_cast<std::size_t>(axis)] != a.k_cache.strides[static_cast<std::size_t>(axis)])
      return false;
  return true;
}

// One float row of `count` into the cache's element type: float32 as is, 16-bit types
// rounded to nearest even, int8 per row as KVCache stores it (its scale into
// *written_scale), float8 as x / read_scale (qkv/float8.hpp's rounding and saturation).
template <class T>
void store(const float* src, int64_t count, T* dst, float* written_scale, float read_scale) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + count, dst);
  } else if constexpr (std::is_same_v<T, std::int8_t>) {
    detail::store_row(StorageType::int8, src, count, dst, written_scale, /*half=*/false);
  } else if constexpr (is_float8(storage_type_of<T>)) {
    detail::store_float8_row(storage_type_of<T>, src, count, read_scale, dst);
  } else {
    for (int64_t c = 0; c < count; ++c) dst[c] = T(src[c]);
  }
}

template <class T>
void run_appending(const BatchPlan::State& s, const BatchAppendArgs<T>& a) {
  const Checker check("qkv::BatchPlan::run");  // run()'s errors and these read alike
  const bool two_pools = !a.k_rope_cache.empty(), latent = latent_values(a);
  if (a.k_new.empty() && a.v_new.empty()) {
    if (!a.rotary.empty())
      check.fail("rotary.cos: only with k_new (the new keys are rotated with the queries; the cached keys "
                 "were rotated when written)");
    check.fail("k_new: expected the step's new keys [total_q, Hkv, d] (run() attends without appending)");
  }
  if (!two_pools && !a.k_rope_new.empty())
    check.fail("k_rope_new: only with k_rope_cache (keys in two parts: their last dr channels are written there)");
  if (two_pools && a.k_rope_new.empty())
    check.fail("k_rope_new: expected with k_rope_cache (each new key's last dr channels, written there)");
  if (latent) {
    if (!a.v_new.empty())
      check.fail("v_new: not with v_cache the view of k_cache (the values are the latent rows k_new writes: leave "
                 "v_new empty)");
  } else {
    if (a.k_new.empty()) check.fail("k_new: expected with v_new (the new tokens' keys and values are written together)");
    if (a.v_new.empty()) check.fail("v_new: expected with k_new (the new tokens' keys and values are written together)");
  }
  (void)detail::planned_problem(s, attend_args(a, a.q));  // run()'s checks, on the caller's q
  const detail::Extents& e = s.problem.extents;
  // Keys in two parts: k_new holds the first key_width channels, k_rope_new the last dr.
  const int64_t dr = two_pools ? a.k_rope_cache.shape[3] : 0, key_width = e.head_dim - dr;
  const Described k_new = describe("k_new", a.k_new), v_new = describe("v_new", a.v_new),
                  k_rope_new = describe("k_rope_new", a.k_rope_new);
  check.expect_well_formed(k_new);
  check.expect_extent(k_new, 0, "total_q", s.total_q, "as cu_seqlens_q[-1]");
  check.expect_extent(k_new, 1, "kv heads", e.kv_heads, "as layout.num_kv_heads");
  if (two_pools) {
    check.expect_extent(k_new, 2, "head_dim - dr", key_width, "as layout.head_dim - k_rope_cache.shape[3] (keys in two parts)");
    check.expect_well_formed(k_rope_new);
    check.expect_extent(k_rope_new, 0, "total_q", s.total_q, "as cu_seqlens_q[-1]");
    check.expect_extent(k_rope_new, 1, "kv heads", e.kv_heads, "as layout.num_kv_heads");
    check.expect_extent(k_rope_new, 2, "dr", dr, "as k_rope_cache.shape[3]");
  } else {
    check.expect_extent(k_new, 2, "head_dim", e.head_dim, "as layout.head_dim");
  }
  if (!latent) {
    check.expect_well_formed(v_new);
    check.expect_extent(v_new, 0, "total_q", s.total_q, "as cu_seqlens_q[-1]");
    check.expect_extent(v_new, 1, "kv heads", e.kv_heads, "as layout.num_kv_heads");
    check.expect_extent(v_new, 2, "head_dim", e.v_dim, "as layout.v_dim");
  }
  // Two pools: the Rotary acts on the rotary part alone (k_rope_new, q's last dr channels).
  const detail::CheckedRotary rotary(check, a.rotary, s.total_q, two_pools ? dr : e.head_dim,
                                     two_pools ? "dr, the keys' rotary part" : "head_dim");

  // What is written must not overlap what is read or written elsewhere in the call.
  std::vector<Described> written{describe("k_cache", a.k_cache), describe("out", a.out)};
  if (!latent) written.push_back(describe("v_cache", a.v_cache));
  if (two_pools) written.push_back(describe("k_rope_cache", a.k_rope_cache));
  if (!a.lse.empty()) written.push_back(describe("lse", a.lse));
  if constexpr (std::is_same_v<T, std::int8_t>) {
    written.push_back(describe("k_scale", a.k_scale));
    written.push_back(describe("v_scale", a.v_scale));
  }
  std::vector<Described> read{describe("q", a.q), k_new, v_new, k_rope_new};
  if (rotary.active()) {
    read.push_back(describe("rotary.cos", a.rotary.cos));
    read.push_back(describe("rotary.sin", a.rotary.sin));
  }
  check.expect_outputs_apart(written, read);
  detail::refuse_with_shared_prefixes(check, s.shared, a.indices, detail::KvSource{});  // the pool: no window
  if (!a.indices.empty()) {  // checked now, since the lists are read after the write
    if (!s.trees.offsets.empty())
      check.fail("indices: not with a plan that has a tree_mask (key lists select keys along the sequence, a tree "
                 "among its new tokens)");
    detail::check_key_lists(check, detail::planned_problem(s, attend_args(a, a.q)), a.indices);
  }

  // Checked: from here on only an allocation can throw, and it comes before any write.
  std::vector<float> rotated_q, row;
  View3<const float> q = a.q;
  if (rotary.active()) {
    const auto floats = static_cast<std::size_t>(detail::checked_product(
        "qkv::BatchPlan::run", "the rotated queries", {{"total_q", s.total_q}, {"heads", e.q_heads}, {"head_dim", e.head_dim}}));
    detail::allocate_or_throw("qkv::BatchPlan::run", "the rotated queries", floats * sizeof(float), [&] {
      rotated_q.resize(floats);
      row.resize(static_cast<std::size_t>(e.head_dim));
    });
    const View3<float> to(rotated_q.data(), {s.total_q, e.q_heads, e.head_dim},
                          {e.q_heads * e.head_dim, e.head_dim, 1});
    // One pool: the whole row is the rotary's; two: channels key_width.. (q_pe), the
    // channels before them (q_nope) copied as they are.
    for (int64_t r = 0; r < s.total_q; ++r)
      for (int64_t h = 0; h < e.q_heads; ++h) {
        for (int64_t c = 0; c < key_width && two_pools; ++c) to(r, h, c) = a.q(r, h, c);
        rotary.rotate(r, &a.q(r, h, two_pools ? key_width : 0), &to(r, h, two_pools ? key_width : 0));
      }
    q = to;
  }

  // The step's workspace, before the first write (the caches are written next).
  detail::StepWork work = detail::prepare_step(s, detail::planned_problem(s, attend_args(a, q)), a.indices);

  // Each sequence's new tokens into its last n_b rows: (pool block, row) through the
  // plan's table, or (sequence, key).
  const detail::Sequences& seq = s.problem.mask.sequences;
  for (int64_t b = 0; b < e.batch; ++b) {
    const int64_t first = seq.cu_q[b], count = seq.cu_q[b + 1] - first,
                  length = s.cache_lengths[static_cast<std::size_t>(b)];  // the layout's, not trimmed
    for (int64_t t = 0; t < count; ++t) {
      const int64_t r = first + t, key = length - count + t;
      const int64_t outer = s.paged() ? s.block_table[static_cast<std::size_t>(b * s.max_blocks + key / s.block_size)] : b;
      const int64_t inner = s.paged() ? key % s.block_size : key;
      for (int64_t h = 0; h < e.kv_heads; ++h) {
        // The rotated part: the whole key with one pool, k_rope_new's row with two.
        const float* rotated = two_pools ? &a.k_rope_new(r, h, 0) : &a.k_new(r, h, 0);
        if (rotary.active()) {
          rotary.rotate(r, rotated, row.data());
          rotated = row.data();
        }
        float* k_scale = nullptr;
        float* v_scale = nullptr;
        float k_read = 1.0f, v_read = 1.0f;
        if constexpr (std::is_same_v<T, std::int8_t>) {
          k_scale = &a.k_scale(outer, inner, h);
          v_scale = &a.v_scale(outer, inner, h);
        } else if constexpr (is_float8(storage_type_of<T>)) {
          k_read = a.k_scale(outer, inner, h);
          v_read = a.v_scale(outer, inner, h);
        }
        if (two_pools) {  // float32 and 16-bit storage only (run()'s checks): no scales
          store(&a.k_new(r, h, 0), key_width, &a.k_cache(outer, inner, h, 0), k_scale, k_read);
          store(rotated, dr, &a.k_rope_cache(outer, inner, h, 0), k_scale, k_read);
        } else {
          store(rotated, e.head_dim, &a.k_cache(outer, inner, h, 0), k_scale, k_read);
        }
        if (!latent) store(&a.v_new(r, h, 0), e.v_dim, &a.v_cache(outer, inner, h, 0), v_scale, v_read);
      }
    }
  }
  detail::finish_step(s, work, a.indices);
}

}  // namespace

void BatchPlan::run_appending(const BatchAppendArgs<float>& args) const { qkv::run_appending(*state_, args); }
void BatchPlan::run_appending(const BatchAppendArgs<bfloat16>& args) const { qkv::run_appending(*state_, args); }
void BatchPlan::run_appending(const BatchAppendArgs<float16>& args) const { qkv::run_appending(*state_, args); }
void BatchPlan::run_appending(const BatchAppendArgs<std::int8_t>& args) const { qkv::run_appending(*state_, args); }
void BatchPlan::run_appending(const BatchAppendArgs<float8_e4m3fn>& args) const { qkv::run_appending(*state_, args); }
void BatchPlan::run_appending(const BatchAppendArgs<float8_e5m2>& args) const { qkv::run_appending(*state_, args); }

}  // namespace qkv
