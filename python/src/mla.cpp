// qkv._qkv.mla_decode: absorbed latent attention (qkv/mla.hpp) over c_kv / k_pe caches read
// in place, with decode.cpp's conventions for cache arrays, block tables and key lists.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "decode.hpp"
#include "options.hpp"
#include "qkv/error.hpp"
#include "qkv/mla.hpp"

namespace qkv::python {

namespace nb = nanobind;

namespace {

template <class T>
void mla_typed(const ArrayRef& q_nope, const ArrayRef& q_pe, const ArrayRef& ckv, const ArrayRef& kpe,
               std::span<const int64_t> lengths, const std::optional<ArrayRef>& block_table, const ArrayRef& out,
               const std::optional<ArrayRef>& lse, const KeyIndices& indices, const AttentionOptions& options,
               std::optional<float> ckv_scale, std::optional<float> kpe_scale) {
  MlaDecodeArgs<T> args;
  args.ckv_scale = ckv_scale;  // checked (float8 only, positive, finite) by the library
  args.kpe_scale = kpe_scale;
  args.q_nope = view_of<const float, 4>("q_nope", q_nope, "queries are float32");
  args.q_pe = view_of<const float, 4>("q_pe", q_pe, "queries are float32");
  args.ckv_cache = raw_view<const T, 3>("ckv_cache", ckv);
  args.kpe_cache = raw_view<const T, 3>("kpe_cache", kpe);
  args.cache_lengths = lengths;
  std::vector<int32_t> table_storage;
  if (block_table) args.block_table = block_table_view(*block_table, table_storage, "qkv::mla_decode");
  args.out = view_of<float, 4>("out", out, "the output is float32");
  if (lse) args.lse = view_of<float, 3>("lse", *lse, "the log-sum-exp is float32");
  args.indices = indices;
  nb::gil_scoped_release release;
  mla_decode(args, options);
}

// A per-tensor scale as the Python layer hands it over (qkv/_float8.py's scale_vector: a
// 1-D float32 array): exactly one value, which the library then checks.
std::optional<float> tensor_scale(const char* name, nb::handle scale) {
  const std::optional<ArrayRef> array = optional_in(name, scale);
  if (!array) return std::nullopt;
  const auto vector = view_of<const float, 1>(name, *array, "scales are float32");
  if (vector.shape[0] != 1)
    throw Error(Caller::named(name) + ": expected one scale (per tensor) for a float8 latent cache, got " +
                std::to_string(vector.shape[0]));
  return vector.data[0];
}

void mla_any(nb::handle q_nope, nb::handle q_pe, nb::handle ckv_cache, nb::handle kpe_cache, nb::handle cache_lengths,
             nb::handle out, nb::handle lse, nb::handle block_table, const std::string& bits_as, nb::handle indices,
             nb::handle ckv_scale, nb::handle kpe_scale, const BoundOptions& bound) {
  const Caller caller(bound.function.c_str());
  const std::optional<float> ckv_s = tensor_scale("ckv_scale", ckv_scale), kpe_s = tensor_scale("kpe_scale", kpe_scale);
  const std::optional<ArrayRef> index_array = optional_in("indices", indices);
  const KeyIndices lists = index_array ? indices_of(*index_array) : KeyIndices{};
  const ArrayRef qn = ArrayRef::from(q_nope, false, "q_nope"), qp = ArrayRef::from(q_pe, false, "q_pe"),
                 ca = ArrayRef::from(ckv_cache, false, "ckv_cache"), pa = ArrayRef::from(kpe_cache, false, "kpe_cache"),
                 oa = ArrayRef::from(out, true, "out"), la = ArrayRef::from(cache_lengths, false, "cache_lengths");
  const std::optional<ArrayRef> lse_a = lse.is_none() ? std::nullopt : std::optional(ArrayRef::from(lse, true, "lse"));
  const std::optional<ArrayRef> table = optional_in("block_table", block_table);
  const StorageType type = cache_storage("ckv_cache", ca, bits_as);
  if (cache_storage("kpe_cache", pa, bits_as) != type) argument_type_error("kpe_cache", "expected the dtype of ckv_cache");
  const AttentionOptions options = bound.for_call();
  const auto lengths = view_of<const int64_t, 1>("cache_lengths", la, "sequence lengths are int64");
  if (lengths.shape[0] > 1 && lengths.strides[0] != 1)
    throw Error("qkv::mla_decode: cache_lengths: expected a contiguous array");
  const std::span<const int64_t> length_span(lengths.data, static_cast<std::size_t>(lengths.shape[0]));
  switch (type) {
    case StorageType::float32:
      return mla_typed<float>(qn, qp, ca, pa, length_span, table, oa, lse_a, lists, options, ckv_s, kpe_s);
    case StorageType::bfloat16:
      return mla_typed<bfloat16>(qn, qp, ca, pa, length_span, table, oa, lse_a, lists, options, ckv_s, kpe_s);
    case StorageType::float16:
      return mla_typed<float16>(qn, qp, ca, pa, length_span, table, oa, lse_a, lists, options, ckv_s, kpe_s);
    case StorageType::float8_e4m3fn:
      return mla_typed<float8_e4m3fn>(qn, qp, ca, pa, length_span, table, oa, lse_a, lists, options, ckv_s, kpe_s);
    case StorageType::float8_e5m2:
      return mla_typed<float8_e5m2>(qn, qp, ca, pa, length_span, table, oa, lse_a, lists, options, ckv_s, kpe_s);
    default: break;
  }
  argument_type_error("ckv_cache", std::string("expected dtype float32, bfloat16, float16, float8_e4m3fn or "
                                               "float8_e5m2, got ") + storage_name(type));
}

// FlashMLA's FP8 records (qkv/mla.hpp's MlaRecordArgs): one uint8 array of records.
void mla_records(nb::handle q_nope, nb::handle q_pe, nb::handle ckv_cache, nb::handle cache_lengths, nb::handle out,
                 nb::handle lse, nb::handle block_table, nb::handle indices, const BoundOptions& bound) {
  const Caller caller(bound.function.c_str());
  const std::optional<ArrayRef> index_array = optional_in("indices", indices);
  const ArrayRef qn = ArrayRef::from(q_nope, false, "q_nope"), qp = ArrayRef::from(q_pe, false, "q_pe"),
                 ca = ArrayRef::from(ckv_cache, false, "ckv_cache"), oa = ArrayRef::from(out, true, "out"),
                 la = ArrayRef::from(cache_lengths, false, "cache_lengths");
  const std::optional<ArrayRef> lse_a = lse.is_none() ? std::nullopt : std::optional(ArrayRef::from(lse, true, "lse"));
  const std::optional<ArrayRef> table = optional_in("block_table", block_table);
  MlaRecordArgs args;
  args.q_nope = view_of<const float, 4>("q_nope", qn, "queries are float32");
  args.q_pe = view_of<const float, 4>("q_pe", qp, "queries are float32");
  args.ckv_cache = view_of<const std::uint8_t, 3>("ckv_cache", ca, "FlashMLA's FP8 records are bytes (uint8)");
  const auto lengths = view_of<const int64_t, 1>("cache_lengths", la, "sequence lengths are int64");
  if (lengths.shape[0] > 1 && lengths.strides[0] != 1)
    throw Error("qkv::mla_decode: cache_lengths: expected a contiguous array");
  args.cache_lengths = std::span<const int64_t>(lengths.data, static_cast<std::size_t>(lengths.shape[0]));
  std::vector<int32_t> table_storage;
  if (table) args.block_table = block_table_view(*table, table_storage, "qkv::mla_decode");
  args.out = view_of<float, 4>("out", oa, "the output is float32");
  if (lse_a) args.lse = view_of<float, 3>("lse", *lse_a, "the log-sum-exp is float32");
  args.indices = index_array ? indices_of(*index_array) : KeyIndices{};
  const AttentionOptions options = bound.for_call();
  nb::gil_scoped_release release;
  mla_decode(args, options);
}

void pack_records(nb::handle c_kv, nb::handle k_pe, nb::handle records, bool power_of_two) {
  const ArrayRef ca = ArrayRef::from(c_kv, false, "c_kv"), pa = ArrayRef::from(k_pe, false, "k_pe"),
                 ra = ArrayRef::from(records, true, "records");
  const auto latent = view_of<const float, 2>("c_kv", ca, "rows are float32");
  const auto rope = view_of<const float, 2>("k_pe", pa, "rows are float32");
  const auto out = view_of<std::uint8_t, 2>("records", ra, "records are bytes (uint8)");
  nb::gil_scoped_release release;
  pack_mla_records(latent, rope, out, power_of_two ? RecordScales::power_of_two : RecordScales::amax);
}

}  // namespace

void bind_mla(nb::module_& m) {
  m.def("pack_mla_records", &pack_records, nb::arg("c_kv"), nb::arg("k_pe"), nb::arg("records"),
        nb::arg("power_of_two"), "qkv::pack_mla_records on [N, dc] / [N, dr] float32 rows into [N, R] uint8.");
  m.def("mla_decode_records", &mla_records, nb::arg("q_nope"), nb::arg("q_pe"), nb::arg("ckv_cache"),
        nb::arg("cache_lengths"), nb::arg("out"), nb::kw_only(), nb::arg("lse").none() = nb::none(),
        nb::arg("block_table").none() = nb::none(), nb::arg("indices").none() = nb::none(), nb::arg("options"),
        "qkv::mla_decode over FlashMLA's FP8 records (uint8 [B | blocks, capacity | block_size, record]) read in "
        "place. Writes out (and lse) in place; the GIL is released.");
  m.def("mla_decode", &mla_any, nb::arg("q_nope"), nb::arg("q_pe"), nb::arg("ckv_cache"), nb::arg("kpe_cache"),
        nb::arg("cache_lengths"), nb::arg("out"), nb::kw_only(), nb::arg("lse").none() = nb::none(),
        nb::arg("block_table").none() = nb::none(), nb::arg("bits_as") = "",
        nb::arg("indices").none() = nb::none(), nb::arg("ckv_scale").none() = nb::none(),
        nb::arg("kpe_scale").none() = nb::none(), nb::arg("options"),
        "qkv::mla_decode on [B, Nq, H, dc|dr] queries and [B | blocks, capacity | block_size, dc|dr] "
        "caches read in place. Writes out (and lse) in place; the GIL is released.");
}

}  // namespace qkv::python
