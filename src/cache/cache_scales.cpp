#include "cache/cache_scales.hpp"

#include <string>
#include <tuple>

namespace qkv::detail {

void check_cache_scales(const Checker& check, StorageType storage, const CacheScales& scales,
                        const std::array<int64_t, 4>& k_shape, const std::array<int64_t, 4>& v_shape,
                        bool paged, const char* first_axis, std::vector<Described>& inputs) {
  // int8 and float8 caches: a scale per cached row, shaped like the cache without its
  // last axis (float8: usually a per-head or per-tensor scale repeated by zero strides).
  const bool scaled = storage == StorageType::int8 || is_float8(storage);
  for (const auto& [name, scale, shape, cache_name] :
       {std::tuple{"k_scale", &scales.k_scale, &k_shape, "k_cache"},
        std::tuple{"v_scale", &scales.v_scale, &v_shape, "v_cache"}}) {
    if (!scaled) {
      if (!scale->empty())
        check.fail(std::string(name) + ": only int8 and float8 caches take scales (this cache is " + storage_name(storage) + ")");
      continue;
    }
    if (scale->empty())
      check.fail(std::string(name) + ": expected one float32 scale per cached row for " +
                 (is_float8(storage) ? "a float8" : "an int8") + " cache (float8: strides 0 repeat one per head), got none");
    const Described d = describe(name, *scale);
    check.expect_well_formed(d, /*inner_contiguous=*/false);  // read one scale per row, any strides
    const char* axis_names[3] = {first_axis, paged ? "block_size" : "capacity", "kv heads"};
    for (int axis = 0; axis < 3; ++axis) {
      const std::string as = "as " + std::string(cache_name) + ".shape[" + std::to_string(axis) + "]";
      check.expect_extent(d, axis, axis_names[axis], (*shape)[static_cast<std::size_t>(axis)], as.c_str());
    }
    inputs.push_back(d);
  }

  // int8 keys' channel scales: [B | blocks, ⌈rows / key_group⌉, Hkv, d], d contiguous.
  const View4<const float>& channel = scales.k_channel_scale;
  if (channel.empty()) {
    if (!scales.k_channel_zero.empty())
      check.fail("k_channel_zero: zero points come with k_channel_scale, which is empty");
    if (scales.key_group != 0)
      check.fail("key_group: expected 0 without k_channel_scale, got " + std::to_string(scales.key_group));
    return;
  }
  if (storage != StorageType::int8)
    check.fail(std::string("k_channel_scale: only int8 caches take channel scales (this cache is ") +
               storage_name(storage) + ")");
  const int64_t rows = k_shape[1], group = scales.key_group;
  if (group < 1 || group > rows)
    check.fail("key_group: expected 1.." + std::to_string(rows) + " keys per channel-scale group (" +
               (paged ? "k_cache.shape[1], the block size" : "k_cache.shape[1], the capacity") + "), got " +
               std::to_string(group));
  if (paged && rows % group != 0)
    check.fail("key_group: a paged cache's block size (" + std::to_string(rows) +
               ", k_cache.shape[1]) must be a multiple of it, got " + std::to_string(group));
  const Described d = describe("k_channel_scale", channel);
  check.expect_well_formed(d);
  check.expect_extent(d, 0, first_axis, k_shape[0], "as k_cache.shape[0]");
  const int64_t groups = (rows + group - 1) / group;
  const std::string why = "⌈k_cache.shape[1] / key_group⌉";
  check.expect_extent(d, 1, "groups", groups, why.c_str());
  check.expect_extent(d, 2, "kv heads", k_shape[2], "as k_cache.shape[2]");
  check.expect_extent(d, 3, "head_dim", k_shape[3], "as k_cache.shape[3]");
  inputs.push_back(d);
  const View4<const float>& zeros = scales.k_channel_zero;
  if (zeros.empty()) return;
  const Described z = describe("k_channel_zero", zeros);
  for (int axis = 0; axis < 4; ++axis) {
    const std::string as = "as k_channel_scale.shape[" + std::to_string(axis) + "]";
    check.expect_extent(z, axis, axis == 0 ? first_axis : axis == 1 ? "groups" : axis == 2 ? "kv heads" : "head_dim",
                        channel.shape[static_cast<std::size_t>(axis)], as);
    if (zeros.shape[static_cast<std::size_t>(axis)] > 1 && zeros.strides[static_cast<std::size_t>(axis)] != channel.strides[static_cast<std::size_t>(axis)])
      check.fail("k_channel_zero.strides[" + std::to_string(axis) + "]: expected " +
                 std::to_string(channel.strides[static_cast<std::size_t>(axis)]) + " (as k_channel_scale's), got " +
                 std::to_string(zeros.strides[static_cast<std::size_t>(axis)]));
  }
  inputs.push_back(z);
}

}  // namespace qkv::detail
