// KVCache::append and append_varlen with a Rotary (qkv/kv_cache.hpp): the new keys rotated
// into scratch, then appended as usual — so every storage type, paged pools, channel
// scales and float windows store exactly what an append of pre-rotated keys stores.
#include <cstdint>
#include <string>
#include <vector>

#include "cache/rotary.hpp"
#include "check/checker.hpp"
#include "core/checked_size.hpp"
#include "qkv/kv_cache.hpp"

namespace qkv {
namespace {

// k's rows rotated into `to` (row-major, k's shape), row r of the tables for the r-th
// (sequence entry, token) in k's order. k's extents are checked here, with append's
// messages, because the rotation reads them before append does.
template <int R>
TensorView<const float, R> rotated(const detail::Checker& check, const TensorView<const float, R>& k, const Rotary& rotary,
                             int64_t head_dim, std::vector<float>& to) {
  const detail::Described kd = detail::describe("k", k);
  check.expect_well_formed(kd);
  check.expect_extent(kd, R - 1, "head_dim", head_dim, "the cache's head_dim");
  int64_t tokens = 1;
  for (int axis = 0; axis < R - 2; ++axis) tokens *= k.shape[axis];
  const int64_t heads = k.shape[R - 2];
  const detail::CheckedRotary rotate(check, rotary, tokens, head_dim);
  if (!rotate.active()) return k;
  const auto floats = static_cast<std::size_t>(detail::checked_product(
      "qkv::KVCache::append", "the rotated keys", {{"new tokens", tokens}, {"kv heads", heads}, {"head_dim", head_dim}}));
  detail::allocate_or_throw("qkv::KVCache::append", "the rotated keys", floats * sizeof(float),
                            [&] { to.resize(floats); });
  typename TensorView<const float, R>::Shape strides{};
  int64_t step = 1;
  for (int axis = R - 1; axis >= 0; --axis) {
    strides[axis] = step;
    step *= k.shape[axis];
  }
  for (int64_t r = 0; r < tokens; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      const float* x = nullptr;
      if constexpr (R == 4) {
        x = &k(r / k.shape[1], r % k.shape[1], h, 0);
      } else {
        x = &k(r, h, 0);
      }
      rotate.rotate(r, x, to.data() + (r * heads + h) * head_dim);
    }
  return TensorView<const float, R>(to.data(), k.shape, strides);
}

}  // namespace

void KVCache::append(View4<const float> k, View4<const float> v, const Rotary& rotary, std::span<const int64_t> seqs) {
  std::vector<float> scratch;
  append(rotated(detail::Checker("qkv::KVCache::append"), k, rotary, config_.head_dim, scratch), v, seqs);
}

void KVCache::append_varlen(View3<const float> k, View3<const float> v, SeqOffsets cu_seqlens, const Rotary& rotary,
                            std::span<const int64_t> seqs) {
  std::vector<float> scratch;
  append_varlen(rotated(detail::Checker("qkv::KVCache::append_varlen"), k, rotary, config_.head_dim, scratch), v,
                cu_seqlens, seqs);
}

}  // namespace qkv
