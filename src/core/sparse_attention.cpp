// Sparse attention's entry points (qkv/sparse.hpp): validate once (core/validate_sparse.cpp),
// pick a backend as the dense call would, run it into the caller's outputs.
#include "qkv/sparse.hpp"

#include <new>
#include <string>
#include <type_traits>

#include "core/validate_sparse.hpp"
#include "cpu/sparse.hpp"
#include "qkv/error.hpp"
#include "reference/sparse.hpp"

namespace qkv {
namespace {

// A workspace the system cannot give is a qkv::Error, as for the dense entry points.
template <class Run>
void out_of_memory_as_error(const char* pass, Run&& run) {
  try {
    run();
  } catch (const std::bad_alloc&) {
    throw Error(std::string("qkv: out of memory for the sparse ") + pass + "'s workspace");
  }
}

// Validation has refused Backend::cpu for double.
template <class T>
void forward_entry(const SparseForwardArgs<T>& args, const AttentionOptions& options) {
  const auto problem = detail::validate(args, options);
  const Backend backend = resolve_backend(options, std::is_same_v<T, double>, false);
  out_of_memory_as_error("forward", [&] {
    if constexpr (!std::is_same_v<T, double>) {
      if (backend == Backend::cpu) return cpu::sparse_forward(problem);
    }
    reference::sparse_forward(problem);
  });
}

template <class T>
void backward_entry(const SparseBackwardArgs<T>& args, const AttentionOptions& options) {
  const auto problem = detail::validate(args, options);
  const Backend backend = resolve_backend(options, std::is_same_v<T, double>, false);
  out_of_memory_as_error("backward", [&] {
    if constexpr (!std::is_same_v<T, double>) {
      if (backend == Backend::cpu) return cpu::sparse_backward(problem);
    }
    reference::sparse_backward(problem);
  });
}

}  // namespace

#define QKV_DEFINE_SPARSE_ENTRY_POINTS(T)                                                          \
  void sparse_attention_forward(const SparseForwardArgs<T>& args, const AttentionOptions& options) {   \
    forward_entry(args, options);                                                                  \
  }                                                                                                \
  void sparse_attention_backward(const SparseBackwardArgs<T>& args, const AttentionOptions& options) { \
    backward_entry(args, options);                                                                 \
  }
QKV_DEFINE_SPARSE_ENTRY_POINTS(float)
QKV_DEFINE_SPARSE_ENTRY_POINTS(double)
QKV_DEFINE_SPARSE_ENTRY_POINTS(bfloat16)
QKV_DEFINE_SPARSE_ENTRY_POINTS(float16)
#undef QKV_DEFINE_SPARSE_ENTRY_POINTS

}  // namespace qkv
