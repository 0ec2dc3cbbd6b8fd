// qkv._qkv.decode and qkv._qkv.KVCache: the decode kernel and the owned cache for Python.
// Caches are read in place: float32 arrays, float16 arrays, DLPack bfloat16 tensors, or
// any 16-bit integer array holding bfloat16/float16 bits (how the Python package hands
// over a torch bfloat16 tensor without copying: tensor.view(torch.int16).numpy()).
#include "decode.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <span>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "options.hpp"
#include "qkv/decode.hpp"
#include "qkv/error.hpp"
#include "qkv/kv_cache.hpp"

namespace qkv::python {
namespace {

namespace nb = nanobind;

StorageType parse_storage(const std::string& name) {
  if (name == "float32") return StorageType::float32;
  if (name == "bfloat16") return StorageType::bfloat16;
  if (name == "float16") return StorageType::float16;
  if (name == "int8") return StorageType::int8;
  throw Error("dtype: expected 'float32', 'bfloat16', 'float16' or 'int8', got '" + name + "'");
}

// The storage type of a cache array: its own dtype, or `bits_as` for 16-bit integers.
StorageType cache_storage(const char* name, const InArray& array, const std::string& bits_as) {
  using Code = nb::dlpack::dtype_code;
  const nb::dlpack::dtype dt = array.dtype();
  if (dt == nb::dtype<float>()) return StorageType::float32;
  if (dt.code == static_cast<uint8_t>(Code::Float) && dt.bits == 16 && dt.lanes == 1) return StorageType::float16;
  if (dt.code == static_cast<uint8_t>(Code::Bfloat) && dt.bits == 16 && dt.lanes == 1) return StorageType::bfloat16;
  if (dt == nb::dtype<int8_t>()) return StorageType::int8;
  if ((dt == nb::dtype<int16_t>() || dt == nb::dtype<uint16_t>()) && !bits_as.empty()) {
    const StorageType type = parse_storage(bits_as);
    if (type != StorageType::float32) return type;
  }
  throw nb::type_error((std::string(name) + ": expected dtype float32, float16, bfloat16 or int8, got " +
                        dtype_name(dt))
                           .c_str());
}

std::span<const int64_t> lengths_of(const InArray& lengths) {
  const auto view = view_of<const int64_t, 1>("cache_lengths", lengths, "sequence lengths are int64");
  if (view.shape[0] > 1 && view.strides[0] != 1) throw Error("qkv::decode: cache_lengths: expected a contiguous array");
  return {view.data, static_cast<std::size_t>(view.shape[0])};
}

template <class T>
void decode_typed(const InArray& q, const InArray& k_cache, const InArray& v_cache,
                  std::span<const int64_t> lengths, const std::optional<InArray>& block_table,
                  const OutArray& out, const std::optional<OutArray>& lse, const DecodeOptions& options,
                  const std::optional<InArray>& k_scale, const std::optional<InArray>& v_scale) {
  DecodeArgs<T> args;
  if (k_scale) args.k_scale = view_of<const float, 3>("k_scale", *k_scale, "scales are float32");
  if (v_scale) args.v_scale = view_of<const float, 3>("v_scale", *v_scale, "scales are float32");
  args.q = view_of<const float, 4>("q", q, "queries are float32");
  args.k_cache = raw_view<const T, 4>("k_cache", k_cache);
  args.v_cache = raw_view<const T, 4>("v_cache", v_cache);
  args.cache_lengths = lengths;
  if (block_table) args.block_table = view_of<const int32_t, 2>("block_table", *block_table, "block ids are int32");
  args.out = view_of<float, 4>("out", out, "the output is float32");
  if (lse) args.lse = view_of<float, 3>("lse", *lse, "the log-sum-exp is float32");
  nb::gil_scoped_release release;
  decode(args, options);
}

// The decode options from the bindings' keywords (the library checks the values).
DecodeOptions decode_options(std::optional<double> scale, const std::string& causal, int threads,
                             int64_t window_left, int64_t window_right, float softcap,
                             nb::handle alibi_slopes, nb::handle sinks) {
  DecodeOptions options;
  options.scale = scale;
  options.causal = parse_causal(causal);
  options.threads = threads;
  options.window = {window_left, window_right};
  options.softcap = softcap;
  if (!alibi_slopes.is_none()) options.alibi_slopes = per_head("alibi_slopes", alibi_slopes);
  if (!sinks.is_none()) options.sinks = per_head("sinks", sinks);
  return options;
}

void decode_any(const InArray& q, const InArray& k_cache, const InArray& v_cache, const InArray& cache_lengths,
                const OutArray& out, std::optional<OutArray> lse, std::optional<InArray> block_table,
                const std::string& bits_as, std::optional<double> scale, const std::string& causal,
                int threads, int64_t window_left, int64_t window_right, float softcap, nb::handle alibi_slopes,
                nb::handle sinks, std::optional<InArray> k_scale, std::optional<InArray> v_scale) {
  const StorageType k_type = cache_storage("k_cache", k_cache, bits_as);
  if (cache_storage("v_cache", v_cache, bits_as) != k_type)
    throw nb::type_error("v_cache: expected the dtype of k_cache");
  const DecodeOptions options =
      decode_options(scale, causal, threads, window_left, window_right, softcap, alibi_slopes, sinks);
  const auto lengths = lengths_of(cache_lengths);
  switch (k_type) {
    case StorageType::float32:
      return decode_typed<float>(q, k_cache, v_cache, lengths, block_table, out, lse, options, k_scale, v_scale);
    case StorageType::bfloat16:
      return decode_typed<bfloat16>(q, k_cache, v_cache, lengths, block_table, out, lse, options, k_scale, v_scale);
    case StorageType::float16:
      return decode_typed<float16>(q, k_cache, v_cache, lengths, block_table, out, lse, options, k_scale, v_scale);
    case StorageType::int8:
      return decode_typed<std::int8_t>(q, k_cache, v_cache, lengths, block_table, out, lse, options, k_scale, v_scale);
  }
}

// A NumPy array over the cache's own memory (float32, or uint16 bits for 16-bit types),
// kept alive by the cache object.
nb::ndarray<nb::numpy> storage_array(KVCache& cache, bool keys, nb::handle owner) {
  const auto shape4 = keys ? cache.k_shape() : cache.v_shape();
  const std::size_t shape[4] = {static_cast<std::size_t>(shape4[0]), static_cast<std::size_t>(shape4[1]),
                                static_cast<std::size_t>(shape4[2]), static_cast<std::size_t>(shape4[3])};
  void* data = keys ? cache.k_data() : cache.v_data();
  const StorageType type = cache.config().dtype;
  const nb::dlpack::dtype dt = type == StorageType::float32 ? nb::dtype<float>()
                               : type == StorageType::int8  ? nb::dtype<int8_t>()
                                                            : nb::dtype<uint16_t>();
  return nb::ndarray<nb::numpy>(data, 4, shape, owner, nullptr, dt);
}

}  // namespace

void bind_decode(nb::module_& m) {
  m.def("decode", &decode_any, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("cache_lengths"),
        nb::arg("out"), nb::kw_only(), nb::arg("lse").none() = nb::none(),
        nb::arg("block_table").none() = nb::none(), nb::arg("bits_as") = "", nb::arg("scale").none() = nb::none(),
        nb::arg("causal") = "bottom_right", nb::arg("threads") = 0, nb::arg("window_left") = -1,
        nb::arg("window_right") = -1, nb::arg("softcap") = 0.0f, nb::arg("alibi_slopes").none() = nb::none(),
        nb::arg("sinks").none() = nb::none(), nb::arg("k_scale").none() = nb::none(),
        nb::arg("v_scale").none() = nb::none(),
        "qkv::decode on [B, N, H, d] views; caches read in place (16-bit integer arrays hold the "
        "bits of the `bits_as` type). Writes out (and lse) in place; the GIL is released.");

  nb::class_<KVCache>(m, "KVCache")
      .def(
          "__init__",
          [](KVCache* self, int64_t batch, int64_t capacity, int64_t kv_heads, int64_t head_dim, int64_t v_dim,
             const std::string& dtype, bool paged, int64_t block_size, int64_t num_blocks) {
            new (self) KVCache({.batch = batch, .capacity = capacity, .kv_heads = kv_heads, .head_dim = head_dim,
                                .v_dim = v_dim, .dtype = parse_storage(dtype), .paged = paged,
                                .block_size = block_size, .num_blocks = num_blocks});
          },
          nb::arg("batch"), nb::arg("capacity"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("v_dim") = 0,
          nb::arg("dtype") = "float32", nb::arg("paged") = false, nb::arg("block_size") = 16,
          nb::arg("num_blocks") = 0)
      .def(
          "append",
          [](KVCache& self, const InArray& k, const InArray& v, std::optional<std::vector<int64_t>> seqs) {
            const auto kv = view_of<const float, 4>("k", k, "appended keys are float32");
            const auto vv = view_of<const float, 4>("v", v, "appended values are float32");
            const std::vector<int64_t> chosen = seqs.value_or(std::vector<int64_t>{});
            if (seqs && chosen.empty()) throw Error("qkv::KVCache::append: seqs: expected at least one sequence");
            nb::gil_scoped_release release;
            self.append(kv, vv, chosen);
          },
          nb::arg("k"), nb::arg("v"), nb::arg("seqs").none() = nb::none())
      .def(
          "attend",
          [](const KVCache& self, const InArray& q, const OutArray& out, std::optional<OutArray> lse,
             std::optional<double> scale, const std::string& causal, int threads, int64_t window_left,
             int64_t window_right, float softcap, nb::handle alibi_slopes, nb::handle sinks) {
            const DecodeOptions options = decode_options(scale, causal, threads, window_left, window_right,
                                                         softcap, alibi_slopes, sinks);
            const auto qv = view_of<const float, 4>("q", q, "queries are float32");
            const auto ov = view_of<float, 4>("out", out, "the output is float32");
            View3<float> lv;
            if (lse) lv = view_of<float, 3>("lse", *lse, "the log-sum-exp is float32");
            nb::gil_scoped_release release;
            self.attend(qv, ov, lv, options);
          },
          nb::arg("q"), nb::arg("out"), nb::kw_only(), nb::arg("lse").none() = nb::none(),
          nb::arg("scale").none() = nb::none(), nb::arg("causal") = "bottom_right", nb::arg("threads") = 0,
          nb::arg("window_left") = -1, nb::arg("window_right") = -1, nb::arg("softcap") = 0.0f,
          nb::arg("alibi_slopes").none() = nb::none(), nb::arg("sinks").none() = nb::none())
      .def("reset", [](KVCache& self) { self.reset(); })
      .def("reset", [](KVCache& self, int64_t seq) { self.reset(seq); }, nb::arg("seq"))
      .def_prop_ro("lengths", [](const KVCache& self) {
        return std::vector<int64_t>(self.lengths().begin(), self.lengths().end());
      })
      .def_prop_ro("free_blocks", &KVCache::free_blocks)
      .def_prop_ro("dtype", [](const KVCache& self) { return std::string(storage_name(self.config().dtype)); })
      .def_prop_ro("paged", [](const KVCache& self) { return self.config().paged; })
      .def_prop_ro("block_size", [](const KVCache& self) { return self.config().block_size; })
      .def_prop_ro("capacity", [](const KVCache& self) { return self.config().capacity; })
      .def("key_storage", [](nb::handle self) { return storage_array(nb::cast<KVCache&>(self), true, self); })
      .def("value_storage", [](nb::handle self) { return storage_array(nb::cast<KVCache&>(self), false, self); })
      .def("scales", [](nb::handle self) -> nb::object {
        // int8: the rows' scales (keys, values), [B | blocks, capacity | block_size, Hkv]
        // NumPy views of the cache's memory; None for other storage types.
        KVCache& cache = nb::cast<KVCache&>(self);
        if (cache.config().dtype != StorageType::int8) return nb::none();
        const auto shape4 = cache.k_shape();
        const std::size_t shape[3] = {static_cast<std::size_t>(shape4[0]), static_cast<std::size_t>(shape4[1]),
                                      static_cast<std::size_t>(shape4[2])};
        return nb::make_tuple(nb::ndarray<nb::numpy, const float>(cache.k_scales().data(), 3, shape, self),
                              nb::ndarray<nb::numpy, const float>(cache.v_scales().data(), 3, shape, self));
      })
      .def("block_table", [](nb::handle self) {
        KVCache& cache = nb::cast<KVCache&>(self);
        const std::size_t shape[2] = {static_cast<std::size_t>(cache.config().batch),
                                      static_cast<std::size_t>(cache.blocks_per_sequence())};
        return nb::ndarray<nb::numpy, const int32_t>(cache.block_table().data(), 2, shape, self);
      });
}

}  // namespace qkv::python
