// qkv._qkv.apply_rotary and qkv._qkv.batch_plan_run_appending: rotary embedding and the
// appending run of qkv::BatchPlan (qkv/rotary.hpp, qkv/batch_plan.hpp) for Python
// (qkv/_rotary.py). Tables are float32 [rows, rotary_dim] (the Python layer widens bf16
// and fp16 tables, exactly); positions int32 or int64; caches read and written in place
// with BatchPlan.run's conventions (decode.hpp: 16-bit storage as int16 bits with bits_as).
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>

#include "arrays.hpp"
#include "decode.hpp"
#include "qkv/batch_plan.hpp"
#include "qkv/error.hpp"
#include "qkv/rotary.hpp"

namespace qkv::python {
namespace {

namespace nb = nanobind;

// The Rotary of a call: its tables and positions are views of the caller's arrays, which
// the caller keeps alive for the call.
Rotary rotary_of(nb::handle cos, nb::handle sin, nb::handle positions, bool interleaved, nb::handle rotary_dim) {
  Rotary rotary;
  rotary.interleaved = interleaved;
  rotary.rotary_dim = rotary_dim.is_none() ? 0 : int64_argument("rotary_dim", rotary_dim);
  if (const std::optional<ArrayRef> c = optional_in("rotary_cos", cos))
    rotary.cos = view_of<const float, 2>("rotary_cos", *c, "rotary tables are float32");
  if (const std::optional<ArrayRef> s = optional_in("rotary_sin", sin))
    rotary.sin = view_of<const float, 2>("rotary_sin", *s, "rotary tables are float32");
  if (const std::optional<ArrayRef> p = optional_in("positions", positions)) {
    const char* name = "positions";
    if (p->dtype() == nb::dtype<int32_t>()) {
      const auto view = view_of<const int32_t, 1>(name, *p, "int32 or int64");
      if (view.shape[0] > 1 && view.strides[0] != 1) throw Error(Caller::named(name) + ": expected a contiguous array");
      rotary.positions = std::span<const int32_t>(view.data, static_cast<std::size_t>(view.shape[0]));
    } else {
      const auto view = view_of<const int64_t, 1>(name, *p, "int32 or int64");
      if (view.shape[0] > 1 && view.strides[0] != 1) throw Error(Caller::named(name) + ": expected a contiguous array");
      rotary.positions = std::span<const int64_t>(view.data, static_cast<std::size_t>(view.shape[0]));
    }
  }
  return rotary;
}

struct Arrays {
  ArrayRef q, k_cache, v_cache, out;
  std::optional<ArrayRef> k_new, v_new, lse, k_scale, v_scale;  // k_new, v_new: the library names a missing one
  std::optional<ArrayRef> k_rope_new, k_rope_cache;              // keys in two parts (MLA's latent pools)
};

template <class T>
void run_typed(const BatchPlan& plan, const Arrays& a, const Rotary& rotary, const KeyIndices& indices) {
  BatchAppendArgs<T> args;
  args.q = view_of<const float, 3>("q", a.q, "queries are float32");
  if (a.k_new) args.k_new = view_of<const float, 3>("k_new", *a.k_new, "new keys are float32");
  if (a.v_new) args.v_new = view_of<const float, 3>("v_new", *a.v_new, "new values are float32");
  args.rotary = rotary;
  args.k_cache = raw_view<T, 4>("k_cache", a.k_cache);
  args.v_cache = raw_view<T, 4>("v_cache", a.v_cache);
  args.out = view_of<float, 3>("out", a.out, "the output is float32");
  if (a.lse) args.lse = view_of<float, 2>("lse", *a.lse, "the log-sum-exp is float32");
  if (a.k_scale) args.k_scale = view_of<float, 3>("k_scale", *a.k_scale, "scales are float32");
  if (a.v_scale) args.v_scale = view_of<float, 3>("v_scale", *a.v_scale, "scales are float32");
  args.indices = indices;
  if (a.k_rope_new) args.k_rope_new = view_of<const float, 3>("k_rope_new", *a.k_rope_new, "new keys are float32");
  if (a.k_rope_cache) args.k_rope_cache = raw_view<T, 4>("k_rope_cache", *a.k_rope_cache);
  nb::gil_scoped_release release;
  plan.run_appending(args);
}

void run_appending(const BatchPlan& plan, nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle out,
                   nb::handle k_new, nb::handle v_new, nb::handle lse, const std::string& bits_as, nb::handle k_scale,
                   nb::handle v_scale, nb::handle indices, nb::handle cos, nb::handle sin, nb::handle positions,
                   bool interleaved, nb::handle rotary_dim, nb::handle k_rope_new, nb::handle k_rope_cache) {
  const Caller caller("qkv.BatchPlan.run");
  const std::optional<ArrayRef> index_array = optional_in("indices", indices);
  const KeyIndices lists = index_array ? packed_indices_of(*index_array) : KeyIndices{};
  // The caches (and int8 scales) are written: writable arrays (a read-only NumPy array is refused).
  Arrays a{.q = ArrayRef::from(q, false, "q"), .k_cache = ArrayRef::from(k_cache, true, "k_cache"),
           .v_cache = ArrayRef::from(v_cache, true, "v_cache"), .out = ArrayRef::from(out, true, "out"),
           .k_new = optional_in("k_new", k_new), .v_new = optional_in("v_new", v_new), .lse = std::nullopt,
           .k_scale = std::nullopt, .v_scale = std::nullopt};
  if (!lse.is_none()) a.lse = ArrayRef::from(lse, true, "lse");
  if (!k_scale.is_none()) a.k_scale = ArrayRef::from(k_scale, true, "k_scale");
  if (!v_scale.is_none()) a.v_scale = ArrayRef::from(v_scale, true, "v_scale");
  a.k_rope_new = optional_in("k_rope_new", k_rope_new);
  if (!k_rope_cache.is_none()) {
    a.k_rope_cache = ArrayRef::from(k_rope_cache, true, "k_rope_cache");
    if (cache_storage("k_rope_cache", *a.k_rope_cache, bits_as) != cache_storage("k_cache", a.k_cache, bits_as))
      argument_type_error("k_rope_cache", "expected the dtype of k_cache");
  }
  const Rotary rotary = rotary_of(cos, sin, positions, interleaved, rotary_dim);
  const StorageType type = cache_storage("k_cache", a.k_cache, bits_as);
  if (cache_storage("v_cache", a.v_cache, bits_as) != type) argument_type_error("v_cache", "expected the dtype of k_cache");
  switch (type) {
    case StorageType::float32: return run_typed<float>(plan, a, rotary, lists);
    case StorageType::bfloat16: return run_typed<bfloat16>(plan, a, rotary, lists);
    case StorageType::float16: return run_typed<float16>(plan, a, rotary, lists);
    case StorageType::int8: return run_typed<std::int8_t>(plan, a, rotary, lists);
    case StorageType::float8_e4m3fn: return run_typed<float8_e4m3fn>(plan, a, rotary, lists);
    case StorageType::float8_e5m2: return run_typed<float8_e5m2>(plan, a, rotary, lists);
    case StorageType::int4: break;  // no array dtype is int4 (cache_storage)
  }
  throw Error("qkv::BatchPlan::run: int4 caches append through qkv.KVCache");
}

// BatchPlan::run_appending over FlashMLA's FP8 records: k_new [total_q, dc], k_rope_new
// [total_q, dr] float32; records uint8, written in place.
void run_records_appending(const BatchPlan& plan, nb::handle q, nb::handle records, nb::handle out,
                           nb::handle k_new, nb::handle k_rope_new, nb::handle lse, nb::handle indices,
                           nb::handle cos, nb::handle sin, nb::handle positions, bool interleaved,
                           nb::handle rotary_dim, bool power_of_two_scales) {
  const Caller caller("qkv.BatchPlan.run");
  const std::optional<ArrayRef> index_array = optional_in("indices", indices);
  BatchRecordAppendArgs args;
  args.q = view_of<const float, 3>("q", ArrayRef::from(q, false, "q"), "queries are float32");
  args.k_new = view_of<const float, 2>("k_new", ArrayRef::from(k_new, false, "k_new"), "new latent rows are float32");
  args.k_rope_new = view_of<const float, 2>("k_rope_new", ArrayRef::from(k_rope_new, false, "k_rope_new"),
                                          "new rotary keys are float32");
  args.rotary = rotary_of(cos, sin, positions, interleaved, rotary_dim);
  args.records = view_of<std::uint8_t, 3>("k_cache", ArrayRef::from(records, true, "k_cache"), "records are uint8");
  args.out = view_of<float, 3>("out", ArrayRef::from(out, true, "out"), "the output is float32");
  if (!lse.is_none()) args.lse = view_of<float, 2>("lse", ArrayRef::from(lse, true, "lse"), "the log-sum-exp is float32");
  if (index_array) args.indices = packed_indices_of(*index_array);
  args.scales = power_of_two_scales ? RecordScales::power_of_two : RecordScales::amax;
  nb::gil_scoped_release release;
  plan.run_appending(args);
}

}  // namespace

void bind_rotary(nb::module_& m) {
  m.def(
      "apply_rotary",
      [](nb::handle x, nb::handle out, nb::handle cos, nb::handle sin, nb::handle positions, bool interleaved,
         nb::handle rotary_dim, const std::string& function) {
        const Caller caller(function.c_str());
        const auto xv = view_of<const float, 3>("x", ArrayRef::from(x, false, "x"), "rotated rows are float32");
        const auto ov = view_of<float, 3>("out", ArrayRef::from(out, true, "out"), "rotated rows are float32");
        const Rotary rotary = rotary_of(cos, sin, positions, interleaved, rotary_dim);
        nb::gil_scoped_release release;
        apply_rotary(xv, ov, rotary);
      },
      nb::arg("x"), nb::arg("out"), nb::arg("rotary_cos"), nb::arg("rotary_sin"), nb::arg("positions").none(),
      nb::arg("rotary_interleaved"), nb::arg("rotary_dim").none(), nb::arg("function"),
      "out [n, H, d] = x [n, H, d] rotated by the tables (qkv/rotary.hpp); the GIL is released.");
  m.def("batch_plan_run_appending", &run_appending, nb::arg("plan"), nb::arg("q"), nb::arg("k_cache"),
        nb::arg("v_cache"), nb::arg("out"), nb::arg("k_new").none(), nb::arg("v_new").none(), nb::kw_only(),
        nb::arg("lse").none() = nb::none(), nb::arg("bits_as") = "", nb::arg("k_scale").none() = nb::none(),
        nb::arg("v_scale").none() = nb::none(), nb::arg("indices").none() = nb::none(),
        nb::arg("rotary_cos").none() = nb::none(), nb::arg("rotary_sin").none() = nb::none(),
        nb::arg("positions").none() = nb::none(), nb::arg("rotary_interleaved") = false,
        nb::arg("rotary_dim").none() = nb::none(), nb::arg("k_rope_new").none() = nb::none(),
        nb::arg("k_rope_cache").none() = nb::none(),
        "BatchPlan::run_appending: the new tokens rotated and written into the caches (in place), then the "
        "step; the GIL is released.");
  m.def("batch_plan_run_records_appending", &run_records_appending, nb::arg("plan"), nb::arg("q"), nb::arg("records"),
        nb::arg("out"), nb::arg("k_new"), nb::arg("k_rope_new"), nb::kw_only(), nb::arg("lse").none() = nb::none(),
        nb::arg("indices").none() = nb::none(), nb::arg("rotary_cos").none() = nb::none(),
        nb::arg("rotary_sin").none() = nb::none(), nb::arg("positions").none() = nb::none(),
        nb::arg("rotary_interleaved") = false, nb::arg("rotary_dim").none() = nb::none(),
        nb::arg("power_of_two_scales") = true,
        "BatchPlan::run_appending over FlashMLA's FP8 records: the new tokens rotated and packed into the records "
        "(in place), then the step; the GIL is released.");
}

}  // namespace qkv::python
