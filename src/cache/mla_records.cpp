// qkv::mla_decode over FlashMLA's FP8 records (qkv/mla.hpp's MlaRecordArgs): every
// argument validated with the words of the other mla_decode entry points (nothing is
// written on a bad call), then the cpu kernel (cpu/mla_records.cpp) or, for backend
// reference, attention in double over the stored values.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cache/decode_source.hpp"
#include "cache/mla_queries.hpp"
#include "core/key_selection.hpp"
#include "core/validate.hpp"
#include "cpu/mla_records.hpp"
#include "qkv/error.hpp"
#include "qkv/float8.hpp"
#include "qkv/mla.hpp"

namespace qkv {
namespace {

using detail::Checker;
using detail::Described;
using detail::describe;

// The stored value of latent channel c (c < dc) or rotary channel c − dc of a record.
double stored_value(const detail::LatentRecords& rec, const std::uint8_t* record, int64_t c) {
  if (c < rec.dc) {
    float8_e4m3fn v;
    std::memcpy(&v, record + c, 1);
    return static_cast<double>(static_cast<float>(v) * rec.scale(record, c / detail::LatentRecords::kScaleGroup));
  }
  bfloat16 v;
  std::memcpy(&v, rec.rope(record) + 2 * (c - rec.dc), 2);
  return static_cast<float>(v);
}

// backend reference: each row's softmax in double over the stored values (the value of
// a record as the kernel reads it: e4m3 · scale rounded to float32 once). A test backend:
// it allocates as it goes, after before_reading.
void reference_records(const detail::RecordsProblem& problem) {
  if (problem.before_reading) problem.before_reading();
  const auto& p = *problem.dense;
  const auto& rec = problem.records;
  const detail::Extents& e = p.extents;
  const auto rows = p.rows();
  std::vector<int32_t> listed(static_cast<std::size_t>(problem.keys ? problem.keys->topk : 0));
  std::vector<uint64_t> marks = problem.keys ? problem.keys->marks_for(e.k_len) : std::vector<uint64_t>{};
  std::vector<double> score, out(static_cast<std::size_t>(rec.dc));
  for (int64_t b = 0; b < e.batch; ++b)
    for (int64_t i = 0; i < p.mask.q_len(b); ++i) {
      std::vector<int64_t> keys;
      if (problem.keys != nullptr) {
        const int64_t count = problem.keys->attended_keys(p.mask, b, 0, i, listed.data(), marks);
        keys.assign(listed.begin(), listed.begin() + count);
      } else {
        for (int64_t j = 0; j < p.mask.key_end(b, i); ++j) keys.push_back(j);
      }
      for (int64_t h = 0; h < e.q_heads; ++h) {
        const float* q = rows.q(b, i, h);
        score.assign(keys.size(), 0.0);
        double top = p.modifiers.has_sinks() ? static_cast<double>(p.modifiers.sinks[static_cast<std::size_t>(h)])
                                             : -INFINITY;
        for (std::size_t t = 0; t < keys.size(); ++t) {
          const std::uint8_t* record = rec.row(b, keys[t]);
          double dot = 0.0;
          for (int64_t c = 0; c < e.head_dim; ++c) dot += static_cast<double>(q[c]) * stored_value(rec, record, c);
          double s = p.scale * dot;
          if (p.modifiers.softcap != 0.0f) s = p.modifiers.softcap * std::tanh(s / p.modifiers.softcap);
          score[t] = s;
          top = std::max(top, s);
        }
        double total = p.modifiers.has_sinks() ? std::exp(p.modifiers.sinks[static_cast<std::size_t>(h)] - top) : 0.0;
        std::fill(out.begin(), out.end(), 0.0);
        for (std::size_t t = 0; t < keys.size(); ++t) {
          const double w = std::exp(score[t] - top);
          total += w;
          const std::uint8_t* record = rec.row(b, keys[t]);
          for (int64_t c = 0; c < rec.dc; ++c) out[static_cast<std::size_t>(c)] += w * stored_value(rec, record, c);
        }
        const bool empty = total == 0.0;
        float* o = rows.out(b, i, h);
        for (int64_t c = 0; c < rec.dc; ++c) o[c] = empty ? 0.0f : static_cast<float>(out[static_cast<std::size_t>(c)] / total);
        if (!p.args.lse.empty()) rows.lse(b, h, i) = empty ? -INFINITY : static_cast<float>(top + std::log(total));
      }
    }
}

}  // namespace

void mla_decode(const MlaRecordArgs& a, const AttentionOptions& options) {
  const Checker check("qkv::mla_decode");
  if (!a.indices.empty()) detail::refuse_for_key_lists(check, options);
  detail::require_model_scale(check, options);
  if (options.window.active())
    check.fail("options.window: not supported over FlashMLA's FP8 records (list the window's keys in indices)");
  if (!options.alibi_slopes.empty()) check.fail("options.alibi_slopes: not supported over FlashMLA's FP8 records");
  const Described q_nope = describe("q_nope", a.q_nope), q_pe = describe("q_pe", a.q_pe),
                  cache = describe("ckv_cache", a.ckv_cache), out = describe("out", a.out);
  detail::check_latent_queries(check, q_nope, q_pe);
  for (const Described* view : {&cache, &out}) check.expect_well_formed(*view);
  const int64_t batch = a.q_nope.shape[0], q_len = a.q_nope.shape[1], heads = a.q_nope.shape[2];
  const int64_t dc = a.q_nope.shape[3], dr = a.q_pe.shape[3];
  if (dc % detail::LatentRecords::kScaleGroup != 0)
    check.fail("q_nope.shape[3] (dc): FlashMLA's FP8 records keep one scale per 128 latent values, so dc must be a "
               "multiple of 128, got " + std::to_string(dc));
  check.expect_extent(cache, 2, "record bytes", mla_record_bytes(dc, dr),
                      "dc + 4*dc/128 + 2*dr: e4m3 latent, float32 scales, bfloat16 k_pe (656 at dc 512, dr 64)");
  std::vector<Described> inputs{q_nope, q_pe, cache};
  const int64_t capacity =
      detail::check_cache_layout(check, cache, a.block_table, a.cache_lengths, batch, "as q_nope.shape[0]", inputs);
  std::vector<Described> outputs;
  detail::check_decode_outputs(check, out, a.lse, batch, q_len, heads, dc, "as q_nope.shape[3]", outputs);
  check.expect_outputs_apart(outputs, inputs);

  const int64_t d = dc + dr;
  const std::vector<float> q = detail::latent_query_rows(a.q_nope, a.q_pe);
  const auto q_view = View4<const float>::contiguous(q.data(), {batch, q_len, heads, d});
  const detail::ForwardProblem<float> p =
      detail::cache_problem(check, options, q_view, a.out, a.lse, /*kv_heads=*/1, capacity, dc, a.cache_lengths);
  detail::run_records(check, p, a.indices, a.ckv_cache, dc, dr, a.block_table.data, a.block_table.strides[0],
                      resolve_backend(options, false, false));
}

void detail::run_records(const Checker& check, const ForwardProblem<float>& p, const KeyIndices& indices,
                         View3<const std::uint8_t> records, int64_t dc, int64_t dr, const int32_t* block_table,
                         int64_t table_stride, Backend backend, std::function<void()> before_reading) {
  KeySelection selection;
  if (!indices.empty()) {
    check_key_lists(check, p, indices);
    selection = {indices, 1, indices.is_int64() ? indices.int64_view().shape[3] : indices.int32_view().shape[3]};
  }
  RecordsProblem problem;
  problem.before_reading = std::move(before_reading);
  problem.dense = &p;
  problem.keys = indices.empty() ? nullptr : &selection;
  LatentRecords& rec = problem.records;
  rec.data = records.data;
  rec.seq_stride = records.strides[0];
  rec.row_stride = records.strides[1];
  rec.dc = dc;
  rec.dr = dr;
  if (block_table != nullptr) {
    rec.block_table = block_table;
    rec.table_stride = table_stride;
    rec.page_size = records.shape[1];
  }
  if (backend == Backend::reference) return reference_records(problem);
  cpu::mla_records_decode(problem);  // nothing to do for no rows
}

}  // namespace qkv
