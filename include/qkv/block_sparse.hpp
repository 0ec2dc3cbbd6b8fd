// A block-sparse mask (FlexAttention's BlockMask) as a mask_mod (qkv/modifiers.hpp): the
// (query, key) plane cut into block_q × block_k blocks, each empty (no pair takes part),
// full (every pair does) or partial (a per-block byte mask says which). Memory: one byte
// and one int32 per block, plus block_q·block_k bytes per *partial* block — never an
// Nq × Nk mask.
//
//   qkv::BlockSparseMask blocks({.block_q = 128, .block_k = 128, .state = state,
//                                .slot = slot, .bytes = bytes});
//   options.modifiers.mask = blocks;          // refers to `blocks` (must outlive the call)
//
// state [B|1, H|1, QB, KB] (kEmpty, kPartial or kFull; an axis of extent 1 broadcasts),
// slot [B|1, H|1, QB, KB] (a partial block's index into bytes, else ignored), bytes
// [P, block_k, block_q] (nonzero keeps the pair; key-major, so that the kernels' tiles,
// stored transposed, read a key's queries contiguously and the masking vectorizes). Pairs outside the QB·block_q × KB·block_k
// plane, or of a batch entry / head past a non-broadcast extent, are removed.
//
// The tile plan classifies each 64×64 kernel tile through count(), which reads the
// block table: a row's keys in a full block count at once, in an empty block not at all,
// and only partial blocks' bytes are read — so kernel tiles inside full blocks get no
// mask work, tiles inside empty ones are skipped, and only tiles meeting a partial block
// (or a block edge between kinds) are masked elementwise, forward and backward.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "qkv/error.hpp"
#include "qkv/modifiers.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

struct BlockSparseView {
  int64_t block_q = 0, block_k = 0;
  TensorView<const std::uint8_t, 4> state;
  TensorView<const int32_t, 4> slot;
  TensorView<const std::uint8_t, 3> bytes;
};

class BlockSparseMask {
 public:
  static constexpr std::uint8_t kEmpty = 0, kPartial = 1, kFull = 2;

  // Checks the view (qkv::Error naming the field): block sizes ≥ 1, state and slot of one
  // shape, every state a kind, every partial block's slot inside bytes, bytes
  // [P, block_k, block_q]. O(blocks).
  explicit BlockSparseMask(const BlockSparseView& view) : v_(view) {
    const std::string where = "qkv::BlockSparseMask: ";
    if (v_.block_q < 1 || v_.block_k < 1)
      throw Error(where + "block_q, block_k: expected >= 1, got " + std::to_string(v_.block_q) +
                  ", " + std::to_string(v_.block_k));
    if (v_.state.empty() || v_.state.shape != v_.slot.shape)
      throw Error(where + "state, slot: expected two [B|1, H|1, QB, KB] views of one shape");
    for (int axis = 0; axis < 4; ++axis)
      if (v_.state.shape[axis] < 1) throw Error(where + "state: expected every extent >= 1");
    const int64_t slots = v_.bytes.empty() ? 0 : v_.bytes.shape[0];
    if (slots > 0 && (v_.bytes.shape[1] != v_.block_k || v_.bytes.shape[2] != v_.block_q))
      throw Error(where + "bytes: expected [P, block_k, block_q]");
    for (int64_t b = 0; b < v_.state.shape[0]; ++b)
      for (int64_t h = 0; h < v_.state.shape[1]; ++h)
        for (int64_t qb = 0; qb < v_.state.shape[2]; ++qb)
          for (int64_t kb = 0; kb < v_.state.shape[3]; ++kb) {
            const std::uint8_t kind = v_.state(b, h, qb, kb);
            if (kind > kFull) throw Error(where + "state: expected 0 (empty), 1 (partial) or 2 (full), got " + std::to_string(kind));
            const int32_t s = v_.slot(b, h, qb, kb);
            if (kind == kPartial && (s < 0 || s >= slots))
              throw Error(where + "slot: a partial block's slot " + std::to_string(s) +
                          " is outside bytes' " + std::to_string(slots) + " blocks");
          }
  }
  BlockSparseMask(const BlockSparseMask&) = delete;
  BlockSparseMask& operator=(const BlockSparseMask&) = delete;

  // Whether the state varies over heads (else one plan serves every head).
  bool varies_with_head() const { return v_.state.shape[1] > 1; }

  MaskModHook hook() const& {
    return {.context = this, .count = &count, .apply = &apply, .keeps = &keeps,
            .varies_with_head = varies_with_head()};
  }
  operator MaskModHook() const& { return hook(); }  // NOLINT(google-explicit-constructor)
  operator MaskModHook() const&& = delete;          // a temporary would dangle

 private:
  // The kind of the block holding (query i, key j) of entry b, head h (empty outside).
  std::uint8_t kind(int64_t b, int64_t h, int64_t qb, int64_t kb) const {
    const auto& s = v_.state.shape;
    if (qb >= s[2] || kb >= s[3]) return kEmpty;
    if (s[0] > 1 && b >= s[0]) return kEmpty;
    if (s[1] > 1 && h >= s[1]) return kEmpty;
    return v_.state(s[0] > 1 ? b : 0, s[1] > 1 ? h : 0, qb, kb);
  }
  // The bytes of partial block (qb, kb): key c, query r at [c·key_step() + r·query_step()].
  const std::uint8_t* block(int64_t b, int64_t h, int64_t qb, int64_t kb) const {
    const auto& s = v_.state.shape;
    return &v_.bytes(v_.slot(s[0] > 1 ? b : 0, s[1] > 1 ? h : 0, qb, kb), 0, 0);
  }
  int64_t key_step() const { return v_.bytes.strides[1]; }
  int64_t query_step() const { return v_.bytes.strides[2]; }

  static int64_t count(const void* context, const hooks::MaskCount& rows) {
    const BlockSparseMask& m = *static_cast<const BlockSparseMask*>(context);
    int64_t kept = 0;
    for (int64_t r = 0; r < rows.queries; ++r) {
      const int64_t i = rows.first_query + r, qb = i / m.v_.block_q;
      for (int64_t j = rows.key_begin[r]; j < rows.key_end[r];) {
        const int64_t kb = j / m.v_.block_k, stop = std::min<int64_t>(rows.key_end[r], (kb + 1) * m.v_.block_k);
        const std::uint8_t k = m.kind(rows.batch, rows.head, qb, kb);
        if (k == kFull) {
          kept += stop - j;
        } else if (k == kPartial) {
          const std::uint8_t* bytes = m.block(rows.batch, rows.head, qb, kb) +
                                      (i - qb * m.v_.block_q) * m.query_step();
          for (int64_t key = j; key < stop; ++key)
            kept += bytes[(key - kb * m.v_.block_k) * m.key_step()] != 0;
        }
        j = stop;
      }
    }
    return kept;
  }

  // A partial kernel tile, stored transposed (scores[j·ld + i]): −inf where removed, one
  // block segment at a time.
  static void apply(const void* context, const hooks::ScoreTile& t) {
    const BlockSparseMask& m = *static_cast<const BlockSparseMask*>(context);
    constexpr float kRemoved = -std::numeric_limits<float>::infinity();
    const int64_t bq = m.v_.block_q, bk = m.v_.block_k;
    for (int64_t i0 = 0; i0 < t.queries;) {
      const int64_t query = t.first_query + i0, qb = query / bq;
      const int64_t i1 = std::min(t.queries, (qb + 1) * bq - t.first_query);
      for (int64_t j0 = 0; j0 < t.keys;) {
        const int64_t key = t.first_key + j0, kb = key / bk;
        const int64_t j1 = std::min(t.keys, (kb + 1) * bk - t.first_key);
        const std::uint8_t k = m.kind(t.batch, t.head, qb, kb);
        if (k != kFull) {
          const int64_t first_row = t.first_query - qb * bq;
          for (int64_t j = j0; j < j1; ++j) {
            float* scores = t.scores + static_cast<std::size_t>(j) * t.ld;
            if (k == kEmpty) {
              std::fill(scores + i0, scores + i1, kRemoved);
              continue;
            }
            // The key's queries, contiguous when the bytes are (the layout above).
            const std::uint8_t* keep = m.block(t.batch, t.head, qb, kb) +
                                       (t.first_key + j - kb * bk) * m.key_step() +
                                       first_row * m.query_step();
            const int64_t step = m.query_step();
            for (int64_t i = i0; i < i1; ++i)
              scores[i] = keep[i * step] != 0 ? scores[i] : kRemoved;
          }
        }
        j0 = j1;
      }
      i0 = i1;
    }
  }

  static bool keeps(const void* context, int64_t b, int64_t h, int64_t i, int64_t j) {
    const BlockSparseMask& m = *static_cast<const BlockSparseMask*>(context);
    const int64_t qb = i / m.v_.block_q, kb = j / m.v_.block_k;
    const std::uint8_t k = m.kind(b, h, qb, kb);
    if (k != kPartial) return k == kFull;
    return m.block(b, h, qb, kb)[(j - kb * m.v_.block_k) * m.key_step() +
                                 (i - qb * m.v_.block_q) * m.query_step()] != 0;
  }

  BlockSparseView v_;
};

}  // namespace qkv
