// qkv::sparse_attention_forward / _backward for Python: q, k, v and the gradients as in
// attention.cpp (bhsd or bshd, read in place), the key lists `indices` as int32 or int64
// [B, Nq, topk] or [B, Hkv, Nq, topk], read in place; outputs allocated by the caller.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <string>

#include "arrays.hpp"
#include "options.hpp"
#include "qkv/error.hpp"
#include "qkv/sparse.hpp"

namespace qkv::python {
// The lists as the library's KeyIndices: the rank says the mode (3: one list per query
// for every head, 4: one per kv head), the dtype int32 or int64.
namespace {
template <class I>
KeyIndices indices_as(const ArrayRef& array) {
  if (array.ndim() == 3) return TensorView<const I, 3>(raw_view<const I, 3>("indices", array));
  return TensorView<const I, 4>(raw_view<const I, 4>("indices", array));
}

}  // namespace

KeyIndices packed_indices_of(const ArrayRef& array) {
  if (array.ndim() != 2)
    throw Error(Caller::named("indices") + ": expected 2 dimensions [total_q, topk], got " + std::to_string(array.ndim()));
  if (array.dtype() == nb::dtype<int32_t>()) return TensorView<const int32_t, 2>(raw_view<const int32_t, 2>("indices", array));
  if (array.dtype() == nb::dtype<int64_t>()) return TensorView<const int64_t, 2>(raw_view<const int64_t, 2>("indices", array));
  throw nb::type_error((Caller::named("indices") + ": expected dtype int32 or int64, got " + dtype_name(array.dtype())).c_str());
}

KeyIndices indices_of(const ArrayRef& array) {
  if (array.ndim() != 3 && array.ndim() != 4) {
    throw Error(Caller::named("indices") + ": expected 3 dimensions [B, Nq, topk] or 4 [B, Hkv, Nq, topk], got " +
                std::to_string(array.ndim()));
  }
  if (array.dtype() == nb::dtype<int32_t>()) return indices_as<int32_t>(array);
  if (array.dtype() == nb::dtype<int64_t>()) return indices_as<int64_t>(array);
  throw nb::type_error((Caller::named("indices") + ": expected dtype int32 or int64, got " + dtype_name(array.dtype())).c_str());
}


namespace {

constexpr const char* kAsQ = "the dtype of q";
template <class T>
constexpr const char* kLseBecause =
    std::is_same_v<LseOf<T>, T> ? kAsQ : "lse is float32 for 16-bit inputs";

ArrayRef logical(const char* name, nb::handle array, bool writable, bool bhsd) {
  const ArrayRef ref = ArrayRef::from(array, writable, name);
  return bhsd ? ref.swapped_1_2() : ref;
}

void forward(nb::handle q, nb::handle k, nb::handle v, nb::handle indices, nb::handle out, nb::handle lse,
             const BoundOptions& bound, bool bhsd, bool bfloat16_bits) {
  const Caller caller(bound.function.c_str());  // array errors name qkv.sparse_attention
  const ArrayRef qa = logical("q", q, false, bhsd), ka = logical("k", k, false, bhsd),
                 va = logical("v", v, false, bhsd), oa = logical("out", out, true, bhsd);
  const KeyIndices lists = indices_of(ArrayRef::from(indices, false, "indices"));
  const std::optional<ArrayRef> la =
      lse.is_none() ? std::nullopt : std::optional<ArrayRef>(ArrayRef::from(lse, true, "lse"));
  const CallStorage call = call_storage(qa, bfloat16_bits);
  const AttentionOptions options = bound.for_call();
  with_storage(call, [&]<class T>() {
    SparseForwardArgs<T> args;
    args.q = view_of<const T, 4>("q", qa, kAsQ, call.bits);
    args.k = view_of<const T, 4>("k", ka, kAsQ, call.bits);
    args.v = view_of<const T, 4>("v", va, kAsQ, call.bits);
    args.indices = lists;
    args.out = view_of<T, 4>("out", oa, kAsQ, call.bits);
    if (la) args.lse = view_of<LseOf<T>, 3>("lse", *la, kLseBecause<T>);
    nb::gil_scoped_release release;
    sparse_attention_forward(args, options);
  });
}

void backward(nb::handle q, nb::handle k, nb::handle v, nb::handle indices, nb::handle out, nb::handle lse,
              nb::handle dout, nb::handle dq, nb::handle dk, nb::handle dv, nb::handle dsinks,
              const BoundOptions& bound, bool bhsd, bool bfloat16_bits) {
  const Caller caller(bound.function.c_str());  // array errors name qkv.sparse_attention_backward
  const ArrayRef qa = logical("q", q, false, bhsd), ka = logical("k", k, false, bhsd),
                 va = logical("v", v, false, bhsd), oa = logical("out", out, false, bhsd),
                 la = ArrayRef::from(lse, false, "lse"), da = logical("dout", dout, false, bhsd),
                 dqa = logical("dq", dq, true, bhsd), dka = logical("dk", dk, true, bhsd),
                 dva = logical("dv", dv, true, bhsd);
  const KeyIndices lists = indices_of(ArrayRef::from(indices, false, "indices"));
  const std::optional<ArrayRef> dsa =
      dsinks.is_none() ? std::nullopt : std::optional<ArrayRef>(ArrayRef::from(dsinks, true, "dsinks"));
  const CallStorage call = call_storage(qa, bfloat16_bits);
  const AttentionOptions options = bound.for_call();
  with_storage(call, [&]<class T>() {
    SparseBackwardArgs<T> args;
    args.q = view_of<const T, 4>("q", qa, kAsQ, call.bits);
    args.k = view_of<const T, 4>("k", ka, kAsQ, call.bits);
    args.v = view_of<const T, 4>("v", va, kAsQ, call.bits);
    args.indices = lists;
    args.out = view_of<const T, 4>("out", oa, kAsQ, call.bits);
    args.lse = view_of<const LseOf<T>, 3>("lse", la, kLseBecause<T>);
    args.dout = view_of<const T, 4>("dout", da, kAsQ, call.bits);
    args.dq = view_of<T, 4>("dq", dqa, kAsQ, call.bits);
    args.dk = view_of<T, 4>("dk", dka, kAsQ, call.bits);
    args.dv = view_of<T, 4>("dv", dva, kAsQ, call.bits);
    args.dsinks = optional_float_span("dsinks", dsa, "sinks are float32");
    nb::gil_scoped_release release;
    sparse_attention_backward(args, options);
  });
}

}  // namespace

void bind_sparse(nb::module_& m) {
  m.def("sparse_forward", &forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("indices"),
        nb::arg("out"), nb::arg("lse").none(), nb::arg("options"), nb::arg("bhsd"), nb::arg("bfloat16_bits"),
        "qkv::sparse_attention_forward on the given arrays (as forward; indices int32/int64 "
        "[B, Nq, topk] or [B, Hkv, Nq, topk]); writes out and lse in place, GIL released.");
  m.def("sparse_backward", &backward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("indices"),
        nb::arg("out"), nb::arg("lse"), nb::arg("dout"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"),
        nb::arg("dsinks").none(), nb::arg("options"), nb::arg("bhsd"), nb::arg("bfloat16_bits"),
        "qkv::sparse_attention_backward on the given arrays; writes dq, dk, dv (and dsinks, "
        "float32 [Hq], with sinks) in place, GIL released.");
}

}  // namespace qkv::python
