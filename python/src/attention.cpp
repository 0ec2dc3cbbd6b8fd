// The Python package allocates every output in the caller's array type and passes it
// here with the inputs, all already in qkv's logical [batch, seq, heads, dim] order
// (a transposed view for PyTorch's [batch, heads, seq, dim] memory: no copy). These
// functions turn the arrays into views, release the GIL and call the library, which
// validates everything and writes straight into the caller's outputs.
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

namespace qkv::python {
namespace {

constexpr const char* kAsQ = "the dtype of q";
// lse is float32 for 16-bit inputs (LseOf<T>), else q's dtype.
template <class T>
constexpr const char* kLseBecause =
    std::is_same_v<LseOf<T>, T> ? kAsQ : "lse is float32 for 16-bit inputs";

template <class T>
void forward_typed(const InArray& q, const InArray& k, const InArray& v, const OutArray& out,
                   const std::optional<OutArray>& lse, const std::optional<OutArray>& weights,
                   const std::optional<nanobind::dict>& stats, const AttentionOptions& options,
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

  debug_begin_call();
  debug_record("q", args.q);
  debug_record("k", args.k);
  debug_record("v", args.v);
  debug_record("out", args.out);
  debug_record("lse", args.lse);
  debug_record("weights", args.weights);
  debug_record_options(options);

  nanobind::gil_scoped_release release;
  attention_forward(args, options);
}

template <class T>
void backward_typed(const InArray& q, const InArray& k, const InArray& v, const InArray& out,
                    const InArray& lse, const InArray& dout, const OutArray& dq,
                    const OutArray& dk, const OutArray& dv, const std::optional<OutArray>& dsinks,
                    const AttentionOptions& options, bool bits) {
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
  if (dsinks) {
    const auto view = view_of<float, 1>("dsinks", *dsinks, "sinks are float32");
    args.dsinks = std::span<float>(view.data, static_cast<std::size_t>(view.shape[0]));
  }

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

  nanobind::gil_scoped_release release;
  attention_backward(args, options);
}

// The storage type is q's dtype (float32, float64, float16, DLPack bfloat16), or the
// one `storage` names for 16-bit integer arrays holding its bits; anything else is a
// TypeError naming q's dtype.
void forward(const InArray& q, const InArray& k, const InArray& v, const OutArray& out,
             const std::optional<OutArray>& lse, const std::optional<OutArray>& weights,
             const std::optional<nanobind::dict>& stats, const OptionArgs& option_args,
             const std::string& storage) {
  const CallStorage call = call_storage(q, storage);
  const AttentionOptions options = make_options(option_args);
  with_storage(call, [&]<class T>() {
    forward_typed<T>(q, k, v, out, lse, weights, stats, options, call.bits);
  });
}

void backward(const InArray& q, const InArray& k, const InArray& v, const InArray& out,
              const InArray& lse, const InArray& dout, const OutArray& dq, const OutArray& dk,
              const OutArray& dv, const std::optional<OutArray>& dsinks,
              const OptionArgs& option_args, const std::string& storage) {
  const CallStorage call = call_storage(q, storage);
  const AttentionOptions options = make_options(option_args);
  with_storage(call, [&]<class T>() {
    backward_typed<T>(q, k, v, out, lse, dout, dq, dk, dv, dsinks, options, call.bits);
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

// The option keywords shared by forward and backward, in one place.
OptionArgs option_args(std::optional<InArray> keep, std::optional<InArray> bias,
                       std::optional<InArray> key_lengths, std::optional<double> scale,
                       std::string causal, std::string backend, int threads,
                       bool check_finite, const nanobind::kwargs& variants) {
  OptionArgs args{std::move(keep), std::move(bias), std::move(key_lengths), scale,
                  std::move(causal), std::move(backend), threads, check_finite};
  add_variant_args(args, variants);
  return args;
}

}  // namespace

void bind_attention(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def(
      "forward",
      [](const InArray& q, const InArray& k, const InArray& v, const OutArray& out,
         std::optional<OutArray> lse, std::optional<OutArray> weights,
         std::optional<InArray> keep, std::optional<InArray> bias,
         std::optional<InArray> key_lengths, std::optional<double> scale, std::string causal,
         std::string backend, int threads, bool check_finite, std::string storage,
         std::optional<nb::dict> stats, const nb::kwargs& variants) {
        forward(q, k, v, out, lse, weights, stats,
                option_args(std::move(keep), std::move(bias), std::move(key_lengths), scale,
                            std::move(causal), std::move(backend), threads, check_finite,
                            variants),
                storage);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::kw_only(),
      nb::arg("lse").none() = nb::none(), nb::arg("weights").none() = nb::none(),
      nb::arg("keep").none() = nb::none(), nb::arg("bias").none() = nb::none(),
      nb::arg("key_lengths").none() = nb::none(), nb::arg("scale").none() = nb::none(),
      nb::arg("causal") = "none", nb::arg("backend") = "auto", nb::arg("threads") = 0,
      nb::arg("check_finite") = false, nb::arg("storage") = "",
      nb::arg("stats").none() = nb::none(), nb::arg("variants"),
      "qkv::attention_forward on [B, N, H, d] views of the given arrays; writes out, lse, "
      "weights and the stats dict's arrays in place. The GIL is released while computing. "
      "storage: '' (q's dtype) or 'bfloat16'/'float16' for 16-bit integer arrays holding "
      "those bits. Further keywords: the variants (window_left, window_right, alibi_slopes, "
      "softcap, sinks, dropout_p, dropout_seed, dropout_offset).");

  m.def(
      "backward",
      [](const InArray& q, const InArray& k, const InArray& v, const InArray& out,
         const InArray& lse, const InArray& dout, const OutArray& dq, const OutArray& dk,
         const OutArray& dv, std::optional<InArray> keep, std::optional<InArray> bias,
         std::optional<InArray> key_lengths, std::optional<double> scale, std::string causal,
         std::string backend, int threads, bool check_finite, std::optional<OutArray> dsinks,
         std::string storage, const nb::kwargs& variants) {
        backward(q, k, v, out, lse, dout, dq, dk, dv, dsinks,
                 option_args(std::move(keep), std::move(bias), std::move(key_lengths), scale,
                             std::move(causal), std::move(backend), threads, check_finite,
                             variants),
                 storage);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"),
      nb::arg("dout"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::kw_only(),
      nb::arg("keep").none() = nb::none(), nb::arg("bias").none() = nb::none(),
      nb::arg("key_lengths").none() = nb::none(), nb::arg("scale").none() = nb::none(),
      nb::arg("causal") = "none", nb::arg("backend") = "auto", nb::arg("threads") = 0,
      nb::arg("check_finite") = false, nb::arg("dsinks").none() = nb::none(),
      nb::arg("storage") = "", nb::arg("variants"),
      "qkv::attention_backward on [B, N, H, d] views; writes dq, dk, dv (and dsinks, "
      "float32 [Hq], with sinks) in place. The GIL is released while computing. storage: "
      "as for forward.");

  m.def("backend_available", &backend_available, nb::arg("backend"),
        "Whether this build runs the named backend ('auto', 'reference' or 'cpu').");
}

}  // namespace qkv::python
