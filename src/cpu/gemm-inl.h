// Register-tiled fp32 matrix product for the attention kernels, compiled once per SIMD
// target (included from foreach_target translation units).
//
//   C[M×N] = A[M×K]·B[K×N]   or   C += A·B
//
// A is read one element at a time (broadcast), so it may have any strides: element
// (m, k) is a[m·a_row + k·a_k]; that lets callers use a transposed operand in place
// (A = Pᵀ or Kᵀ never needs a copy). B and C are row-major, contiguous along N, with
// leading dimensions ldb and ldc; N must be a multiple of the vector length (callers
// pad their packed panels with zeros). The micro-kernel keeps a
// kRows × kCols-vector tile of C in registers, streams one row of B (kCols loads) per
// step of k and broadcasts one element of A per row: kRows·kCols FMAs against
// kCols + kRows loads, so the FMA pipes, not the loads, set the pace. The panel of B
// (K × kCols·lanes) is reused by every row tile and stays in L1.
//
// Per-target include guard (Highway's toggle idiom).
#if defined(QKV_CPU_GEMM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_CPU_GEMM_INL_H_
#undef QKV_CPU_GEMM_INL_H_
#else
#define QKV_CPU_GEMM_INL_H_
#endif

#include <cstddef>

#include "hwy/highway.h"
#include "cpu/vec_array-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Register budget per target: AVX2/SSE4 have 16 vector registers, AVX-512 and NEON 32.
// Tile = kGemmRows × kGemmCols vectors of accumulators plus kGemmCols B loads plus one
// broadcast must fit: 6×2+2+1 = 15 ≤ 16 and 6×4+4+1 = 29 ≤ 32.
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_SSSE3 || \
    HWY_TARGET == HWY_EMU128 || HWY_TARGET == HWY_SCALAR
inline constexpr size_t kGemmCols = 2;
#else
inline constexpr size_t kGemmCols = 4;
#endif
inline constexpr size_t kGemmRows = 6;

// C[0:R, 0:C·lanes] (+)= A[0:R, 0:K] · B[0:K, 0:C·lanes]
// A operand: element (m, k) at data[m·row + k·step].
struct StridedA {
  const float* data;
  size_t row;
  size_t step;
  StridedA offset_rows(size_t m) const { return {data + m * row, row, step}; }
};

// What a tile does with its sums when it is done:
//   overwrite    C = A·B
//   accumulate   C = C + A·B, summed onto C from the start
//   add_block    C = C + (A·B): the block's sum from zero, then added (see GemmAddBlock)
//   rescale_add  C[r] = C[r]·scale[r] + (A·B)[r]: the forward's online-softmax update
// The last two are what a separate product into scratch followed by a pass over C
// computes, with the same operations in the same order (the same bits), minus that
// scratch's store and reload.
enum class GemmStore { overwrite, accumulate, add_block, rescale_add };

template <size_t R, size_t C>
HWY_INLINE void GemmTile(size_t K, StridedA a,
                         const float* HWY_RESTRICT b, size_t ldb, float* HWY_RESTRICT c,
                         size_t ldc, GemmStore store, const float* HWY_RESTRICT row_scale) {
  const hn::ScalableTag<float> d;
  const size_t lanes = hn::Lanes(d);
  using V = hn::Vec<decltype(d)>;
  VecArray2<decltype(d), R, C> acc;  // V[R][C] (vec_array-inl.h: not on SVE)
  for (size_t r = 0; r < R; ++r)
    for (size_t j = 0; j < C; ++j)
      acc[r][j] = store == GemmStore::accumulate ? hn::LoadU(d, c + r * ldc + j * lanes) : hn::Zero(d);
  for (size_t k = 0; k < K; ++k) {
    VecArray<decltype(d), C> row;
    for (size_t j = 0; j < C; ++j) row[j] = hn::LoadU(d, b + k * ldb + j * lanes);
    for (size_t r = 0; r < R; ++r) {
      const V broadcast = hn::Set(d, a.data[r * a.row + k * a.step]);
      for (size_t j = 0; j < C; ++j) acc[r][j] = hn::MulAdd(broadcast, row[j], acc[r][j]);
    }
  }
  for (size_t r = 0; r < R; ++r) {
    float* out = c + r * ldc;
    if (store == GemmStore::add_block) {
      for (size_t j = 0; j < C; ++j)
        hn::StoreU(hn::Add(hn::LoadU(d, out + j * lanes), acc[r][j]), d, out + j * lanes);
    } else if (store == GemmStore::rescale_add) {
      const V scale = hn::Set(d, row_scale[r]);
      for (size_t j = 0; j < C; ++j)
        hn::StoreU(hn::MulAdd(hn::LoadU(d, out + j * lanes), scale, acc[r][j]), d, out + j * lanes);
    } else {
      for (size_t j = 0; j < C; ++j) hn::StoreU(acc[r][j], d, out + j * lanes);
    }
  }
}

// All rows of one column panel, in tiles of kGemmRows rows.
template <size_t C>
HWY_INLINE void GemmPanel(size_t M, size_t K, StridedA a,
                          const float* HWY_RESTRICT b, size_t ldb, float* HWY_RESTRICT c,
                          size_t ldc, GemmStore store, const float* HWY_RESTRICT row_scale) {
  size_t m = 0;
  for (; m + kGemmRows <= M; m += kGemmRows)
    GemmTile<kGemmRows, C>(K, a.offset_rows(m), b, ldb, c + m * ldc, ldc, store,
                           row_scale == nullptr ? nullptr : row_scale + m);
  const StridedA a_rest = a.offset_rows(m);
  float* c_rest = c + m * ldc;
  const float* scale_rest = row_scale == nullptr ? nullptr : row_scale + m;
  switch (M - m) {  // the last few rows, with a shorter tile
    case 5: GemmTile<5, C>(K, a_rest, b, ldb, c_rest, ldc, store, scale_rest); break;
    case 4: GemmTile<4, C>(K, a_rest, b, ldb, c_rest, ldc, store, scale_rest); break;
    case 3: GemmTile<3, C>(K, a_rest, b, ldb, c_rest, ldc, store, scale_rest); break;
    case 2: GemmTile<2, C>(K, a_rest, b, ldb, c_rest, ldc, store, scale_rest); break;
    case 1: GemmTile<1, C>(K, a_rest, b, ldb, c_rest, ldc, store, scale_rest); break;
    default: break;
  }
}

// C ⟵ A·B (how: `store`) for N a multiple of the vector length; row_scale only for
// GemmStore::rescale_add.
HWY_INLINE void GemmStoring(size_t M, size_t N, size_t K, StridedA a,
                            const float* HWY_RESTRICT b, size_t ldb, float* HWY_RESTRICT c,
                            size_t ldc, GemmStore store, const float* HWY_RESTRICT row_scale) {
  const hn::ScalableTag<float> d;
  const size_t lanes = hn::Lanes(d);
  const size_t panel = kGemmCols * lanes;
  size_t n = 0;
  for (; n + panel <= N; n += panel)
    GemmPanel<kGemmCols>(M, K, a, b + n, ldb, c + n, ldc, store, row_scale);
  // The last 1..kGemmCols-1 vectors of columns (N is a multiple of lanes).
  switch ((N - n) / lanes) {
    case 3: GemmPanel<3>(M, K, a, b + n, ldb, c + n, ldc, store, row_scale); break;
    case 2: GemmPanel<2>(M, K, a, b + n, ldb, c + n, ldc, store, row_scale); break;
    case 1: GemmPanel<1>(M, K, a, b + n, ldb, c + n, ldc, store, row_scale); break;
    default: break;
  }
}

// C (+)= A·B for N a multiple of the vector length.
HWY_INLINE void Gemm(size_t M, size_t N, size_t K, StridedA a,
                     const float* HWY_RESTRICT b, size_t ldb, float* HWY_RESTRICT c,
                     size_t ldc, bool accumulate) {
  GemmStoring(M, N, K, a, b, ldb, c, ldc,
              accumulate ? GemmStore::accumulate : GemmStore::overwrite, nullptr);
}

// C += A·B summed blockwise: each tile's block product is summed from zero in registers
// and then added to C. When C accumulates many blocks (dK and dV over every query
// block, dQ over every key block), this sums each block's K terms from zero instead of
// onto the large running total: the rounding error bound drops from ~(total terms)·ε
// to ~(K + blocks)·ε, at no cost (the add is the tile's store).
HWY_INLINE void GemmAddBlock(size_t M, size_t N, size_t K, StridedA a,
                             const float* HWY_RESTRICT b, size_t ldb, float* HWY_RESTRICT c,
                             size_t ldc) {
  GemmStoring(M, N, K, a, b, ldb, c, ldc, GemmStore::add_block, nullptr);
}

// C[r] = C[r]·scale[r] + (A·B)[r]: the forward's acc·α + P·V, with P·V summed from zero.
HWY_INLINE void GemmRescaleAdd(size_t M, size_t N, size_t K, StridedA a,
                               const float* HWY_RESTRICT b, size_t ldb, float* HWY_RESTRICT c,
                               size_t ldc, const float* HWY_RESTRICT scale) {
  GemmStoring(M, N, K, a, b, ldb, c, ldc, GemmStore::rescale_add, scale);
}

}  // namespace qkv::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
