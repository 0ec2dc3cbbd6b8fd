// Decode's two block products over int8 caches on AVX512-VNNI (vpdpbusd: 64 u8·s8
// multiply-adds per instruction into int32 lanes, four times the fp32 FMAs' multiply-adds
// per cycle: 682 GOP/s against 171 GFLOP/s on an Emerald Rapids core, dot_products.cpp). Plain functions with
// their own target attribute, not Highway code (Highway 1.0.3 has no integer dot);
// called only where dot_products.hpp allows (x86-64 with the unit, Precision::fast).
//
// The float operand of each product is split into two int8 terms, so the integer sums
// stay exact and the only error is that split's, about 2⁻¹⁶ of the operand's largest
// entry (llama.cpp's q8 × q8 dot quantizes to one term; measured there, one term moves
// out by up to ~1% of max |out|, bench/RESULTS.md §10d):
//   scores  q_r ≈ s_r·(hi + lo/254), s_r = max_c |q_rc| / 127, hi and lo in [-127, 127]:
//           each element within s_r/508 (+ float rounding) of q_r;
//   weights P'_rj (≥ 0, P already times its value row's scale) ≈ t_r·(hi + lo/255),
//           t_r = max_j P'_rj / 255, hi = ⌊P'/t_r⌋ and lo in [0, 255]: within t_r/510.
// vpdpbusd needs one unsigned operand: for the scores the key bytes are flipped to
// k + 128 (a XOR with 0x80) and 128·Σ_c term_c, known per row, is subtracted; for P·V
// the weights are the unsigned side. Integer sums are exact, so their order does not
// matter and results never depend on threads.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qkv::cpu::int8dot {

// Bytes of one term of a quantized query row: d rounded up to whole zmm, zero-padded.
constexpr std::size_t query_ld(std::size_t d) { return (d + 63) / 64 * 64; }

// Quantized query rows: row r's hi term at terms + 2r·ld, its lo term ld bytes after;
// scale[r] = s_r; bias[2r], bias[2r + 1] = 128·Σ_c of each term.
struct Queries {
  std::int8_t* terms = nullptr;
  float* scale = nullptr;
  std::int32_t* bias = nullptr;
  std::size_t ld = 0;

  Queries rows_from(std::size_t r) const { return {terms + 2 * r * ld, scale + r, bias + 2 * r, ld}; }
};

// Rows of a later unit of work to prefetch, key j while key j of this one is read (spread
// over the arithmetic: a burst of prefetches fills the miss buffers and stalls the core).
struct Prefetch {
  const void* const* rows = nullptr;
  std::size_t count = 0;  // rows[0, count) exist
  std::size_t bytes = 0;
  const char* const* lines = nullptr;  // and one line of these a key (a later unit's scales)
  std::size_t line_count = 0;

  // Always inlined: GCC counts __builtin_prefetch as no side effect, so a call to an
  // out-of-line copy is "pure" with an unused result and is deleted — which is what
  // happened to every prefetch of these kernels until this attribute (none was in the
  // object code; the VNNI decode ran at the speed of the float one without prefetches).
  __attribute__((always_inline)) inline void operator()(std::size_t j) const {
    if (j < line_count) __builtin_prefetch(lines[j], 0, 2);
    if (j >= count) return;
    const char* p = static_cast<const char*>(rows[j]);
    for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
    __builtin_prefetch(p + bytes - 1, 0, 2);  // a row that starts inside a cache line
  }
};

// Quantizes rows (q row r at q + r·q_ld floats, d of them). A row of zeros gets scale 0
// (its scores are 0); a row holding NaN/Inf gets a NaN scale, so its scores are NaN as
// the float arithmetic's would be, never silently finite.
void QuantizeQueries(const float* q, std::size_t rows, std::size_t q_ld, std::size_t d, Queries out);

// scores[r·ld + j] = q_r · k_j (k_j = k[j]: d int8 values read in place, nothing past
// the row) for r < rows, j < keys (a multiple of 4), in units of the keys' integers: the
// caller multiplies by the keys' scales.
void Scores(std::size_t rows, Queries q, const std::int8_t* const* k, std::size_t d, std::size_t keys,
            float* scores, std::size_t ld, Prefetch ahead);

// Scratch of AddWeighted for blocks of up to `keys` keys, `rows` rows and dv channels.
std::size_t weight_bytes(std::size_t rows, std::size_t keys);
std::size_t value_bytes(std::size_t keys, std::size_t dv);

// acc_r = acc_r·alpha_r + Σ_j P'_rj·v_j for r < rows, channels < dv (acc row r at acc +
// r·acc_ld; nothing at or past dv is written), P' row r at p + r·p_ld (keys entries, a
// multiple of 4, each ≥ 0; v_j = v[j]: dv int8 values read in place). Returns false, and
// writes nothing, when some row's largest weight is not finite (a NaN score or value
// scale): the caller's float arithmetic then carries the NaN to the row.
bool AddWeighted(std::size_t rows, const float* p, std::size_t p_ld, std::size_t keys, const std::int8_t* const* v,
                 std::size_t dv, const float* alpha, float* acc, std::size_t acc_ld, std::uint8_t* weight_scratch,
                 std::int8_t* value_scratch, Prefetch ahead);

}  // namespace qkv::cpu::int8dot
