// The Python package allocates every output in the caller's array type (in the caller's
// layout) and passes it here with the inputs and one Options object. These functions
// turn the arrays into views in qkv's logical [batch, seq, heads, dim] order (PyTorch's
// [batch, heads, seq, dim] is the same memory with two strides exchanged: no copy),
// release the GIL and call the library, which validates everything and writes straight
// into the caller's outputs. One call crosses the language boundary once.
#include "attention.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "arrays.hpp"
#include "debug.hpp"
#include "options.hpp"
#include "qkv/attention.hpp"
#include "stats.hpp"
#include "qkv/error.hpp"
#include "qkv/threads.hpp"

namespace qkv::python {
namespace {

constexpr const char* kAsQ = "the dtype of q";
// lse is float32 for 16-bit inputs (LseOf<T>), else q's dtype.
template <class T>
constexpr const char* kLseBecause =
    std::is_same_v<LseOf<T>, T> ? kAsQ : "lse is float32 for 16-bit inputs";

// The 4-D arrays of a call in the library's [batch, seq, heads, dim] order: PyTorch's
// [batch, heads, seq, dim] (`bhsd`) is the same memory with axes 1 and 2 exchanged.
ArrayRef logical(const char* name, nb::handle array, bool writable, bool bhsd) {
  const ArrayRef ref = ArrayRef::from(array, writable, name);
  return bhsd ? ref.swapped_1_2() : ref;
}

std::optional<ArrayRef> optional_array(const char* name, nb::handle array) {
  if (array.is_none()) return std::nullopt;
  return ArrayRef::from(array, true, name);
}

template <class T>
void forward_typed(const ArrayRef& q, const ArrayRef& k, const ArrayRef& v, const ArrayRef& out,
                   const std::optional<ArrayRef>& lse, const std::optional<ArrayRef>& weights,
                   const std::optional<nb::dict>& stats, const AttentionOptions& options,
                   bool bits) {
  ForwardArgs<T> args;
  args.q = view_of<const T, 4>("q", q, kAsQ, bits);
  args.k = view_of<const T, 4>("k", k, kAsQ, bits);
  args.v = view_of<const T, 4>("v", v, kAsQ, bits);
  args.out = view_of<T, 4>("out", out, kAsQ, bits);
  if (lse) args.lse = view_of<LseOf<T>, 3>("lse", *lse, kLseBecause<T>);
  if (weights) args.weights = view_of<T, 4>("weights", *weights, kAsQ, bits);
  AttentionStats<LseOf<T>> stats_out;  // float for 16-bit inputs, like lse
  if (stats) {
    stats_out = stats_views<LseOf<T>, 3>(*stats, kLseBecause<T>);
    args.stats = &stats_out;
  }

  if (debug_recording.load(std::memory_order_relaxed)) {
    debug_begin_call();
    debug_record("q", args.q);
    debug_record("k", args.k);
    debug_record("v", args.v);
    debug_record("out", args.out);
    debug_record("lse", args.lse);
    debug_record("weights", args.weights);
    debug_record_options(options);
  }

  nanobind::gil_scoped_release release;
  attention_forward(args, options);
}

template <class T>
void backward_typed(const ArrayRef& q, const ArrayRef& k, const ArrayRef& v, const ArrayRef& out,
                    const ArrayRef& lse, const ArrayRef& dout, const ArrayRef& dq,
                    const ArrayRef& dk, const ArrayRef& dv, const std::optional<ArrayRef>& dsinks,
                    const std::optional<ArrayRef>& dalibi, const AttentionOptions& options,
                    bool bits) {
  BackwardArgs<T> args;
  args.q = view_of<const T, 4>("q", q, kAsQ, bits);
  args.k = view_of<const T, 4>("k", k, kAsQ, bits);
  args.v = view_of<const T, 4>("v", v, kAsQ, bits);
  args.out = view_of<const T, 4>("out", out, kAsQ, bits);
  args.lse = view_of<const LseOf<T>, 3>("lse", lse, kLseBecause<T>);
  args.dout = view_of<const T, 4>("dout", dout, kAsQ, bits);
  args.dq = view_of<T, 4>("dq", dq, kAsQ, bits);
  args.dk = view_of<T, 4>("dk", dk, kAsQ, bits);
  args.dv = view_of<T, 4>("dv", dv, kAsQ, bits);
  args.dsinks = optional_float_span("dsinks", dsinks, "sinks are float32");
  args.dalibi_slopes = optional_float_span("dalibi_slopes", dalibi, "ALiBi slopes are float32");

  if (debug_recording.load(std::memory_order_relaxed)) {
    debug_begin_call();
    debug_record("q", args.q);
    debug_record("k", args.k);
    debug_record("v", args.v);
    debug_record("out", args.out);
    debug_record("lse", args.lse);
    debug_record("dout", args.dout);
    debug_record("dq", args.dq);
    debug_record("dk", args.dk);
    debug_record("dv", args.dv);
    debug_record_options(options);
  }

  nanobind::gil_scoped_release release;
  attention_backward(args, options);
}

// The storage type is q's dtype (float32, float64, float16, bfloat16), or bfloat16 for
// 16-bit integer arrays with `bfloat16_bits`; anything else is a TypeError naming q's
// dtype. Arguments are positional: this is the per-call path of qkv.attention.
void forward(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
             nb::handle weights, const std::optional<nb::dict>& stats,
             const BoundOptions& bound, bool bhsd, bool bfloat16_bits) {
  const Caller caller(bound.function.c_str());
  const ArrayRef qa = logical("q", q, false, bhsd), ka = logical("k", k, false, bhsd),
                 va = logical("v", v, false, bhsd), oa = logical("out", out, true, bhsd);
  const std::optional<ArrayRef> la = optional_array("lse", lse), wa = optional_array("weights", weights);
  const CallStorage call = call_storage(qa, bfloat16_bits);
  const AttentionOptions options = bound.for_call();
  with_storage(call, [&]<class T>() {
    forward_typed<T>(qa, ka, va, oa, la, wa, stats, options, call.bits);
  });
}

void backward(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
              nb::handle dout, nb::handle dq, nb::handle dk, nb::handle dv, nb::handle dsinks,
              const BoundOptions& bound, bool bhsd, bool bfloat16_bits, nb::handle dalibi) {
  const Caller caller(bound.function.c_str());
  const ArrayRef qa = logical("q", q, false, bhsd), ka = logical("k", k, false, bhsd),
                 va = logical("v", v, false, bhsd), oa = logical("out", out, false, bhsd),
                 la = ArrayRef::from(lse, false, "lse"), da = logical("dout", dout, false, bhsd),
                 dqa = logical("dq", dq, true, bhsd), dka = logical("dk", dk, true, bhsd),
                 dva = logical("dv", dv, true, bhsd);
  const std::optional<ArrayRef> dsa = optional_array("dsinks", dsinks);
  const std::optional<ArrayRef> daa = optional_array("dalibi_slopes", dalibi);
  const CallStorage call = call_storage(qa, bfloat16_bits);
  const AttentionOptions options = bound.for_call();
  with_storage(call, [&]<class T>() {
    backward_typed<T>(qa, ka, va, oa, la, da, dqa, dka, dva, dsa, daa, options, call.bits);
  });
}

// Whether `backend` can run a float32 call in this build: one 1×1×1×1 problem.
bool backend_available(const std::string& name) {
  AttentionOptions options;
  options.execution.backend = parse_backend(name);
  options.execution.threads = 1;
  const float one = 1.0f;
  float out = 0.0f;
  const View4<const float> unit(&one, {1, 1, 1, 1}, {1, 1, 1, 1});
  ForwardArgs<float> args;
  args.q = args.k = args.v = unit;
  args.out = View4<float>(&out, {1, 1, 1, 1}, {1, 1, 1, 1});
  try {
    attention_forward(args, options);
  } catch (const Error&) {
    return false;
  }
  return out == 1.0f;  // softmax over one key is 1, so out = v
}

}  // namespace

void bind_attention(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def("forward", &forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse").none(), nb::arg("weights").none(), nb::arg("stats").none(),
        nb::arg("options"), nb::arg("bhsd"), nb::arg("bfloat16_bits"),
        "qkv::attention_forward on the given arrays (NumPy arrays or torch tensors, read in "
        "place; bhsd: [batch, heads, seq, dim] order, else [batch, seq, heads, dim]); writes "
        "out, lse, weights and the stats dict's arrays in place. options: an Options. The "
        "GIL is released while computing. bfloat16_bits: 16-bit integer arrays hold bfloat16.");

  m.def("backward", &backward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("lse"), nb::arg("dout"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"),
        nb::arg("dsinks").none(), nb::arg("options"), nb::arg("bhsd"), nb::arg("bfloat16_bits"),
        nb::arg("dalibi_slopes").none() = nb::none(),
        "qkv::attention_backward on the given arrays (as for forward); writes dq, dk, dv (and "
        "dsinks, float32 [Hq], with sinks; dalibi_slopes, float32 [Hq], with ALiBi slopes) in "
        "place. The GIL is released while computing.");

  m.def("backend_available", &backend_available, nb::arg("backend"),
        "Whether this build runs the named backend ('auto', 'reference' or 'cpu').");
  m.def("set_idle_workers_spin", &qkv::set_idle_workers_spin, nb::arg("spin"),
        "qkv::set_idle_workers_spin: whether OpenMP's idle workers spin (qkv/threads.hpp); "
        "set at import from the policy libgomp was loaded with (qkv/_threads.py).");
  m.def("idle_workers_spin", &qkv::idle_workers_spin, "qkv::idle_workers_spin()");
}

}  // namespace qkv::python
