#include "cache_scales.hpp"

#include <cmath>
#include <string>

#include "qkv/error.hpp"

namespace qkv::python {

View3<const float> cache_scale_view(const char* name, const std::optional<ArrayRef>& scale, StorageType storage,
                                    const std::array<int64_t, 3>& rows) {
  if (storage == StorageType::int8) {
    if (!scale) return {};  // the library's check names the missing scales, as in C++
    return view_of<const float, 3>(name, *scale, "scales are float32");
  }
  if (!is_float8(storage)) {
    // Refused here, before any look at the array: a float given for a float32 cache
    // (a float8 habit) gets this word, not one about its rank.
    if (scale)
      throw Error(Caller::named(name) + ": only int8 and float8 caches take scales (this cache is " +
                  storage_name(storage) + ")");
    return {};
  }
  const int64_t heads = rows[2];
  if (!scale)
    throw Error(Caller::named(name) + ": a float8 cache needs its scale: a float (per tensor) or " +
                std::to_string(heads) + " floats (per kv head), got none (vLLM's default when a checkpoint "
                "has no scales is 1.0: pass " + name + "=1.0)");
  // The Python layer hands a float or a sequence over as a 1-D float32 array.
  const auto vector = view_of<const float, 1>(name, *scale, "scales are float32");
  const int64_t count = vector.shape[0];
  if (count != 1 && count != heads)
    throw Error(Caller::named(name) + ": expected 1 (per tensor) or " + std::to_string(heads) +
                " (k_cache.shape[2], per kv head) scales for a float8 cache, got " + std::to_string(count));
  // Checked once here, per value (Hkv of them): the kernel multiplies by them unchecked.
  // The words are qkv::KVCache's for config.k_scale, so one bad value reads alike everywhere.
  for (int64_t h = 0; h < count; ++h) {
    const float value = vector.data[h * vector.strides[0]];
    if (!(value > 0.0f) || !std::isfinite(value))
      throw Error(Caller::named(name) + ("[" + std::to_string(h) + "]: expected a positive finite scale, got ") +
                  std::to_string(value));
  }
  // Row (b, j, h)'s scale is entry h (per head) or entry 0 (per tensor): strides 0 along
  // the rows, so no [B, capacity, Hkv] array is ever made.
  const int64_t head_stride = count == 1 ? 0 : vector.strides[0];
  return View3<const float>(vector.data, {rows[0], rows[1], heads}, {0, 0, head_stride});
}

}  // namespace qkv::python
