// The split-K (decode) schedule's scores over int8 caches on AVX512-VNNI (vpdpbusd: 64
// u8·s8 multiply-adds per instruction into int32 lanes), llama.cpp's q8 × q8 dot: each
// query row (scale·q, float) is quantized to int8 once per task with its own scale, the
// dot with a key's stored int8 row is exact in int32, then times the query's scale (and,
// in decode.cpp as before, the key's). Plain functions with their own target attribute;
// called only where dot_products.hpp allows (x86-64 with the unit, Precision::fast).
//
// vpdpbusd needs one unsigned operand: the key bytes are flipped to k + 128 (a XOR with
// 0x80), and 128·Σ_c q8_c, known per row, is subtracted from the integer sum.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qkv::cpu::int8dot {

// Bytes of a quantized query row: d rounded up to whole zmm (64), zero-padded.
constexpr std::size_t query_ld(std::size_t d) { return (d + 63) / 64 * 64; }

// q8[r] = round(q[r]/s_r) with s_r = max_c |q[r][c]| / 127 (a zero or non-finite row: see
// the .cpp), q_scale[r] = s_r, q_bias[r] = 128·Σ_c q8[r][c], for r < rows (q row r at
// q + r·q_ld floats, d of them).
void QuantizeQueries(const float* q, std::size_t rows, std::size_t q_ld, std::size_t d, std::int8_t* q8,
                     float* q_scale, std::int32_t* q_bias);

// scores[r·ld + j] = (Σ_c q8[r][c]·k_j[c]) · q_scale[r] for r < rows, j < keys (a multiple
// of 4; k_j = k[j], d int8 values each, read in place — nothing past the row).
void Scores(std::size_t rows, const std::int8_t* q8, std::size_t q8_ld, const float* q_scale,
            const std::int32_t* q_bias, const std::int8_t* const* k, std::size_t d, std::size_t keys,
            float* scores, std::size_t ld);

}  // namespace qkv::cpu::int8dot
