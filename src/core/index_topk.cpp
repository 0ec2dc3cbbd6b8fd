// qkv::index_topk: validate once, pick the backend, run it into the caller's indices.
#include <new>
#include <type_traits>

#include "core/index_topk_problem.hpp"
#include "cpu/dot_products.hpp"
#include "qkv/attention.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace {

template <class T>
void run_index_topk(const IndexTopkArgs<T>& args, const AttentionOptions& options) {
  detail::IndexTopkProblem<T> problem = detail::validate_index_topk(args, options);
  const Backend backend = resolve_backend(options, std::is_same_v<T, double>, /*wants_weights=*/false);
  // vdpbf16ps where it is the unit a bfloat16 call with this precision takes (AMD's
  // AVX512-BF16; AMX Xeons keep the float32 FMAs here: the indexer has no tile kernel).
  if constexpr (std::is_same_v<T, bfloat16>)
    problem.bf16_dots = backend == Backend::cpu && cpu::bf16_unit(options.precision) == cpu::Bf16Unit::avx512_bf16;
  try {
    if constexpr (!std::is_same_v<T, double>) {
      if (backend == Backend::cpu) return cpu::index_topk(problem);
    }
    reference::index_topk(problem);
  } catch (const std::bad_alloc&) {
    throw Error("qkv::index_topk: out of memory for the running top-k's workspace");
  }
}

}  // namespace

void index_topk(const IndexTopkArgs<float>& args, const AttentionOptions& options) { run_index_topk(args, options); }
void index_topk(const IndexTopkArgs<double>& args, const AttentionOptions& options) { run_index_topk(args, options); }
void index_topk(const IndexTopkArgs<bfloat16>& args, const AttentionOptions& options) { run_index_topk(args, options); }
void index_topk(const IndexTopkArgs<float16>& args, const AttentionOptions& options) { run_index_topk(args, options); }

}  // namespace qkv
