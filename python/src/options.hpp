// qkv._qkv.Options: the options of one call, converted from Python once, here, and handed
// to the library as they are. Every entry point that takes options (attention, varlen,
// decode, KVCache.attend) takes this one object, and every field is set through one table
// in options.cpp: each value is type-checked and range-checked there, before it is
// narrowed to the library's type (an int that does not fit, a float that overflows
// float32, an empty per-head vector are qkv::Errors naming the field). The causal mode
// and backend are the library's enums, named by its one name table (qkv/names.hpp). The
// values themselves (threads >= 0, scale > 0, window >= -1, soft-cap, dropout p, the
// per-head vectors' lengths) are the library's to check when the call runs.
//
// Arrays (masks, key lengths, per-head vectors) are held as the caller's objects (NumPy
// arrays or torch tensors) and become views only when a call runs: an Options may be kept
// for a backward, and a tensor's memory may move in between (resize_).
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "qkv/block_sparse.hpp"
#include "qkv/options.hpp"

namespace qkv::python {

struct BoundOptions {
  AttentionOptions options;  // everything but the arrays below (spans and views empty)
  // The Python entry point the options were made for ("qkv.decode"): the bindings that take
  // them name it in their array checks' messages (Caller in arrays.hpp).
  std::string function = "qkv";
  nanobind::object keep, bias, key_lengths, alibi_slopes, sinks;  // None when not given
  // block_mask: (state, slot, bytes, block_q, block_k) as qkv.flex_attention builds it
  // (qkv/block_sparse.hpp), and the checked mask over those arrays, whose hook a call
  // gets as its mask_mod. The tuple holds the arrays; they are never resized.
  nanobind::object block_mask;
  std::shared_ptr<const BlockSparseMask> blocks;

  bool has_variants() const;
  // `options` with the arrays as views, for one call (the objects outlive it).
  AttentionOptions for_call() const;
};

// The library's enums and BoundOptions as qkv._qkv.Causal, Backend and Options.
void bind_options(nanobind::module_& m);

// From the name table; qkv::Error naming the argument otherwise.
Backend parse_backend(const std::string& name);

}  // namespace qkv::python
