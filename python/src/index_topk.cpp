// qkv._qkv.index_topk: the indexer (qkv/index_topk.hpp) on NumPy arrays or torch tensors,
// read in place, writing the caller's int32 indices.
#include <nanobind/nanobind.h>

#include <cstdint>

#include "arrays.hpp"
#include "decode.hpp"
#include "options.hpp"
#include "qkv/index_topk.hpp"
#include "qkv/kv_cache.hpp"

namespace qkv::python {
namespace {

constexpr const char* kAsQ = "the dtype of q";

template <class T>
void index_topk_typed(const ArrayRef& q, const ArrayRef& k, const ArrayRef& weights, const ArrayRef& indices,
                      const AttentionOptions& options, bool bits) {
  IndexTopkArgs<T> args;
  args.q = view_of<const T, 4>("q", q, kAsQ, bits);
  args.k = view_of<const T, 3>("k", k, kAsQ, bits);
  args.weights = view_of<const IndexWeightOf<T>, 3>(
      "weights", weights, std::is_same_v<T, double> ? "float64 for float64 q" : "float32 for this q");
  args.indices = view_of<int32_t, 3>("indices", indices, "the indices are int32");
  nanobind::gil_scoped_release release;
  index_topk(args, options);
}

void index_topk_binding(nb::handle q, nb::handle k, nb::handle weights, nb::handle indices,
                        const BoundOptions& bound, bool bfloat16_bits) {
  const Caller caller(bound.function.c_str());
  const ArrayRef qa = ArrayRef::from(q, false, "q"), ka = ArrayRef::from(k, false, "k"),
                 wa = ArrayRef::from(weights, false, "weights"), ia = ArrayRef::from(indices, true, "indices");
  const CallStorage call = call_storage(qa, bfloat16_bits);
  const AttentionOptions options = bound.for_call();
  with_storage(call, [&]<class T>() { index_topk_typed<T>(qa, ka, wa, ia, options, call.bits); });
}

// KVCache.index_topk: the indexer over a cache of index keys; q float32 or bfloat16
// (bfloat16_bits: ml_dtypes arrays as int16 views), weights float32.
void cache_index_topk_binding(const CacheObject& cache, nb::handle q, nb::handle weights, nb::handle indices,
                              const BoundOptions& bound, bool bfloat16_bits) {
  const Caller caller(bound.function.c_str());
  const AttentionOptions options = bound.for_call();
  const ArrayRef qa = ArrayRef::from(q, false, "q");
  const bool bf16 = bfloat16_bits || qa.dtype() == dlpack_dtype<bfloat16>();
  const auto wv = view_of<const float, 3>("weights", ArrayRef::from(weights, false, "weights"), "float32 for this q");
  const auto iv = view_of<int32_t, 3>("indices", ArrayRef::from(indices, true, "indices"), "the indices are int32");
  if (bf16) {
    const auto qv = view_of<const bfloat16, 4>("q", qa, "queries are float32 or bfloat16", bfloat16_bits);
    nanobind::gil_scoped_release release;
    cache.cache->index_topk(qv, wv, iv, options);
    return;
  }
  const auto qv = view_of<const float, 4>("q", qa, "queries are float32 or bfloat16");
  nanobind::gil_scoped_release release;
  cache.cache->index_topk(qv, wv, iv, options);
}

}  // namespace

void bind_index_topk(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def("index_topk", &index_topk_binding, nb::arg("q"), nb::arg("k"), nb::arg("weights"), nb::arg("indices"),
        nb::arg("options"), nb::arg("bfloat16_bits"),
        "qkv::index_topk on the given arrays (q [B, Nq, Hi, di], k [B, Nk, di], weights [B, Nq, Hi] float32 "
        "(float64 for float64 q), read in place); writes the int32 indices [B, Nq, topk] in place. The GIL is "
        "released while computing.");
  m.def("cache_index_topk", &cache_index_topk_binding, nb::arg("cache"), nb::arg("q"), nb::arg("weights"),
        nb::arg("indices"), nb::arg("options"), nb::arg("bfloat16_bits") = false,
        "qkv::KVCache::index_topk: q [B, Nq, Hi, di] (float32 or bfloat16) and weights [B, Nq, Hi] float32 "
        "against the cache's keys "
        "(kv_heads 1, head_dim di); writes the int32 indices [B, Nq, topk] in place. The GIL is released while "
        "computing.");
}

}  // namespace qkv::python
