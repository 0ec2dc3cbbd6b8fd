// AttentionOptions from the Python keyword arguments. The arrays stay owned by Python;
// the options only point into them, so they live as long as the call that made them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "arrays.hpp"
#include "qkv/options.hpp"

namespace qkv::python {

struct OptionArgs {
  std::optional<InArray> keep;         // [B|1, H|1, Nq|1, Nk] bool or uint8
  std::optional<InArray> bias;         // [B|1, H|1, Nq|1, Nk] float32
  std::optional<InArray> key_lengths;  // [B] int64, contiguous
  std::optional<double> scale;
  std::string causal = "none";   // none | top_left | bottom_right
  std::string backend = "auto";  // auto | reference | cpu
  int threads = 0;
  bool check_finite = false;
  // Variants (qkv/options.hpp): inert defaults.
  int64_t window_left = -1, window_right = -1;
  std::optional<InArray> alibi_slopes;  // [Hq] float32, contiguous
  float softcap = 0.0f;
  std::optional<InArray> sinks;         // [Hq] float32, contiguous
  float dropout_p = 0.0f;
  std::uint64_t dropout_seed = 0, dropout_offset = 0;
};

AttentionOptions make_options(const OptionArgs& args);

// Fills the variant fields from keyword arguments (window_left, window_right,
// alibi_slopes, softcap, sinks, dropout_p, dropout_seed, dropout_offset); None = unset.
void add_variant_args(OptionArgs& args, const nanobind::kwargs& variants);

Backend parse_backend(const std::string& name);
Causal parse_causal(const std::string& name);

// Records the mask and key-length views of `options` for the zero-copy tests.
void debug_record_options(const AttentionOptions& options);

}  // namespace qkv::python
