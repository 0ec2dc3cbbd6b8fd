#include "options.hpp"

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

void debug_record_options(const AttentionOptions& options) {
  debug_record("mask.keep", options.mask.keep);
  debug_record("mask.bias", options.mask.bias);
  if (!options.key_lengths.empty()) {
    const int64_t length = static_cast<int64_t>(options.key_lengths.size()), stride = 1;
    debug_record("key_lengths", options.key_lengths.data(), &length, &stride, 1);
  }
}

}  // namespace qkv::python
