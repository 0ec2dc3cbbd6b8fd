// The dot-product units' peaks, measured like the fp32 FMA peak (fma_probe.hpp): each
// thread runs independent vdpbf16ps (32 bf16 multiply-adds per zmm instruction),
// vpdpbusd (64 u8·s8 multiply-adds) or AMX tdpbf16ps (16·16·32 bf16 multiply-adds per
// tile instruction, 4 accumulator tiles) chains, nothing else. Counted as 2 operations per
// multiply-add (GFLOP/s for bf16, GOP/s for int8), so a kernel's "share of its own peak"
// compares like with like. gflops = 0 where the CPU lacks the instruction.
#pragma once

namespace qkv::bench {

enum class DotUnit { bf16, int8, amx_bf16 };

// Whether this CPU runs the unit's instruction (AVX512-BF16, AVX512-VNNI, AMX-BF16 with
// the OS's permission).
bool has_dot_unit(DotUnit unit);

// `threads` OpenMP threads by the wall clock, fastest of `repeats`.
double measure_dot_peak(DotUnit unit, int threads, long iterations, int repeats);

// One thread by its own CPU time (as measure_fma_peak_cpu_time).
double measure_dot_peak_cpu_time(DotUnit unit, long iterations, int repeats);

}  // namespace qkv::bench
