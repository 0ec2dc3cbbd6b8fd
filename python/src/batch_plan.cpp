// qkv._qkv.BatchPlan: qkv::BatchPlan for Python (qkv/batch_plan.hpp). The layout's arrays
// are read once (the plan copies them); caches are read in place with decode's
// conventions (decode.hpp: float32, float16, bfloat16 bits as int16 with `bits_as`, int8,
// float8 bytes as uint8 with `bits_as`; cache_scales.hpp: the scales).
// Draft trees: tree_mask (bool or uint8, flattened) and tree_mask_offsets (int32/int64).
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "arrays.hpp"
#include "cache_scales.hpp"
#include "debug.hpp"
#include "decode.hpp"
#include "options.hpp"
#include "qkv/batch_plan.hpp"
#include "qkv/error.hpp"
#include "qkv/kv_cache.hpp"

namespace qkv::python {
namespace {

namespace nb = nanobind;

// A 1-D int32 or int64 array in place (the plan copies it before returning).
SeqOffsets offsets_of(const char* name, const ArrayRef& array) {
  if (array.dtype() == nb::dtype<int32_t>()) {
    const auto view = view_of<const int32_t, 1>(name, array, "int32 or int64");
    if (view.shape[0] > 1 && view.strides[0] != 1) throw Error(Caller::named(name) + ": expected a contiguous array");
    return std::span<const int32_t>(view.data, static_cast<std::size_t>(view.shape[0]));
  }
  if (array.dtype() != nb::dtype<int64_t>()) {
    expect_cpu(name, array.device_type());
    argument_type_error(name, "expected dtype int32 or int64, got " + dtype_name(array.dtype()));
  }
  const auto view = view_of<const int64_t, 1>(name, array, "int32 or int64");
  if (view.shape[0] > 1 && view.strides[0] != 1) throw Error(Caller::named(name) + ": expected a contiguous array");
  return std::span<const int64_t>(view.data, static_cast<std::size_t>(view.shape[0]));
}

// The flattened tree masks (bool or uint8, 1-D, contiguous: qkv/_batch_plan.py flattens
// them), in place (the plan copies them).
std::span<const std::uint8_t> tree_mask_of(const ArrayRef& array) {
  const char* name = "tree_mask";
  const auto view = array.dtype() == nb::dtype<bool>()
                        ? raw_view<const std::uint8_t, 1>(name, array)
                        : view_of<const std::uint8_t, 1>(name, array, "a tree mask is bool or uint8");
  if (view.shape[0] > 1 && view.strides[0] != 1) throw Error(Caller::named(name) + ": expected a contiguous array");
  return {view.data, static_cast<std::size_t>(view.shape[0])};
}

template <class T>
void run_typed(const BatchPlan& plan, const ArrayRef& q, const ArrayRef& k_cache, const ArrayRef& v_cache,
               const ArrayRef& out, const std::optional<ArrayRef>& lse, const std::optional<ArrayRef>& k_scale,
               const std::optional<ArrayRef>& v_scale, const KeyIndices& indices,
               const std::optional<ArrayRef>& k_rope_cache) {
  BatchArgs<T> args;
  args.indices = indices;
  args.q = view_of<const float, 3>("q", q, "queries are float32");
  args.k_cache = raw_view<const T, 4>("k_cache", k_cache);
  args.v_cache = raw_view<const T, 4>("v_cache", v_cache);
  if (k_rope_cache) args.k_rope_cache = raw_view<const T, 4>("k_rope_cache", *k_rope_cache);
  args.out = view_of<float, 3>("out", out, "the output is float32");
  if (lse) args.lse = view_of<float, 2>("lse", *lse, "the log-sum-exp is float32");
  constexpr StorageType storage = storage_type_of<T>;
  const auto& kc = args.k_cache.shape;
  const auto& vc = args.v_cache.shape;
  args.k_scale = cache_scale_view("k_scale", k_scale, storage, {kc[0], kc[1], kc[2]});
  args.v_scale = cache_scale_view("v_scale", v_scale, storage, {vc[0], vc[1], vc[2]});
  if (debug_recording.load(std::memory_order_relaxed)) {  // tests: what the library reads, in place or not
    debug_begin_call();
    debug_record("k_cache", args.k_cache);
    debug_record("v_cache", args.v_cache);
    debug_record("k_scale", args.k_scale);
    debug_record("v_scale", args.v_scale);
    if (k_rope_cache) debug_record("k_rope_cache", args.k_rope_cache);
  }
  nb::gil_scoped_release release;
  plan.run(args);
}

void run_any(const BatchPlan& plan, nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle out,
             nb::handle lse, const std::string& bits_as, nb::handle k_scale, nb::handle v_scale,
             nb::handle indices, nb::handle k_rope_cache) {
  const Caller caller("qkv.BatchPlan.run");
  const std::optional<ArrayRef> index_array = optional_in("indices", indices);
  const KeyIndices lists = index_array ? packed_indices_of(*index_array) : KeyIndices{};
  const ArrayRef qa = ArrayRef::from(q, false, "q"), ka = ArrayRef::from(k_cache, false, "k_cache"),
                 va = ArrayRef::from(v_cache, false, "v_cache"), oa = ArrayRef::from(out, true, "out");
  const std::optional<ArrayRef> la = lse.is_none() ? std::nullopt : std::optional(ArrayRef::from(lse, true, "lse"));
  const std::optional<ArrayRef> ks = optional_in("k_scale", k_scale), vs = optional_in("v_scale", v_scale);
  const StorageType type = cache_storage("k_cache", ka, bits_as);
  if (cache_storage("v_cache", va, bits_as) != type) argument_type_error("v_cache", "expected the dtype of k_cache");
  const std::optional<ArrayRef> ra = optional_in("k_rope_cache", k_rope_cache);
  if (ra && cache_storage("k_rope_cache", *ra, bits_as) != type)
    argument_type_error("k_rope_cache", "expected the dtype of k_cache");
  switch (type) {
    case StorageType::float32: return run_typed<float>(plan, qa, ka, va, oa, la, ks, vs, lists, ra);
    case StorageType::bfloat16: return run_typed<bfloat16>(plan, qa, ka, va, oa, la, ks, vs, lists, ra);
    case StorageType::float16: return run_typed<float16>(plan, qa, ka, va, oa, la, ks, vs, lists, ra);
    case StorageType::int8: return run_typed<std::int8_t>(plan, qa, ka, va, oa, la, ks, vs, lists, ra);
    case StorageType::float8_e4m3fn: return run_typed<float8_e4m3fn>(plan, qa, ka, va, oa, la, ks, vs, lists, ra);
    case StorageType::float8_e5m2: return run_typed<float8_e5m2>(plan, qa, ka, va, oa, la, ks, vs, lists, ra);
    case StorageType::int4: break;  // no array dtype is int4 (cache_storage)
  }
  throw Error("qkv::BatchPlan::run: int4 caches attend through qkv.KVCache.attend");
}

// FlashMLA's FP8 records (qkv/batch_plan.hpp's BatchRecordArgs): one uint8 array.
void run_records(const BatchPlan& plan, nb::handle q, nb::handle records, nb::handle out, nb::handle lse,
                 nb::handle indices) {
  const Caller caller("qkv.BatchPlan.run");
  const std::optional<ArrayRef> index_array = optional_in("indices", indices);
  BatchRecordArgs args;
  args.indices = index_array ? packed_indices_of(*index_array) : KeyIndices{};
  args.q = view_of<const float, 3>("q", ArrayRef::from(q, false, "q"), "queries are float32");
  args.records = view_of<const std::uint8_t, 3>("records", ArrayRef::from(records, false, "records"),
                                                "FlashMLA's FP8 records are bytes (uint8)");
  args.out = view_of<float, 3>("out", ArrayRef::from(out, true, "out"), "the output is float32");
  if (!lse.is_none()) args.lse = view_of<float, 2>("lse", ArrayRef::from(lse, true, "lse"), "the log-sum-exp is float32");
  nb::gil_scoped_release release;
  plan.run(args);
}

}  // namespace

void bind_batch_plan(nb::module_& m) {
  nb::class_<BatchPlan>(m, "BatchPlan")
      .def(
          "__init__",
          [](BatchPlan* self, nb::handle cu_seqlens_q, nb::handle cache_lengths, nb::handle num_heads,
             nb::handle num_kv_heads, nb::handle head_dim, nb::handle v_dim, nb::handle block_table,
             nb::handle block_size, nb::handle tree_mask, nb::handle tree_mask_offsets, bool share_prefixes,
             const std::string& storage, const BoundOptions& bound) {
            const Caller caller(bound.function.c_str());
            BatchLayout layout;
            const ArrayRef cu = ArrayRef::from(cu_seqlens_q, false, "cu_seqlens_q");
            const ArrayRef lengths = ArrayRef::from(cache_lengths, false, "cache_lengths");
            layout.cu_seqlens_q = offsets_of("cu_seqlens_q", cu);
            layout.cache_lengths = offsets_of("cache_lengths", lengths);
            std::vector<int32_t> table_storage;
            const std::optional<ArrayRef> table = optional_in("block_table", block_table);
            if (table) layout.block_table = block_table_view(*table, table_storage, "qkv::BatchPlan");
            layout.block_size = int64_argument("block_size", block_size);
            layout.num_heads = int64_argument("num_heads", num_heads);
            layout.num_kv_heads = int64_argument("num_kv_heads", num_kv_heads);
            layout.head_dim = int64_argument("head_dim", head_dim);
            layout.v_dim = int64_argument("v_dim", v_dim);
            layout.storage = parse_storage(storage);
            const std::optional<ArrayRef> trees = optional_in("tree_mask", tree_mask);
            if (trees) layout.tree_mask = tree_mask_of(*trees);
            const std::optional<ArrayRef> tree_offsets = optional_in("tree_mask_offsets", tree_mask_offsets);
            if (tree_offsets) layout.tree_mask_offsets = offsets_of("tree_mask_offsets", *tree_offsets);
            layout.share_prefixes = share_prefixes;
            new (self) BatchPlan(layout, bound.for_call());
          },
          nb::arg("cu_seqlens_q"), nb::arg("cache_lengths"), nb::kw_only(), nb::arg("num_heads"),
          nb::arg("num_kv_heads"), nb::arg("head_dim"), nb::arg("v_dim") = 0,
          nb::arg("block_table").none() = nb::none(), nb::arg("block_size") = 0,
          nb::arg("tree_mask").none() = nb::none(), nb::arg("tree_mask_offsets").none() = nb::none(),
          nb::arg("share_prefixes") = false, nb::arg("storage") = "float32",
          nb::arg("options"))
      .def("run", &run_any, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"), nb::kw_only(),
           nb::arg("lse").none() = nb::none(), nb::arg("bits_as") = "", nb::arg("k_scale").none() = nb::none(),
           nb::arg("v_scale").none() = nb::none(), nb::arg("indices").none() = nb::none(),
           nb::arg("k_rope_cache").none() = nb::none(),
           "One layer of the planned step: q [total_q, Hq, d] float32, caches read in place, writes out "
           "[total_q, Hq, dv] (and lse [Hq, total_q]); the GIL is released.")
      .def("run_records", &run_records, nb::arg("q"), nb::arg("records"), nb::arg("out"), nb::kw_only(),
           nb::arg("lse").none() = nb::none(), nb::arg("indices").none() = nb::none(),
           "One layer of the planned step over FlashMLA's FP8 records (uint8 [B | blocks, capacity | block_size, "
           "record]); the GIL is released.")
      .def(
          "run_cache",
          [](const BatchPlan& self, nb::handle q, const CacheObject& cache, nb::handle out, nb::handle lse,
             nb::handle indices) {
            const Caller caller("qkv.BatchPlan.run");
            const std::optional<ArrayRef> index_array = optional_in("indices", indices);
            const KeyIndices lists = index_array ? packed_indices_of(*index_array) : KeyIndices{};
            const auto qv = view_of<const float, 3>("q", ArrayRef::from(q, false, "q"), "queries are float32");
            const auto ov = view_of<float, 3>("out", ArrayRef::from(out, true, "out"), "the output is float32");
            TensorView<float, 2> lv;
            if (!lse.is_none()) lv = view_of<float, 2>("lse", ArrayRef::from(lse, true, "lse"), "the log-sum-exp is float32");
            nb::gil_scoped_release release;
            self.run(qv, *cache.cache, ov, lv, lists);
          },
          nb::arg("q"), nb::arg("cache"), nb::arg("out"), nb::kw_only(), nb::arg("lse").none() = nb::none(),
          nb::arg("indices").none() = nb::none(),
          "One layer of the planned step over a qkv.KVCache (any storage, int4 and float windows included); "
          "the GIL is released.")
      .def_prop_ro("sequences", &BatchPlan::sequences)
      .def_prop_ro("total_queries", &BatchPlan::total_queries)
      .def_prop_ro("tasks", &BatchPlan::tasks)
      .def("task_costs", &BatchPlan::task_costs)
      .def(
          "prefix_groups",
          [](const BatchPlan& self) {
            nb::list groups;
            for (const PrefixGroup& group : self.prefix_groups())
              groups.append(nb::make_tuple(nb::cast(group.sequences), group.keys));
            return groups;
          },
          "The groups whose sequences share a prefix: [(sequences, shared keys), ...].");
}

}  // namespace qkv::python
