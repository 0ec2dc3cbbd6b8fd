// Latent attention over FlashMLA's FP8 records (qkv::MlaRecordArgs) on the cpu backend:
// where each record sits, and the call as the kernel reads it. Built and validated by
// cache/mla_records.cpp; read by cpu/mla_records.cpp and the double-precision reference.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <functional>

#include "check/checker.hpp"
#include "core/key_selection.hpp"
#include "core/problem.hpp"
#include "cpu/simd_target.hpp"  // the entry point applies QKV_SIMD_TARGET itself

namespace qkv::detail {

// Record (b, j): contiguous, data + b·seq_stride + j·row_stride; paged, data +
// page·seq_stride + (j % page_size)·row_stride with page = block_table[b·table_stride +
// j / page_size]. Strides in bytes. Its bytes: dc float8_e4m3fn latent values, dc/128
// float32 scales, dr bfloat16 rotary values.
struct LatentRecords {
  const std::uint8_t* data = nullptr;
  int64_t seq_stride = 0, row_stride = 0;
  const int32_t* block_table = nullptr;  // null: contiguous
  int64_t table_stride = 0, page_size = 0;
  int64_t dc = 0, dr = 0;

  static constexpr int64_t kScaleGroup = 128;  // latent values per scale
  int64_t groups() const { return dc / kScaleGroup; }

  const std::uint8_t* row(int64_t b, int64_t j) const {
    if (block_table == nullptr) return data + b * seq_stride + j * row_stride;
    const int64_t page = block_table[b * table_stride + j / page_size];
    return data + page * seq_stride + (j % page_size) * row_stride;
  }
  // The scale of latent group g of a record (unaligned: read by memcpy).
  float scale(const std::uint8_t* record, int64_t g) const {
    float s;
    std::memcpy(&s, record + dc + 4 * g, sizeof(s));
    return s;
  }
  const std::uint8_t* rope(const std::uint8_t* record) const { return record + dc + 4 * groups(); }
};

// The call: `dense` is the decode problem (queries [B, Nq, H, dc + dr] as float rows,
// unscaled; out [B, Nq, H, dc]; lse; mask rule with cache lengths and the causal mode;
// softcap and sinks; threads; precision); `keys` the validated key lists, or null for
// every key the rule allows.
struct RecordsProblem {
  const ForwardProblem<float>* dense = nullptr;
  LatentRecords records;
  const KeySelection* keys = nullptr;
  // Called once, after the run's workspace is allocated and before its first record is
  // read: BatchPlan::run_appending stores the step's new records here, so that a failed
  // allocation leaves the pool as it was. Empty: nothing to do.
  std::function<void()> before_reading;
};

// The call over `records` ([B | blocks, capacity | block_size, R]; block_table null:
// contiguous) for the checked problem `p` (its queries [q_nope | q_pe], outputs, mask
// rule, options): key lists checked against p, then run on `backend` — cpu
// (cpu/mla_records.cpp), or reference, attention in double over the stored values.
// `before_reading` as RecordsProblem's. Defined in cache/mla_records.cpp; qkv::mla_decode
// and BatchPlan::run call it.
void run_records(const Checker& check, const ForwardProblem<float>& p, const KeyIndices& indices,
                 View3<const std::uint8_t> records, int64_t dc, int64_t dr, const int32_t* block_table,
                 int64_t table_stride, Backend backend, std::function<void()> before_reading = {});

}  // namespace qkv::detail

namespace qkv::cpu {

void mla_records_decode(const detail::RecordsProblem& problem);

}  // namespace qkv::cpu
