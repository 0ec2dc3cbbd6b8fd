// What every qkv::mla_decode entry (latent caches: mla_decode.cpp; FlashMLA's FP8 records:
// mla_records.cpp) checks and builds alike: the model's scale required, the two query
// parts agreeing, and the queries as one float row [q_nope, q_pe] per (sequence, query,
// head) — the kernels scale each row into their own scratch anyway, so this copy (H·Nq·(dc
// + dr) floats a sequence, next to the cache's capacity·(dc + dr)) costs nothing they would not.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "check/checker.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail {

inline void require_model_scale(const Checker& check, const AttentionOptions& options) {
  if (!options.scale) {
    check.fail("options.scale: required (the model's softmax scale, e.g. DeepSeek's 1/sqrt(qk_nope_head_dim + "
               "qk_rope_head_dim) times its YaRN factor; 1/sqrt(dc + dr) would not be it)");
  }
}

// q_nope [B, Nq, H ≥ 1, dc ≥ 1] and q_pe [B, Nq, H, dr ≥ 1], both well formed.
inline void check_latent_queries(const Checker& check, const Described& q_nope, const Described& q_pe) {
  for (const Described* view : {&q_nope, &q_pe}) check.expect_well_formed(*view);
  check.expect_at_least_one(q_nope, 2, "heads");
  check.expect_at_least_one(q_nope, 3, "dc");
  check.expect_extent(q_pe, 0, "batch", q_nope.shape[0], "as q_nope.shape[0]");
  check.expect_extent(q_pe, 1, "seq", q_nope.shape[1], "as q_nope.shape[1]");
  check.expect_extent(q_pe, 2, "heads", q_nope.shape[2], "as q_nope.shape[2]");
  check.expect_at_least_one(q_pe, 3, "dr");
}

// Rows [q_nope, rope_factor · q_pe], contiguous [B, Nq, H, dc + dr].
inline std::vector<float> latent_query_rows(const View4<const float>& q_nope, const View4<const float>& q_pe,
                                            float rope_factor = 1.0f) {
  const int64_t batch = q_nope.shape[0], q_len = q_nope.shape[1], heads = q_nope.shape[2];
  const int64_t dc = q_nope.shape[3], dr = q_pe.shape[3], d = dc + dr;
  std::vector<float> q(static_cast<std::size_t>(batch * q_len * heads * d));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < q_len; ++i)
      for (int64_t h = 0; h < heads; ++h) {
        float* row = q.data() + ((b * q_len + i) * heads + h) * d;
        std::copy_n(&q_nope(b, i, h, 0), dc, row);
        const float* pe = &q_pe(b, i, h, 0);
        if (rope_factor == 1.0f) {
          std::copy_n(pe, dr, row + dc);
        } else {
          std::transform(pe, pe + dr, row + dc, [rope_factor](float x) { return x * rope_factor; });
        }
      }
  return q;
}

}  // namespace qkv::detail
