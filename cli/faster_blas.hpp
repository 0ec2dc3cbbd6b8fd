// OpenBLAS reads OPENBLAS_CORETYPE only when it loads. When it has fallen back to its
// slowest kernels on a CPU it does not know (qkv::nn::faster_blas_coretype), the `qkv`
// program starts itself again with the variable set, once, before doing anything else.
#pragma once

namespace qkv::cli {

// Returns only if there is nothing to do or the restart failed (then the slow kernels
// run; results are the same, only slower).
void restart_for_faster_blas(char** argv);

}  // namespace qkv::cli
