// qkv::index_topk: validate once, pick the backend, run it into the caller's indices.
#include <new>
#include <type_traits>

#include "core/index_topk_problem.hpp"
#include "qkv/attention.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace {

template <class T>
void run_index_topk(const IndexTopkArgs<T>& args, const AttentionOptions& options) {
  const detail::IndexTopkProblem<T> problem = detail::validate_index_topk(args, options);
  const Backend backend = resolve_backend(options, std::is_same_v<T, double>, /*wants_weights=*/false);
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
