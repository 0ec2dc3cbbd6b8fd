#include "options.hpp"

#include <nanobind/stl/string.h>

#include "debug.hpp"
#include "qkv/error.hpp"

namespace qkv::python {

Backend parse_backend(const std::string& name) {
  if (name == "auto") return Backend::automatic;
  if (name == "reference") return Backend::reference;
  if (name == "cpu") return Backend::cpu;
  throw Error("backend: expected 'auto', 'reference' or 'cpu', got '" + name + "'");
}

Causal parse_causal(const std::string& name) {
  if (name == "none") return Causal::none;
  if (name == "top_left") return Causal::top_left;
  if (name == "bottom_right") return Causal::bottom_right;
  throw Error("causal: expected None, 'top_left' or 'bottom_right', got '" + name + "'");
}

AttentionOptions make_options(const OptionArgs& args) {
  AttentionOptions options;
  options.scale = args.scale;
  options.causal = parse_causal(args.causal);
  options.execution.backend = parse_backend(args.backend);
  options.execution.threads = args.threads;
  options.execution.check_finite = args.check_finite;
  if (args.keep) options.mask.keep = byte_mask_view("mask", *args.keep);
  if (args.bias) {
    options.mask.bias =
        view_of<const float, 4>("mask", *args.bias, "an additive mask is added in float32");
  }
  options.window = {args.window_left, args.window_right};
  options.softcap = args.softcap;
  options.dropout = {.p = args.dropout_p, .seed = args.dropout_seed, .offset = args.dropout_offset};
  auto per_head = [](const char* name, const InArray& array) {
    const auto values = view_of<const float, 1>(name, array, "one float32 value per query head");
    if (values.shape[0] > 1 && values.strides[0] != 1) {
      throw Error(std::string(name) + ": expected a contiguous array, got stride " +
                  std::to_string(values.strides[0]));
    }
    return std::span<const float>(values.data, values.shape[0]);
  };
  if (args.alibi_slopes) options.alibi_slopes = per_head("alibi_slopes", *args.alibi_slopes);
  if (args.sinks) options.sinks = per_head("sinks", *args.sinks);
  if (args.key_lengths) {
    const auto lengths =
        view_of<const int64_t, 1>("key_lengths", *args.key_lengths, "one length per batch entry");
    if (lengths.shape[0] > 1 && lengths.strides[0] != 1) {
      throw Error("key_lengths: expected a contiguous array, got stride " +
                  std::to_string(lengths.strides[0]));
    }
    options.key_lengths = std::span<const int64_t>(lengths.data, lengths.shape[0]);
  }
  return options;
}

void add_variant_args(OptionArgs& args, const nanobind::kwargs& variants) {
  namespace nb = nanobind;
  for (auto [key, value] : variants) {
    const std::string name = nb::cast<std::string>(key);
    if (value.is_none()) continue;
    if (name == "window_left") args.window_left = nb::cast<int64_t>(value);
    else if (name == "window_right") args.window_right = nb::cast<int64_t>(value);
    else if (name == "alibi_slopes") args.alibi_slopes = nb::cast<InArray>(value);
    else if (name == "softcap") args.softcap = nb::cast<float>(value);
    else if (name == "sinks") args.sinks = nb::cast<InArray>(value);
    else if (name == "dropout_p") args.dropout_p = nb::cast<float>(value);
    else if (name == "dropout_seed") args.dropout_seed = nb::cast<std::uint64_t>(value);
    else if (name == "dropout_offset") args.dropout_offset = nb::cast<std::uint64_t>(value);
    else throw nb::type_error(("unexpected keyword argument '" + name + "'").c_str());
  }
}

void debug_record_options(const AttentionOptions& options) {
  debug_record("mask.keep", options.mask.keep);
  debug_record("mask.bias", options.mask.bias);
  if (!options.key_lengths.empty()) {
    const int64_t length = static_cast<int64_t>(options.key_lengths.size()), stride = 1;
    debug_record("key_lengths", options.key_lengths.data(), &length, &stride, 1);
  }
}

}  // namespace qkv::python
