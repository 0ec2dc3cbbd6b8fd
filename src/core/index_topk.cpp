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
  // The unit a bfloat16 call with this precision takes: vdpbf16ps (AVX512-BF16) or the
  // AMX tiles (Xeons, which kept the float32 FMAs here until 2026-12-06).
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (backend == Backend::cpu) {
      const cpu::Bf16Unit unit = cpu::bf16_unit(options.precision);
      problem.bf16_dots = unit != cpu::Bf16Unit::fp32_fma;
      problem.amx = unit == cpu::Bf16Unit::amx;
    }
  }
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
