// How qkv sizes its parallel regions to the way OpenMP's idle workers wait.
#pragma once

namespace qkv {

// Whether the OpenMP workers spin between parallel regions (libgomp's default with
// OMP_WAIT_POLICY unset: ~300 000 spins after each region; or OMP_WAIT_POLICY=active)
// instead of sleeping (passive). A region over sleeping workers first wakes them, which
// costs tens to hundreds of microseconds on a virtual machine, so qkv keeps small decode
// calls (under 1 MiB of cache a thread) on the calling thread; over spinning workers a
// second thread pays from 128 KiB (bench/RESULTS.md §6c). The default is false (as if
// they sleep); qkv's Python package sets it from the policy libgomp was loaded with.
// Changes speed only: results are the same for any thread count.
void set_idle_workers_spin(bool spin);
bool idle_workers_spin();

}  // namespace qkv
