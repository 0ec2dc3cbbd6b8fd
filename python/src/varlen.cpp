// qkv::varlen_attention_forward / _backward for Python: packed [total, heads, dim] arrays
// and cu_seqlens (int32 or int64), read in place; outputs allocated by the caller.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "arrays.hpp"
#include "options.hpp"
#include "qkv/attention.hpp"
#include "stats.hpp"
#include "qkv/error.hpp"

namespace qkv::python {
namespace {

constexpr const char* kAsQ = "the dtype of q";
template <class T>
constexpr const char* kLseBecause =
    std::is_same_v<LseOf<T>, T> ? kAsQ : "lse is float32 for 16-bit inputs";

// A contiguous int32 or int64 vector as the library's SeqOffsets.
SeqOffsets offsets_of(const char* name, const InArray& array) {
  expect_cpu(name, array.device_type());
  expect_rank(name, array.ndim(), 1);
  if (array.size() > 1 && array.stride(0) != 1) {
    throw Error(Caller::named(name) + ": expected a contiguous array, got stride " +
                std::to_string(array.stride(0)));
  }
  const auto* data = static_cast<const char*>(array.data_handle()) + array.byte_offset();
  if (array.dtype() == nanobind::dtype<int32_t>())
    return std::span<const int32_t>(reinterpret_cast<const int32_t*>(data), array.size());
  if (array.dtype() == nanobind::dtype<int64_t>())
    return std::span<const int64_t>(reinterpret_cast<const int64_t*>(data), array.size());
  argument_type_error(name, "expected dtype int32 or int64, got " + dtype_name(array.dtype()));
}

template <class T>
void forward_typed(const ArrayRef& q, const ArrayRef& k, const ArrayRef& v, const ArrayRef& out,
                   const std::optional<ArrayRef>& lse, const InArray& cu_q, const InArray& cu_k,
                   int64_t max_q, int64_t max_k, const std::optional<nanobind::dict>& stats,
                   const AttentionOptions& options, bool bits) {
  VarlenForwardArgs<T> args;
  args.q = view_of<const T, 3>("q", q, kAsQ, bits);
  args.k = view_of<const T, 3>("k", k, kAsQ, bits);
  args.v = view_of<const T, 3>("v", v, kAsQ, bits);
  args.out = view_of<T, 3>("out", out, kAsQ, bits);
  if (lse) args.lse = view_of<LseOf<T>, 2>("lse", *lse, kLseBecause<T>);
  args.cu_seqlens_q = offsets_of("cu_seqlens_q", cu_q);
  args.cu_seqlens_k = offsets_of("cu_seqlens_k", cu_k);
  args.max_seqlen_q = max_q;
  args.max_seqlen_k = max_k;
  VarlenAttentionStats<LseOf<T>> stats_out;  // float for 16-bit inputs, like lse
  if (stats) {
    stats_out = stats_views<LseOf<T>, 2>(*stats, kLseBecause<T>);
    args.stats = &stats_out;
  }
  nanobind::gil_scoped_release release;
  varlen_attention_forward(args, options);
}

template <class T>
void backward_typed(const ArrayRef& q, const ArrayRef& k, const ArrayRef& v, const ArrayRef& out,
                    const ArrayRef& lse, const ArrayRef& dout, const ArrayRef& dq,
                    const ArrayRef& dk, const ArrayRef& dv, const InArray& cu_q,
                    const InArray& cu_k, int64_t max_q, int64_t max_k,
                    const std::optional<ArrayRef>& dsinks, const std::optional<ArrayRef>& dalibi,
                    const AttentionOptions& options, bool bits) {
  VarlenBackwardArgs<T> args;
  args.dsinks = optional_float_span("dsinks", dsinks, "sinks are float32");
  args.dalibi_slopes = optional_float_span("dalibi_slopes", dalibi, "ALiBi slopes are float32");
  args.q = view_of<const T, 3>("q", q, kAsQ, bits);
  args.k = view_of<const T, 3>("k", k, kAsQ, bits);
  args.v = view_of<const T, 3>("v", v, kAsQ, bits);
  args.out = view_of<const T, 3>("out", out, kAsQ, bits);
  args.lse = view_of<const LseOf<T>, 2>("lse", lse, kLseBecause<T>);
  args.dout = view_of<const T, 3>("dout", dout, kAsQ, bits);
  args.dq = view_of<T, 3>("dq", dq, kAsQ, bits);
  args.dk = view_of<T, 3>("dk", dk, kAsQ, bits);
  args.dv = view_of<T, 3>("dv", dv, kAsQ, bits);
  args.cu_seqlens_q = offsets_of("cu_seqlens_q", cu_q);
  args.cu_seqlens_k = offsets_of("cu_seqlens_k", cu_k);
  args.max_seqlen_q = max_q;
  args.max_seqlen_k = max_k;
  nanobind::gil_scoped_release release;
  varlen_attention_backward(args, options);
}

std::optional<ArrayRef> optional_array(const char* name, nanobind::handle array) {
  if (array.is_none()) return std::nullopt;
  return ArrayRef::from(array, true, name);
}

}  // namespace

void bind_varlen(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def(
      "varlen_forward",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, const InArray& cu_q,
         const InArray& cu_k, nb::handle lse, std::optional<nb::dict> stats,
         const BoundOptions& bound, nb::handle max_q_arg, nb::handle max_k_arg, bool bfloat16_bits) {
        const Caller caller(bound.function.c_str());
        const int64_t max_q = int64_argument("max_seqlen_q", max_q_arg),
                      max_k = int64_argument("max_seqlen_k", max_k_arg);
        const ArrayRef qa = ArrayRef::from(q, false, "q"), ka = ArrayRef::from(k, false, "k"),
                       va = ArrayRef::from(v, false, "v"), oa = ArrayRef::from(out, true, "out");
        const std::optional<ArrayRef> la = optional_array("lse", lse);
        const CallStorage call = call_storage(qa, bfloat16_bits);
        const AttentionOptions options = bound.for_call();
        with_storage(call, [&]<class T>() {
          forward_typed<T>(qa, ka, va, oa, la, cu_q, cu_k, max_q, max_k, stats, options,
                           call.bits);
        });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("cu_seqlens_q"),
      nb::arg("cu_seqlens_k"), nb::arg("lse").none(), nb::arg("stats").none(),
      nb::arg("options"), nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"),
      nb::arg("bfloat16_bits"),
      "qkv::varlen_attention_forward on packed [total, heads, dim] arrays; writes out (and "
      "lse [heads, total_q], and the stats dict's arrays) in place. options: an Options. "
      "The GIL is released while computing.");
  m.def(
      "varlen_backward",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
         nb::handle dout, nb::handle dq, nb::handle dk, nb::handle dv, const InArray& cu_q,
         const InArray& cu_k, nb::handle dsinks, const BoundOptions& bound, nb::handle max_q_arg,
         nb::handle max_k_arg, bool bfloat16_bits, nb::handle dalibi) {
        const Caller caller(bound.function.c_str());
        const int64_t max_q = int64_argument("max_seqlen_q", max_q_arg),
                      max_k = int64_argument("max_seqlen_k", max_k_arg);
        const ArrayRef qa = ArrayRef::from(q, false, "q"), ka = ArrayRef::from(k, false, "k"),
                       va = ArrayRef::from(v, false, "v"), oa = ArrayRef::from(out, false, "out"),
                       la = ArrayRef::from(lse, false, "lse"), da = ArrayRef::from(dout, false, "dout"),
                       dqa = ArrayRef::from(dq, true, "dq"), dka = ArrayRef::from(dk, true, "dk"),
                       dva = ArrayRef::from(dv, true, "dv");
        const std::optional<ArrayRef> dsa = optional_array("dsinks", dsinks);
        const std::optional<ArrayRef> daa = optional_array("dalibi_slopes", dalibi);
        const CallStorage call = call_storage(qa, bfloat16_bits);
        const AttentionOptions options = bound.for_call();
        with_storage(call, [&]<class T>() {
          backward_typed<T>(qa, ka, va, oa, la, da, dqa, dka, dva, cu_q, cu_k, max_q, max_k,
                            dsa, daa, options, call.bits);
        });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"),
      nb::arg("dout"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("cu_seqlens_q"),
      nb::arg("cu_seqlens_k"), nb::arg("dsinks").none(), nb::arg("options"),
      nb::arg("max_seqlen_q"), nb::arg("max_seqlen_k"), nb::arg("bfloat16_bits"),
      nb::arg("dalibi_slopes").none() = nb::none(),
      "qkv::varlen_attention_backward on packed arrays; writes dq, dk, dv (and dsinks, "
      "dalibi_slopes when given) in place.");
}

}  // namespace qkv::python
