// qkv._qkv.decode and qkv._qkv.KVCache (see decode.cpp).
#pragma once

#include <nanobind/nanobind.h>

#include <optional>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "qkv/half.hpp"
#include "qkv/tensor.hpp"

namespace qkv::python {

void bind_decode(nanobind::module_& m);

// Shared with batch_plan.cpp: the cache arrays' conventions.
StorageType parse_storage(const std::string& name);
// The storage type of a cache array: its own dtype, or `bits_as` for 16-bit integers.
StorageType cache_storage(const char* name, const ArrayRef& array, const std::string& bits_as);
// A block table as int32 (other integer dtypes copied into `storage`, each id checked to
// fit int32 first; `function` names the entry point in the error).
TensorView<const int32_t, 2> block_table_view(const ArrayRef& table, std::vector<int32_t>& storage,
                                              const char* function);
std::optional<ArrayRef> optional_in(const char* name, nanobind::handle array);

}  // namespace qkv::python
