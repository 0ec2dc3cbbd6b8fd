// qkv::BatchPlan::run over FlashMLA's FP8 records (qkv/batch_plan.hpp, "FlashMLA's FP8
// records"): the run's views checked against the plan, then the planned step's rows —
// every sequence with its own query count — on mla_decode's records kernel, which runs
// each query row over its own keys (cpu/mla_records.cpp), or the reference over the
// stored values.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cache/batch_plan_state.hpp"
#include "cache/decode_source.hpp"
#include "cache/rotary.hpp"
#include "core/checked_size.hpp"
#include "cpu/mla_records.hpp"
#include "qkv/batch_plan.hpp"
#include "qkv/error.hpp"
#include "qkv/mla.hpp"

namespace qkv {
namespace {

using detail::Checker;
using detail::Described;
using detail::describe;

// What the plan must be for records: one latent head, dc a multiple of 128 below
// head_dim, float8_e4m3fn storage, no trees, no shared prefixes, no window, no ALiBi.
void check_plan_for_records(const Checker& check, const BatchPlan::State& s) {
  const detail::Extents& e = s.problem.extents;
  if (s.storage != StorageType::float8_e4m3fn)
    check.fail(std::string("records: expected a plan of float8_e4m3fn storage (layout.storage: the records' latent "
                           "values), got ") + storage_name(s.storage));
  if (e.kv_heads != 1)
    check.fail("records: FlashMLA's records hold one latent head, so layout.num_kv_heads must be 1, got " +
               std::to_string(e.kv_heads));
  if (e.v_dim % detail::LatentRecords::kScaleGroup != 0 || e.v_dim >= e.head_dim)
    check.fail("records: layout.v_dim (dc) must be a multiple of 128 (a scale per 128 latent values) below "
               "layout.head_dim (dc + dr), got v_dim " + std::to_string(e.v_dim) + " and head_dim " +
               std::to_string(e.head_dim));
  if (!s.trees.offsets.empty()) check.fail("records: not with a plan that has a tree_mask");
  if (s.shared.active())
    check.fail("records: not with a plan whose sequences share prefixes (layout.share_prefixes)");
  if (s.problem.mask.window.active())
    check.fail("options.window: not supported over FlashMLA's FP8 records (list the window's keys in indices)");
  if (s.problem.modifiers.has_alibi()) check.fail("options.alibi_slopes: not supported over FlashMLA's FP8 records");
}

// run()'s checks of the step's views (q, records, out, lse) against the plan, and the
// problem they make.
detail::ForwardProblem<float> records_problem(const Checker& check, const BatchPlan::State& s, View3<const float> q_view,
                                              View3<const std::uint8_t> records_view, View3<float> out_view,
                                              TensorView<float, 2> lse) {
  check_plan_for_records(check, s);
  const detail::Extents& e = s.problem.extents;
  const int64_t dc = e.v_dim, dr = e.head_dim - e.v_dim;
  const Described q = describe("q", q_view), records = describe("records", records_view), out = describe("out", out_view);
  for (const Described* view : {&q, &records, &out}) check.expect_well_formed(*view);
  detail::check_step_views(check, s, q, records);
  check.expect_extent(records, 2, "record bytes", mla_record_bytes(dc, dr),
                      "dc + 4*dc/128 + 2*dr: e4m3 latent, float32 scales, bfloat16 k_pe (656 at dc 512, dr 64)");
  std::vector<Described> outputs;
  detail::check_outputs(check, s, out, lse, outputs);
  const std::vector<Described> inputs{q, records};
  check.expect_outputs_apart(outputs, inputs);
  return detail::step_problem(s, q_view, out_view, lse, s.paged() ? s.max_blocks * s.block_size : records_view.shape[1]);
}

}  // namespace

void BatchPlan::run(const BatchRecordArgs& a) const {
  const State& s = *state_;
  const Checker check("qkv::BatchPlan::run");
  const detail::ForwardProblem<float> p = records_problem(check, s, a.q, a.records, a.out, a.lse);
  const int64_t dc = s.problem.extents.v_dim, dr = s.problem.extents.head_dim - dc;
  detail::run_records(check, p, a.indices, a.records, dc, dr, s.paged() ? s.read_table() : nullptr, s.max_blocks,
                      s.backend);
}

// Order, so that a refused call writes nothing: run()'s checks on the caller's q, the new
// rows' and the Rotary's, the writes' overlaps, k_new's values and the key lists; then
// q rotated into scratch and the step's records packed into scratch (qkv::pack_mla_records,
// which can no longer refuse them); then the kernel's workspace allocated, the records
// stored and the step run.
void BatchPlan::run_appending(const BatchRecordAppendArgs& a) const {
  const State& s = *state_;
  const Checker check("qkv::BatchPlan::run");
  (void)records_problem(check, s, a.q, a.records, a.out, a.lse);
  const detail::Extents& e = s.problem.extents;
  const int64_t dc = e.v_dim, dr = e.head_dim - dc, bytes = mla_record_bytes(dc, dr);
  const Described c_kv = describe("k_new", a.k_new), k_pe = describe("k_rope_new", a.k_rope_new);  // c_kv, k_pe
  check.expect_well_formed(c_kv);
  check.expect_well_formed(k_pe);
  check.expect_extent(c_kv, 0, "total_q", s.total_q, "as cu_seqlens_q[-1]");
  check.expect_extent(c_kv, 1, "dc", dc, "as layout.v_dim");
  check.expect_extent(k_pe, 0, "total_q", s.total_q, "as cu_seqlens_q[-1]");
  check.expect_extent(k_pe, 1, "dr", dr, "as layout.head_dim - layout.v_dim");
  const detail::CheckedRotary rotary(check, a.rotary, s.total_q, dr, "dr, the keys' rotary part");
  std::vector<Described> written{describe("records", a.records), describe("out", a.out)};
  if (!a.lse.empty()) written.push_back(describe("lse", a.lse));
  std::vector<Described> read{describe("q", a.q), c_kv, k_pe};
  if (rotary.active()) {
    read.push_back(describe("rotary.cos", a.rotary.cos));
    read.push_back(describe("rotary.sin", a.rotary.sin));
  }
  check.expect_outputs_apart(written, read);
  for (int64_t r = 0; r < s.total_q; ++r)
    for (int64_t c = 0; c < dc; ++c)
      if (!std::isfinite(a.k_new(r, c)))
        check.fail("k_new[" + std::to_string(r) + ", " + std::to_string(c) + "]: expected a finite value (a scale " +
                   "per 128 values cannot hold inf or NaN), got " + std::to_string(a.k_new(r, c)));
  if (!a.indices.empty())  // checked now, since the lists are read after the write
    detail::check_key_lists(check, records_problem(check, s, a.q, a.records, a.out, a.lse), a.indices);

  // Checked: from here on only an allocation can throw, and it comes before any write.
  std::vector<float> rotated_q, rotated_pe;
  std::vector<std::uint8_t> packed;
  detail::allocate_or_throw("qkv::BatchPlan::run", "the new records", static_cast<std::size_t>(s.total_q * bytes), [&] {
    packed.resize(static_cast<std::size_t>(s.total_q * bytes));
    if (rotary.active()) {
      rotated_q.resize(static_cast<std::size_t>(s.total_q * e.q_heads * e.head_dim));
      rotated_pe.resize(static_cast<std::size_t>(s.total_q * dr));
    }
  });
  View3<const float> q = a.q;
  TensorView<const float, 2> k_pe_rows = a.k_rope_new;
  if (rotary.active()) {  // q_pe and k_pe rotated; q_nope copied as it is
    const View3<float> to(rotated_q.data(), {s.total_q, e.q_heads, e.head_dim}, {e.q_heads * e.head_dim, e.head_dim, 1});
    for (int64_t r = 0; r < s.total_q; ++r) {
      for (int64_t h = 0; h < e.q_heads; ++h) {
        for (int64_t c = 0; c < dc; ++c) to(r, h, c) = a.q(r, h, c);
        rotary.rotate(r, &a.q(r, h, dc), &to(r, h, dc));
      }
      rotary.rotate(r, &a.k_rope_new(r, 0), &rotated_pe[static_cast<std::size_t>(r * dr)]);
    }
    q = to;
    k_pe_rows = TensorView<const float, 2>(rotated_pe.data(), {s.total_q, dr}, {dr, 1});
  }
  pack_mla_records(a.k_new, k_pe_rows, TensorView<std::uint8_t, 2>(packed.data(), {s.total_q, bytes}, {bytes, 1}),
                   a.scales);

  // Each sequence's new records into its last n_b slots: (pool block, row) through the
  // plan's table, or (sequence, key) — stored by the kernel once its workspace is allocated.
  const auto store = [&] {
    const detail::Sequences& seq = s.problem.mask.sequences;
    for (int64_t b = 0; b < e.batch; ++b) {
      const int64_t first = seq.cu_q[b], count = seq.cu_q[b + 1] - first,
                    length = s.cache_lengths[static_cast<std::size_t>(b)];
      for (int64_t t = 0; t < count; ++t) {
        const int64_t key = length - count + t;
        const int64_t outer =
            s.paged() ? s.block_table[static_cast<std::size_t>(b * s.max_blocks + key / s.block_size)] : b;
        const int64_t inner = s.paged() ? key % s.block_size : key;
        std::memcpy(&a.records(outer, inner, 0), &packed[static_cast<std::size_t>((first + t) * bytes)],
                    static_cast<std::size_t>(bytes));
      }
    }
  };
  const detail::ForwardProblem<float> p = records_problem(check, s, q, a.records, a.out, a.lse);
  detail::run_records(check, p, a.indices, a.records, dc, dr, s.paged() ? s.read_table() : nullptr, s.max_blocks,
                      s.backend, store);
}

}  // namespace qkv
