// qkv.dist's compiled half: the C++ schedule (sharding, block calls per ring step) and
// merge, so that Python and C++ rings make the same calls in the same order.
#include "dist.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <vector>

#include "arrays.hpp"
#include "qkv/dist/ring_plan.hpp"
#include "qkv/error.hpp"
#include "qkv/merge.hpp"

namespace qkv::python {
namespace {

dist::Sharding sharding_of(const std::string& name) {
  if (name == "zigzag") return dist::Sharding::zigzag;
  if (name == "contiguous") return dist::Sharding::contiguous;
  throw Error("qkv.dist: sharding: expected 'zigzag' or 'contiguous', got '" + name + "'");
}

Causal causal_of(const std::string& name) {
  if (name == "none") return Causal::none;
  if (name == "top_left") return Causal::top_left;
  if (name == "bottom_right") return Causal::bottom_right;
  throw Error("qkv.dist: causal: expected 'none', 'top_left' or 'bottom_right', got '" + name + "'");
}

// A [B, H, N, D] array (PyTorch's order) as qkv's logical [B, N, H, D] view.
template <class T, class Array>
View4<T> logical_from_bhsd(const char* name, const Array& array) {
  auto view = view_of<T, 4>(name, array, "float32 (the ring computes in float32)");
  std::swap(view.shape[1], view.shape[2]);
  std::swap(view.strides[1], view.strides[2]);
  return view;
}

}  // namespace

void bind_dist(nanobind::module_& m) {
  namespace nb = nanobind;
  using SegmentTuple = std::tuple<int64_t, int64_t, int64_t>;
  using CallTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool>;
  m.def(
      "ring_shard_segments",
      [](int64_t length, int world, int rank, const std::string& sharding) {
        std::vector<SegmentTuple> out;
        for (const auto& s : dist::shard_segments(length, world, rank, sharding_of(sharding)))
          out.emplace_back(s.global_begin, s.length, s.local_begin);
        return out;
      },
      nb::arg("length"), nb::arg("world"), nb::arg("rank"), nb::arg("sharding"),
      "qkv::dist::shard_segments: [(global_begin, length, local_begin)] of a rank's shard.");
  m.def(
      "ring_block_calls",
      [](int world, const std::string& sharding, int64_t batch, int64_t q_len, int64_t k_len,
         const std::string& causal, const std::vector<int64_t>& key_lengths, int rank, int kv_owner) {
        const dist::RingProblem problem{.world = world, .sharding = sharding_of(sharding), .batch = batch,
                                        .q_len = q_len, .k_len = k_len, .causal = causal_of(causal),
                                        .key_lengths = key_lengths};
        std::vector<CallTuple> out;
        for (const auto& c : dist::ring_block_calls(problem, rank, kv_owner)) {
          out.emplace_back(c.batch_begin, c.batch_end, c.q_begin, c.q_end, c.k_begin, c.k_end,
                           c.causal == Causal::bottom_right);
        }
        return out;
      },
      nb::arg("world"), nb::arg("sharding"), nb::arg("batch"), nb::arg("q_len"), nb::arg("k_len"),
      nb::arg("causal"), nb::arg("key_lengths"), nb::arg("rank"), nb::arg("kv_owner"),
      "qkv::dist::ring_block_calls: [(b0, b1, q0, q1, k0, k1, bottom_right)] for one ring step.");
  m.def(
      "merge_partials",
      [](const OutArray& out, const OutArray& lse, const InArray& part_out, const InArray& part_lse) {
        const auto out_view = logical_from_bhsd<float>("out", out);
        const auto lse_view = view_of<float, 3>("lse", lse, "float32");
        const auto part_view = logical_from_bhsd<const float>("part_out", part_out);
        const auto part_lse_view = view_of<const float, 3>("part_lse", part_lse, "float32");
        nb::gil_scoped_release release;
        merge_partials(out_view, lse_view, part_view, part_lse_view);
      },
      nb::arg("out"), nb::arg("lse"), nb::arg("part_out"), nb::arg("part_lse"),
      "qkv::merge_partials in place on out [B, H, N, dv] and lse [B, H, N].");
}

}  // namespace qkv::python
