// qkv._qkv.decode and qkv._qkv.KVCache: the decode kernel and the owned cache for Python.
// Caches are read in place: float32 arrays, float16 arrays, DLPack bfloat16 tensors, or
// any 16-bit integer array holding bfloat16/float16 bits (how the Python package hands
// over a torch bfloat16 tensor without copying: tensor.view(torch.int16).numpy()); float8
// caches likewise as uint8 arrays holding their bytes, `bits_as` naming the format.
#include "decode.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <span>
#include <utility>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "cache_scales.hpp"
#include "debug.hpp"
#include "options.hpp"
#include "qkv/decode.hpp"
#include "qkv/error.hpp"
#include "qkv/kv_cache.hpp"

namespace qkv::python {

namespace nb = nanobind;

StorageType parse_storage(const std::string& name) {
  if (name == "float32") return StorageType::float32;
  if (name == "bfloat16") return StorageType::bfloat16;
  if (name == "float16") return StorageType::float16;
  if (name == "int8") return StorageType::int8;
  if (name == "int4") return StorageType::int4;
  if (name == "float8_e4m3fn") return StorageType::float8_e4m3fn;
  if (name == "float8_e5m2") return StorageType::float8_e5m2;
  throw Error(Caller::named("dtype") +
              ": expected 'float32', 'bfloat16', 'float16', 'int8', 'int4', 'float8_e4m3fn' or 'float8_e5m2', got '" +
              name + "'");
}

// The storage type of a cache array: its own dtype, or `bits_as` for 16-bit integers.
StorageType cache_storage(const char* name, const ArrayRef& array, const std::string& bits_as) {
  using Code = nb::dlpack::dtype_code;
  const nb::dlpack::dtype dt = array.dtype();
  if (dt == nb::dtype<float>()) return StorageType::float32;
  if (dt.code == static_cast<uint8_t>(Code::Float) && dt.bits == 16 && dt.lanes == 1) return StorageType::float16;
  if (dt.code == static_cast<uint8_t>(Code::Bfloat) && dt.bits == 16 && dt.lanes == 1) return StorageType::bfloat16;
  if (dt == nb::dtype<int8_t>()) return StorageType::int8;
  if ((dt == nb::dtype<int16_t>() || dt == nb::dtype<uint16_t>()) && !bits_as.empty()) {
    const StorageType type = parse_storage(bits_as);
    if (type == StorageType::bfloat16 || type == StorageType::float16) return type;
  }
  if (dt == nb::dtype<uint8_t>() && !bits_as.empty()) {  // float8 bytes (NumPy has no float8 dtype)
    const StorageType type = parse_storage(bits_as);
    if (is_float8(type)) return type;
  }
  argument_type_error(name, "expected dtype float32, float16, bfloat16, int8, float8_e4m3fn or float8_e5m2, got " +
                                dtype_name(dt));
}

std::span<const int64_t> lengths_of(const ArrayRef& lengths) {
  const auto view = view_of<const int64_t, 1>("cache_lengths", lengths, "sequence lengths are int64");
  if (view.shape[0] > 1 && view.strides[0] != 1) throw Error("qkv::decode: cache_lengths: expected a contiguous array");
  return {view.data, static_cast<std::size_t>(view.shape[0])};
}

// Entry [row, column] of a C-contiguous 2-D integer array as int64; nullopt when it does
// not fit (a uint64 past 2**63).
template <class Int>
std::optional<int64_t> entry_of(const ArrayRef& table, std::size_t index) {
  const Int value = static_cast<const Int*>(table.data_handle())[index];
  if constexpr (std::is_same_v<Int, std::uint64_t>) {
    if (value > static_cast<std::uint64_t>(INT64_MAX)) return std::nullopt;
  }
  return static_cast<int64_t>(value);
}

// The block table as the int32 view the library reads: an int32 array in place, any other
// integer array (int64 from torch or NumPy) copied into `storage` with every entry
// checked to fit int32 first, so that no block id is silently wrapped (2**32 + 1 is not
// block 1). Whether each id names a block of the pool is the library's check.
TensorView<const int32_t, 2> block_table_view(const ArrayRef& table, std::vector<int32_t>& storage,
                                              const char* function) {
  if (table.dtype() == nb::dtype<int32_t>()) return view_of<const int32_t, 2>("block_table", table, "block ids are int32");
  expect_cpu("block_table", table.device_type());
  expect_rank("block_table", table.ndim(), 2);
  const nb::dlpack::dtype dt = table.dtype();
  using Code = nb::dlpack::dtype_code;
  const bool integer = (dt.code == static_cast<uint8_t>(Code::Int) || dt.code == static_cast<uint8_t>(Code::UInt)) &&
                       dt.lanes == 1 && (dt.bits == 8 || dt.bits == 16 || dt.bits == 32 || dt.bits == 64);
  if (!integer) {
    argument_type_error("block_table", "expected dtype int32 or int64 (block ids), got " + dtype_name(dt));
  }
  const int64_t rows = static_cast<int64_t>(table.shape(0)), columns = static_cast<int64_t>(table.shape(1));
  if (table.size() > 0 && (table.stride(1) != 1 || (rows > 1 && table.stride(0) != columns))) {
    throw Error(Caller::named("block_table") + ": expected a C-contiguous array");
  }
  const bool is_signed = dt.code == static_cast<uint8_t>(Code::Int);
  storage.resize(table.size());
  for (std::size_t i = 0; i < table.size(); ++i) {
    std::optional<int64_t> id;
    switch (dt.bits) {
      case 8: id = is_signed ? entry_of<std::int8_t>(table, i) : entry_of<std::uint8_t>(table, i); break;
      case 16: id = is_signed ? entry_of<std::int16_t>(table, i) : entry_of<std::uint16_t>(table, i); break;
      case 32: id = is_signed ? entry_of<std::int32_t>(table, i) : entry_of<std::uint32_t>(table, i); break;
      default: id = is_signed ? entry_of<std::int64_t>(table, i) : entry_of<std::uint64_t>(table, i); break;
    }
    if (!id || *id < INT32_MIN || *id > INT32_MAX) {
      const int64_t row = columns > 0 ? static_cast<int64_t>(i) / columns : 0;
      const int64_t column = columns > 0 ? static_cast<int64_t>(i) % columns : 0;
      throw Error(std::string(function) + ": block_table[" + std::to_string(row) + ", " + std::to_string(column) +
                  "]: expected a block id that fits int32, got " +
                  (id ? std::to_string(*id) : std::string("a value past 2**63")));
    }
    storage[i] = static_cast<int32_t>(*id);
  }
  return TensorView<const int32_t, 2>(storage.data(), {rows, columns}, {columns, 1});
}

std::optional<ArrayRef> optional_in(const char* name, nb::handle array) {
  if (array.is_none()) return std::nullopt;
  return ArrayRef::from(array, false, name);
}

namespace {

template <class T>
void decode_typed(const ArrayRef& q, const ArrayRef& k_cache, const ArrayRef& v_cache,
                  std::span<const int64_t> lengths, const std::optional<ArrayRef>& block_table,
                  const ArrayRef& out, const std::optional<ArrayRef>& lse, const AttentionOptions& options,
                  const std::optional<ArrayRef>& k_scale, const std::optional<ArrayRef>& v_scale,
                  const KeyIndices& indices) {
  DecodeArgs<T> args;
  args.indices = indices;
  args.k_cache = raw_view<const T, 4>("k_cache", k_cache);
  args.v_cache = raw_view<const T, 4>("v_cache", v_cache);
  constexpr StorageType storage = storage_type_of<T>;
  const auto& kc = args.k_cache.shape;
  const auto& vc = args.v_cache.shape;
  args.k_scale = cache_scale_view("k_scale", k_scale, storage, {kc[0], kc[1], kc[2]});
  args.v_scale = cache_scale_view("v_scale", v_scale, storage, {vc[0], vc[1], vc[2]});
  args.q = view_of<const float, 4>("q", q, "queries are float32");
  args.cache_lengths = lengths;
  std::vector<int32_t> table_storage;
  if (block_table) args.block_table = block_table_view(*block_table, table_storage, "qkv::decode");
  args.out = view_of<float, 4>("out", out, "the output is float32");
  if (lse) args.lse = view_of<float, 3>("lse", *lse, "the log-sum-exp is float32");
  if (debug_recording.load(std::memory_order_relaxed)) {  // tests: what the library reads, in place or not
    debug_begin_call();
    debug_record("k_cache", args.k_cache);
    debug_record("v_cache", args.v_cache);
    debug_record("k_scale", args.k_scale);
    debug_record("v_scale", args.v_scale);
  }
  nb::gil_scoped_release release;
  decode(args, options);
}

void decode_any(nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle cache_lengths, nb::handle out,
                nb::handle lse, nb::handle block_table, const std::string& bits_as, nb::handle k_scale,
                nb::handle v_scale, nb::handle indices, const BoundOptions& bound) {
  const Caller caller(bound.function.c_str());
  const std::optional<ArrayRef> index_array = optional_in("indices", indices);
  const KeyIndices lists = index_array ? indices_of(*index_array) : KeyIndices{};
  const ArrayRef qa = ArrayRef::from(q, false, "q"), ka = ArrayRef::from(k_cache, false, "k_cache"),
                 va = ArrayRef::from(v_cache, false, "v_cache"), oa = ArrayRef::from(out, true, "out"),
                 la = ArrayRef::from(cache_lengths, false, "cache_lengths");
  const std::optional<ArrayRef> lse_a = lse.is_none() ? std::nullopt : std::optional(ArrayRef::from(lse, true, "lse"));
  const std::optional<ArrayRef> table = optional_in("block_table", block_table),
                                ks = optional_in("k_scale", k_scale), vs = optional_in("v_scale", v_scale);
  const StorageType k_type = cache_storage("k_cache", ka, bits_as);
  if (cache_storage("v_cache", va, bits_as) != k_type) argument_type_error("v_cache", "expected the dtype of k_cache");
  const AttentionOptions options = bound.for_call();
  const auto lengths = lengths_of(la);
  switch (k_type) {
    case StorageType::float32:
      return decode_typed<float>(qa, ka, va, lengths, table, oa, lse_a, options, ks, vs, lists);
    case StorageType::bfloat16:
      return decode_typed<bfloat16>(qa, ka, va, lengths, table, oa, lse_a, options, ks, vs, lists);
    case StorageType::float16:
      return decode_typed<float16>(qa, ka, va, lengths, table, oa, lse_a, options, ks, vs, lists);
    case StorageType::int8:
      return decode_typed<std::int8_t>(qa, ka, va, lengths, table, oa, lse_a, options, ks, vs, lists);
    case StorageType::float8_e4m3fn:
      return decode_typed<float8_e4m3fn>(qa, ka, va, lengths, table, oa, lse_a, options, ks, vs, lists);
    case StorageType::float8_e5m2:
      return decode_typed<float8_e5m2>(qa, ka, va, lengths, table, oa, lse_a, options, ks, vs, lists);
    case StorageType::int4: break;  // no array dtype is int4 (cache_storage)
  }
  throw Error("qkv::decode: int4 caches attend through qkv.KVCache.attend");
}

// The owner of a view of the cache's memory: a capsule holding the C++ cache (not the
// Python object: see CacheObject in decode.hpp).
nb::capsule memory_owner(nb::handle self) {
  auto* cache = new std::shared_ptr<KVCache>(nb::cast<CacheObject&>(self).cache);
  return nb::capsule(cache, [](void* p) noexcept { delete static_cast<std::shared_ptr<KVCache>*>(p); });
}

// A NumPy array over the cache's own memory (float32, int8, uint16 bits for 16-bit types,
// uint8 bytes for int4 and float8), kept alive by the C++ cache (memory_owner).
nb::ndarray<nb::numpy> storage_array(nb::handle self, bool keys) {
  KVCache& cache = *nb::cast<CacheObject&>(self).cache;
  const auto shape4 = keys ? cache.k_shape() : cache.v_shape();
  std::size_t shape[4] = {static_cast<std::size_t>(shape4[0]), static_cast<std::size_t>(shape4[1]),
                          static_cast<std::size_t>(shape4[2]), static_cast<std::size_t>(shape4[3])};
  void* data = keys ? cache.k_data() : cache.v_data();
  const StorageType type = cache.config().dtype;
  if (type == StorageType::int4) shape[3] = (shape[3] + 1) / 2;  // bytes: two levels each
  const nb::dlpack::dtype dt = type == StorageType::float32 ? nb::dtype<float>()
                               : type == StorageType::int8  ? nb::dtype<int8_t>()
                               : type == StorageType::int4 || is_float8(type) ? nb::dtype<uint8_t>()
                                                                              : nb::dtype<uint16_t>();
  return nb::ndarray<nb::numpy>(data, 4, shape, memory_owner(self), nullptr, dt);
}

// The cache's scale arrays, in its scale_dtype (float32, or float16 for int4 caches).
enum class ScaleKind { key_rows, channel_scales, channel_zeros, value_groups };

template <class S>
std::span<const S> scales_of(const KVCache& cache, ScaleKind kind) {
  switch (kind) {
    case ScaleKind::key_rows: return cache.k_scales<S>();
    case ScaleKind::channel_scales: return cache.k_channel_scales<S>();
    case ScaleKind::channel_zeros: return cache.k_channel_zeros<S>();
    case ScaleKind::value_groups: return cache.v_group_scales<S>();
  }
  return {};
}

bool half_scales(const KVCache& cache) { return cache.config().scale_dtype == StorageType::float16; }

bool has_scales(const KVCache& cache, ScaleKind kind) {
  return half_scales(cache) ? !scales_of<float16>(cache, kind).empty() : !scales_of<float>(cache, kind).empty();
}

// A read-only NumPy view of one of the cache's scale arrays (float32 or float16), shaped
// `shape`, with `strides` in elements (null: row-major).
nb::object scale_view(nb::handle self, ScaleKind kind, std::size_t ndim, const std::size_t* shape,
                      const int64_t* strides = nullptr) {
  const KVCache& cache = *nb::cast<CacheObject&>(self).cache;
  const bool half = half_scales(cache);
  const void* data = half ? static_cast<const void*>(scales_of<float16>(cache, kind).data())
                          : static_cast<const void*>(scales_of<float>(cache, kind).data());
  const nb::dlpack::dtype dt =
      half ? nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1} : nb::dtype<float>();
  return nb::cast(nb::ndarray<nb::numpy, nb::ro>(const_cast<void*>(data), ndim, shape, memory_owner(self), strides, dt));
}

}  // namespace

void bind_decode(nb::module_& m) {
  m.def("decode", &decode_any, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("cache_lengths"),
        nb::arg("out"), nb::kw_only(), nb::arg("lse").none() = nb::none(),
        nb::arg("block_table").none() = nb::none(), nb::arg("bits_as") = "",
        nb::arg("k_scale").none() = nb::none(), nb::arg("v_scale").none() = nb::none(),
        nb::arg("indices").none() = nb::none(), nb::arg("options"),
        "qkv::decode on [B, N, H, d] views; caches read in place (16-bit integer arrays hold the "
        "bits of the `bits_as` type). options: an Options (scale, causal, threads and the "
        "variants). Writes out (and lse) in place; the GIL is released.");

  nb::class_<CacheObject>(m, "KVCache")
      .def(
          "__init__",
          [](CacheObject* self, nb::handle batch, nb::handle capacity, nb::handle kv_heads, nb::handle head_dim,
             nb::handle v_dim, const std::string& dtype, bool paged, nb::handle block_size, nb::handle num_blocks,
             const std::string& key_scales, nb::handle group_size, nb::handle float_window,
             const std::string& scale_dtype, const std::vector<float>& k_scale, const std::vector<float>& v_scale) {
            const Caller caller("qkv.KVCache");
            if (key_scales != "row" && key_scales != "channel")
              throw Error("qkv::KVCache: config.key_scales: expected 'row' or 'channel', got '" + key_scales + "'");
            const KVCacheConfig config{
                .batch = int64_argument("batch", batch),
                .capacity = int64_argument("capacity", capacity),
                .kv_heads = int64_argument("kv_heads", kv_heads),
                .head_dim = int64_argument("head_dim", head_dim),
                .v_dim = int64_argument("v_dim", v_dim), .dtype = parse_storage(dtype), .paged = paged,
                .block_size = int64_argument("block_size", block_size),
                .num_blocks = int64_argument("num_blocks", num_blocks),
                .key_scales = key_scales == "channel" ? KeyScales::channel : KeyScales::row,
                .group_size = int64_argument("group_size", group_size),
                .float_window = float_window.is_none() ? std::optional<int64_t>()
                                                       : int64_argument("float_window", float_window),
                .scale_dtype = scale_dtype.empty() ? std::nullopt : std::optional(parse_storage(scale_dtype)),
                .k_scale = k_scale, .v_scale = v_scale};
            new (self) CacheObject{std::make_shared<KVCache>(config)};
          },
          nb::arg("batch"), nb::arg("capacity"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("v_dim") = 0,
          nb::arg("dtype") = "float32", nb::arg("paged") = false, nb::arg("block_size") = 16,
          nb::arg("num_blocks") = 0, nb::arg("key_scales") = "row", nb::arg("group_size") = 32,
          nb::arg("float_window").none() = nb::none(), nb::arg("scale_dtype") = "",
          nb::arg("k_scale") = std::vector<float>{}, nb::arg("v_scale") = std::vector<float>{})
      .def(
          "append",
          [](CacheObject& object, const InArray& k, const InArray& v, nb::handle seq_list) {
            const Caller caller("qkv.KVCache.append");
            const std::optional<std::vector<int64_t>> seqs = int64_list_argument("seq", seq_list);
            const auto kv = view_of<const float, 4>("k", k, "appended keys are float32");
            const auto vv = view_of<const float, 4>("v", v, "appended values are float32");
            const std::vector<int64_t> chosen = seqs.value_or(std::vector<int64_t>{});
            if (seqs && chosen.empty()) throw Error("qkv::KVCache::append: seqs: expected at least one sequence");
            nb::gil_scoped_release release;
            object.cache->append(kv, vv, chosen);
          },
          nb::arg("k"), nb::arg("v"), nb::arg("seqs").none() = nb::none())
      .def(
          "append_varlen",
          [](CacheObject& object, const InArray& k, const InArray& v, nb::handle cu_seqlens_list, nb::handle seq_list) {
            const Caller caller("qkv.KVCache.append_varlen");
            const std::vector<int64_t> cu_seqlens = int64_list_argument("cu_seqlens", cu_seqlens_list).value_or(
                std::vector<int64_t>{});
            const std::optional<std::vector<int64_t>> seqs = int64_list_argument("seq", seq_list);
            const auto kv = view_of<const float, 3>("k", k, "appended keys are float32");
            const auto vv = view_of<const float, 3>("v", v, "appended values are float32");
            const std::vector<int64_t> chosen = seqs.value_or(std::vector<int64_t>{});
            if (seqs && chosen.empty()) throw Error("qkv::KVCache::append_varlen: seqs: expected at least one sequence");
            nb::gil_scoped_release release;
            object.cache->append_varlen(kv, vv, std::span<const int64_t>(cu_seqlens), chosen);
          },
          nb::arg("k"), nb::arg("v"), nb::arg("cu_seqlens"), nb::arg("seqs").none() = nb::none())
      .def(
          "attend",
          [](const CacheObject& object, nb::handle q, nb::handle out, nb::handle lse, nb::handle indices,
             const BoundOptions& bound) {
            const Caller caller(bound.function.c_str());
            const std::optional<ArrayRef> index_array = optional_in("indices", indices);
            const KeyIndices lists = index_array ? indices_of(*index_array) : KeyIndices{};
            const AttentionOptions options = bound.for_call();
            const auto qv = view_of<const float, 4>("q", ArrayRef::from(q, false, "q"), "queries are float32");
            const auto ov = view_of<float, 4>("out", ArrayRef::from(out, true, "out"), "the output is float32");
            View3<float> lv;
            if (!lse.is_none()) lv = view_of<float, 3>("lse", ArrayRef::from(lse, true, "lse"), "the log-sum-exp is float32");
            nb::gil_scoped_release release;
            object.cache->attend(qv, ov, lv, options, lists);
          },
          nb::arg("q"), nb::arg("out"), nb::kw_only(), nb::arg("lse").none() = nb::none(),
          nb::arg("indices").none() = nb::none(), nb::arg("options"))
      .def(
          "reset",
          [](CacheObject& object, nb::handle seq) {
            const Caller caller("qkv.KVCache.reset");
            if (seq.is_none()) return object.cache->reset();
            object.cache->reset(int64_argument("seq", seq));
          },
          nb::arg("seq").none() = nb::none())
      .def_prop_ro("lengths", [](const CacheObject& object) {
        const auto lengths = object.cache->lengths();
        return std::vector<int64_t>(lengths.begin(), lengths.end());
      })
      .def_prop_ro("free_blocks", [](const CacheObject& object) { return object.cache->free_blocks(); })
      .def_prop_ro("dtype", [](const CacheObject& object) { return std::string(storage_name(object.cache->config().dtype)); })
      .def_prop_ro("paged", [](const CacheObject& object) { return object.cache->config().paged; })
      .def_prop_ro("block_size", [](const CacheObject& object) { return object.cache->config().block_size; })
      .def_prop_ro("capacity", [](const CacheObject& object) { return object.cache->config().capacity; })
      .def("key_storage", [](nb::handle self) { return storage_array(self, true); })
      .def("value_storage", [](nb::handle self) { return storage_array(self, false); })
      .def("scales", [](nb::handle self) -> nb::object {
        // int8: the rows' scales (keys, values), [B | blocks, capacity | block_size, Hkv]
        // NumPy views of the cache's memory; None for other storage types.
        KVCache& cache = *nb::cast<CacheObject&>(self).cache;
        // float8: (key scales, value scales), float32 [Hkv] copies (one per kv head, a
        // per-tensor scale repeated; fixed once known, so a copy is as good as a view);
        // None until the first append sets them, if they were not given.
        if (is_float8(cache.config().dtype)) {
          if (cache.k_scales().empty()) return nb::none();
          const auto copy = [](std::span<const float> values) {
            auto* owned = new std::vector<float>(values.begin(), values.end());
            nb::capsule free(owned, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
            const std::size_t shape[1] = {owned->size()};
            return nb::ndarray<nb::numpy, float>(owned->data(), 1, shape, free);
          };
          return nb::make_tuple(copy(cache.k_scales()), copy(cache.v_scales()));
        }
        // int4: the keys' row scales (1, or NaN for a non-finite key) and None.
        if (cache.config().dtype != StorageType::int8 && cache.config().dtype != StorageType::int4) return nb::none();
        const auto shape4 = cache.k_shape();
        const std::size_t shape[3] = {static_cast<std::size_t>(shape4[0]), static_cast<std::size_t>(shape4[1]),
                                      static_cast<std::size_t>(shape4[2])};
        if (cache.config().dtype == StorageType::int4) {  // stored heads outer: [outer, Hkv, inner]
          const int64_t strides[3] = {shape4[1] * shape4[2], 1, shape4[1]};
          return nb::make_tuple(scale_view(self, ScaleKind::key_rows, 3, shape, strides), nb::none());
        }
        return nb::make_tuple(nb::ndarray<nb::numpy, const float>(cache.k_scales().data(), 3, shape, memory_owner(self)),
                              nb::ndarray<nb::numpy, const float>(cache.v_scales().data(), 3, shape, memory_owner(self)));
      })
      .def_prop_ro("key_scales", [](const CacheObject& object) {
        return std::string(object.cache->config().key_scales == KeyScales::channel ? "channel" : "row");
      })
      .def_prop_ro("group_size", [](const CacheObject& object) { return object.cache->config().group_size; })
      .def_prop_ro("scale_dtype", [](const CacheObject& object) { return std::string(storage_name(*object.cache->config().scale_dtype)); })
      .def_prop_ro("float_window", [](const CacheObject& object) { return object.cache->config().float_window.value_or(0); })
      .def_prop_ro("quantized_lengths", [](const CacheObject& object) {
        const auto lengths = object.cache->quantized_lengths();
        return std::vector<int64_t>(lengths.begin(), lengths.end());
      })
      .def("value_group_scales", [](nb::handle self) -> nb::object {
        // int4: each value row's group scales then zero points, [B | blocks, capacity |
        // block_size, Hkv, 2·groups] NumPy view; None otherwise.
        KVCache& cache = *nb::cast<CacheObject&>(self).cache;
        if (!has_scales(cache, ScaleKind::value_groups)) return nb::none();
        const auto shape4 = cache.v_shape();
        const std::size_t shape[4] = {static_cast<std::size_t>(shape4[0]), static_cast<std::size_t>(shape4[1]),
                                      static_cast<std::size_t>(shape4[2]),
                                      static_cast<std::size_t>(2 * ((shape4[3] + kValueGroup - 1) / kValueGroup))};
        const auto groups = static_cast<int64_t>(shape[3]);  // stored [outer, Hkv, 2·groups, inner]
        const int64_t strides[4] = {shape4[1] * shape4[2] * groups, 1, shape4[1] * groups, shape4[1]};
        return scale_view(self, ScaleKind::value_groups, 4, shape, strides);
      })
      .def(
          "stored",
          [](const CacheObject& object, nb::handle seq_arg) {
            const int64_t seq = [&] {
              const Caller caller("qkv.KVCache.stored");
              return int64_argument("seq", seq_arg);
            }();
            // The keys and values attention reads for `seq`, float32 [length, Hkv, d | dv] copies.
            std::pair<std::vector<float>, std::vector<float>> rows;
            {
              nb::gil_scoped_release release;
              rows = object.cache->stored(seq);
            }
            auto& [k, v] = rows;
            const auto heads = static_cast<std::size_t>(object.cache->config().kv_heads);
            const std::size_t length = k.size() / (heads * static_cast<std::size_t>(object.cache->config().head_dim));
            const auto to_array = [&](std::vector<float>&& values, int64_t dim) {
              auto* owned = new std::vector<float>(std::move(values));
              nb::capsule free(owned, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
              const std::size_t shape[3] = {length, heads, static_cast<std::size_t>(dim)};
              return nb::ndarray<nb::numpy, float>(owned->data(), 3, shape, free);
            };
            const KVCacheConfig& config = object.cache->config();
            return nb::make_tuple(to_array(std::move(k), config.head_dim), to_array(std::move(v), config.v_dim));
          },
          nb::arg("seq"))
      .def("channel_scales", [](nb::handle self) -> nb::object {
        // key_scales="channel": (the keys' channel scales, their zero points), each
        // [B | blocks, groups, Hkv, d], NumPy views of the cache's memory; None otherwise.
        KVCache& cache = *nb::cast<CacheObject&>(self).cache;
        if (!has_scales(cache, ScaleKind::channel_scales)) return nb::none();
        const auto shape4 = cache.k_channel_shape();
        const std::size_t shape[4] = {static_cast<std::size_t>(shape4[0]), static_cast<std::size_t>(shape4[1]),
                                      static_cast<std::size_t>(shape4[2]), static_cast<std::size_t>(shape4[3])};
        return nb::make_tuple(scale_view(self, ScaleKind::channel_scales, 4, shape),
                              scale_view(self, ScaleKind::channel_zeros, 4, shape));
      })
      .def("block_table", [](nb::handle self) {
        KVCache& cache = *nb::cast<CacheObject&>(self).cache;
        const std::size_t shape[2] = {static_cast<std::size_t>(cache.config().batch),
                                      static_cast<std::size_t>(cache.blocks_per_sequence())};
        return nb::ndarray<nb::numpy, const int32_t>(cache.block_table().data(), 2, shape, memory_owner(self));
      });
}

}  // namespace qkv::python
