// The k_scale / v_scale arguments of qkv.decode and qkv.BatchPlan.run (caller-owned
// caches) as the per-row scale views the library reads (cache_scales.cpp).
#pragma once

#include <array>
#include <cstdint>
#include <optional>

#include "arrays.hpp"
#include "qkv/half.hpp"
#include "qkv/tensor.hpp"

namespace qkv::python {

// `name`'s scale view for a cache of storage `storage` whose first three extents are
// `rows` ([B | blocks, capacity | block_size, Hkv]):
//   int8:   the caller's row scales, float32 [B | blocks, capacity | block_size, Hkv],
//           read in place (absent: empty, and the library names the missing scales);
//   float8: a float32 1-D array of 1 (per tensor) or Hkv (per kv head) scales, each
//           positive and finite, repeated along the rows by strides 0 — what vLLM and
//           SGLang keep per layer. Absent, a wrong count or a bad value: qkv::Error
//           naming the argument (the values' words are qkv::KVCache's for its config);
//   others: absent (a scale given is a qkv::Error naming it).
View3<const float> cache_scale_view(const char* name, const std::optional<ArrayRef>& scale, StorageType storage,
                                    const std::array<int64_t, 3>& rows);

}  // namespace qkv::python
