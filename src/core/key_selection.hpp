// The key selection of a sparse call (qkv/sparse.hpp): which keys each query row lists,
// validated, and the one definition of the set a row attends, which every backend reads:
//
//   A(b, list, i) = sorted { j : j listed in row i of list `list`, j ≠ −1, j < key_end(b, i) }
//
// with key_end from the problem's MaskRule (the causal prefix). Sorted and each key once:
// the set a scattered boolean mask gives, and a canonical order, so a row's result does
// not depend on the order (or the repeats) of its list.
//
// A sparse problem is the dense problem of the same call (extents, scale, mask rule with
// the causal mode, score modifiers, views) plus this selection: the dense problem alone
// would attend every key.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <vector>

#include "core/problem.hpp"
#include "qkv/sparse.hpp"

namespace qkv::detail {

struct KeySelection {
  KeyIndices indices;
  int64_t lists = 1;  // lists per query: 1 (shared by every head) or Hkv
  int64_t topk = 0;

  // The list that kv head `kv_head` reads.
  int64_t list_of(int64_t kv_head) const { return lists == 1 ? 0 : kv_head; }

  int64_t listed(int64_t b, int64_t list, int64_t i, int64_t t) const {
    return indices.is_int64() ? indices.int64_view()(b, list, i, t)
                              : static_cast<int64_t>(indices.int32_view()(b, list, i, t));
  }

  // f(j) for the topk entries of row (b, list, i) in order: the row's address and stride
  // found once, not per entry (a row of 2048 entries is read for each kv head).
  template <class F>
  void for_each_listed(int64_t b, int64_t list, int64_t i, const F& f) const {
    const auto row = [&](const auto& view) {
      const auto* entry = &view(b, list, i, 0);
      // Locals: f's stores (attended_keys's bit words, uint64_t) may alias this object's
      // int64_t members, which the loop would otherwise reload at every entry.
      const int64_t step = view.strides[3], count = topk;
      for (int64_t t = 0; t < count; ++t) f(static_cast<int64_t>(entry[t * step]));
    };
    if (indices.is_int64()) row(indices.int64_view());
    else row(indices.int32_view());
  }

  // Writes A(b, list, i) into keys[0, count) and returns count (≤ topk). Indices were
  // validated to lie in [−1, Nk). `marks`: the caller's scratch of ⌈Nk/64⌉ zero words,
  // left zero. Sorting topk keys costs ~topk·log2(topk) steps (~45 µs for 2048, a third
  // of the row's arithmetic at d = 128); marking them in a bit set and reading the set
  // words in order costs topk + key_end/64 — used whenever the bit set is that small.
  // Packed lists ([total_q, topk], a qkv::BatchPlan step's) hold sequence b's query i at
  // row q_begin(b) + i.
  int64_t attended_keys(const MaskRule& mask, int64_t b, int64_t list, int64_t i, int32_t* keys,
                        std::vector<uint64_t>& marks) const {
    const int64_t end = mask.key_end(b, i);  // window and key_lengths are refused: begin 0
    if (indices.packed()) {
      i += mask.sequences.q_begin(b);
      b = 0;
    }
    const int64_t words = (end + 63) / 64;
    if (words > 4 * topk || static_cast<int64_t>(marks.size()) < words) {
      int64_t count = 0;
      for_each_listed(b, list, i, [&](int64_t j) {
        if (j >= 0 && j < end) keys[count++] = static_cast<int32_t>(j);
      });
      std::sort(keys, keys + count);
      return std::unique(keys, keys + count) - keys;
    }
    uint64_t* words_of = marks.data();
    for_each_listed(b, list, i, [&](int64_t j) {
      if (j >= 0 && j < end) words_of[j >> 6] |= uint64_t{1} << (j & 63);
    });
    int64_t count = 0;
    for (int64_t w = 0; w < words; ++w) {
      uint64_t word = marks[static_cast<std::size_t>(w)];
      marks[static_cast<std::size_t>(w)] = 0;
      while (word != 0) {
        keys[count++] = static_cast<int32_t>(w * 64 + std::countr_zero(word));
        word &= word - 1;
      }
    }
    return count;
  }

  // Scratch for attended_keys: one bit per key of the call.
  std::vector<uint64_t> marks_for(int64_t k_len) const {
    return std::vector<uint64_t>(static_cast<std::size_t>((k_len + 63) / 64), 0);
  }
};

template <class T>
struct SparseForwardProblem {
  ForwardProblem<T> dense;
  KeySelection keys;
};

template <class T>
struct SparseBackwardProblem {
  BackwardProblem<T> dense;
  KeySelection keys;
};

}  // namespace qkv::detail
