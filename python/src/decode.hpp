// qkv._qkv.decode and qkv._qkv.KVCache (see decode.cpp).
#pragma once

#include <nanobind/nanobind.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "qkv/half.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/tensor.hpp"

namespace qkv::python {

void bind_decode(nanobind::module_& m);

// What a qkv._qkv.KVCache Python object holds: the cache through a shared_ptr. The NumPy
// views of its memory (key_storage, scales, block_table, ...) hold another one, not the
// Python object: PyTorch does not free an autograd graph still alive when the interpreter
// exits, and a view such a graph saved (a torch tensor over KVCache.torch_storage())
// would otherwise keep this object alive past finalization, where nanobind reports it
// as leaked (issue 43, 5). The memory lives as long as the last view either way.
struct CacheObject {
  std::shared_ptr<KVCache> cache;
};

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
