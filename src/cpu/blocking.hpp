// Block sizes of the fused CPU kernels, in one place.
#pragma once

#include <cstddef>
#include <cstdint>

namespace qkv::cpu {

// Queries per block. The transposed, pre-scaled Q block (d × 64 floats: 16 KiB at
// d = 64, 32 KiB at d = 128) and the output accumulator (64 × dv) stay in L1/L2 while
// every key block of the row streams past; 64 columns are 4 AVX-512 vectors (one
// micro-kernel panel) or 8 AVX2 vectors. Also the unit of parallel work in the forward
// and the dQ pass.
inline constexpr int64_t kBlockQueries = 64;

// Keys per block: the score tile is kBlockKeys × kBlockQueries floats (16 KiB, in L1),
// and a causal diagonal needs masking in only one block per query block. Also the unit
// of parallel work of the dK/dV pass.
inline constexpr int64_t kBlockKeys = 64;

inline constexpr std::size_t round_up(std::size_t n, std::size_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

}  // namespace qkv::cpu
