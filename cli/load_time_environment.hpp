// Settings that the libraries under `qkv` read only when they load, so that a program
// can set them only by starting itself again: the `qkv` program does so once, before
// anything else, when one of them should differ from what it found.
//   OPENBLAS_CORETYPE  OpenBLAS has fallen back to its slowest kernels on a CPU it does
//                      not know (qkv::nn::faster_blas_coretype): set to the core it should
//                      take.
//   OMP_WAIT_POLICY    unset: "passive", so that OpenMP's idle threads sleep instead of
//                      spinning. On cores shared with other processes a spinning waiter
//                      takes the time the thread it waits for needs: `qkv demo` with one
//                      other busy process on 2 cores ran at 0.50× its --threads 1 speed
//                      with its default 2 threads, 0.97× with passive waiting (quiet,
//                      it costs ~8%: bench/demo_shared.sh, bench/RESULTS.md §6b). A value
//                      the user set is kept.
#pragma once

namespace qkv::cli {

// Returns only if there is nothing to change or the restart failed (then the program
// runs as it was started; results are the same, only slower).
void restart_with_load_time_environment(char** argv);

}  // namespace qkv::cli
