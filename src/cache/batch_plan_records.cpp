// qkv::BatchPlan::run over FlashMLA's FP8 records (qkv/batch_plan.hpp, "FlashMLA's FP8
// records"): the run's views checked against the plan, then the planned step's rows —
// every sequence with its own query count — on mla_decode's records kernel, which runs
// each query row over its own keys (cpu/mla_records.cpp), or the reference over the
// stored values.
#include <string>
#include <vector>

#include "cache/batch_plan_state.hpp"
#include "cache/decode_source.hpp"
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

}  // namespace

void BatchPlan::run(const BatchRecordArgs& a) const {
  const State& s = *state_;
  const Checker check("qkv::BatchPlan::run");
  check_plan_for_records(check, s);
  const detail::Extents& e = s.problem.extents;
  const int64_t dc = e.v_dim, dr = e.head_dim - e.v_dim;
  const Described q = describe("q", a.q), records = describe("records", a.records), out = describe("out", a.out);
  for (const Described* view : {&q, &records, &out}) check.expect_well_formed(*view);
  detail::check_step_views(check, s, q, records);
  check.expect_extent(records, 2, "record bytes", mla_record_bytes(dc, dr),
                      "dc + 4*dc/128 + 2*dr: e4m3 latent, float32 scales, bfloat16 k_pe (656 at dc 512, dr 64)");
  std::vector<Described> outputs;
  detail::check_outputs(check, s, out, a.lse, outputs);
  const std::vector<Described> inputs{q, records};
  check.expect_outputs_apart(outputs, inputs);

  const detail::ForwardProblem<float> p =
      detail::step_problem(s, a.q, a.out, a.lse, s.paged() ? s.max_blocks * s.block_size : a.records.shape[1]);
  detail::run_records(check, p, a.indices, a.records, dc, dr, s.paged() ? s.read_table() : nullptr, s.max_blocks,
                      s.backend);
}

}  // namespace qkv
