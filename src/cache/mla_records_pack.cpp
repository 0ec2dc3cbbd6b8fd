// qkv::pack_mla_records (qkv/mla.hpp): float rows written as FlashMLA's FP8 records, the
// layout cache/mla_records.cpp reads. Every check first; then one record per row.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "check/checker.hpp"
#include "qkv/error.hpp"
#include "qkv/float8.hpp"
#include "qkv/half.hpp"
#include "qkv/mla.hpp"

namespace qkv {
namespace {

constexpr float kE4m3Max = 448.0f;  // the largest finite float8_e4m3fn
constexpr int64_t kGroup = 128;     // latent values per scale

// The scale of one group of 128 values: max|x| / 448 (at least 1e-4 / 448, so that an
// all-zero group divides by something), as float32 arithmetic gives it; or the power of
// two at or above it.
float group_scale(const float* x, RecordScales kind) {
  float amax = 0.0f;
  for (int64_t c = 0; c < kGroup; ++c) amax = std::max(amax, std::abs(x[c]));
  const float scale = std::max(amax, 1e-4f) / kE4m3Max;
  return kind == RecordScales::power_of_two ? std::exp2(std::ceil(std::log2(scale))) : scale;
}

}  // namespace

void pack_mla_records(TensorView<const float, 2> c_kv, TensorView<const float, 2> k_pe,
                      TensorView<std::uint8_t, 2> records, RecordScales scales) {
  const detail::Checker check("qkv::pack_mla_records");
  const detail::Described latent = detail::describe("c_kv", c_kv), rope = detail::describe("k_pe", k_pe),
                          out = detail::describe("records", records);
  for (const detail::Described* view : {&latent, &rope, &out}) check.expect_well_formed(*view);
  const int64_t rows = c_kv.shape[0], dc = c_kv.shape[1], dr = k_pe.shape[1];
  if (dc == 0 || dc % kGroup != 0)
    check.fail("c_kv.shape[-1] (dc): expected a positive multiple of 128 (a scale per 128 values), got " +
               std::to_string(dc));
  check.expect_extent(rope, 0, "rows", rows, "as c_kv.shape[0]");
  check.expect_extent(out, 0, "rows", rows, "as c_kv.shape[0]");
  check.expect_extent(out, 1, "record bytes", mla_record_bytes(dc, dr),
                      "dc + 4*dc/128 + 2*dr: e4m3 latent, float32 scales, bfloat16 k_pe");
  const detail::Described outputs[] = {out}, inputs[] = {latent, rope};
  check.expect_outputs_apart(outputs, inputs);
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t c = 0; c < dc; ++c)
      if (!std::isfinite(c_kv(n, c)))
        check.fail("c_kv[" + std::to_string(n) + ", " + std::to_string(c) + "]: expected a finite value (a scale per " +
                   "128 values cannot hold inf or NaN), got " + std::to_string(c_kv(n, c)));

  for (int64_t n = 0; n < rows; ++n) {
    std::uint8_t* record = &records(n, 0);
    const float* x = &c_kv(n, 0);
    for (int64_t g = 0; g < dc / kGroup; ++g) {
      const float scale = group_scale(x + g * kGroup, scales);
      std::memcpy(record + dc + 4 * g, &scale, sizeof(scale));
      for (int64_t c = g * kGroup; c < (g + 1) * kGroup; ++c) record[c] = float8_e4m3fn(x[c] / scale).bits;
    }
    std::uint8_t* to = record + dc + 4 * (dc / kGroup);
    for (int64_t c = 0; c < dr; ++c) {
      const std::uint16_t bits = bfloat16(k_pe(n, c)).bits;
      std::memcpy(to + 2 * c, &bits, sizeof(bits));
    }
  }
}

}  // namespace qkv
