// Whether the fused kernels may use the CPU's dot-product units (AVX512-BF16's
// vdpbf16ps for bfloat16 storage, AVX512-VNNI's vpdpbusd for decode over int8 caches):
// detected once per process, switchable for tests.
//
// A call uses them when its options.precision is Precision::fast, its storage type has
// such a unit here, the unit is faster than the float32 FMAs it replaces on this CPU
// (bf16_dot_pays, int8_dot_pays) and the switch allows it. The switch is the environment variable
// QKV_DOT_PRODUCTS (read once, at the first kernel call; case-insensitive):
//   auto (or unset)  use them where the CPU has them and they pay
//   off              never: every call computes as Precision::exact does
//   on               always: a CPU without them makes every call throw qkv::Error
// and, for tests, set_dot_products_for_test (which wins over the environment). Like
// QKV_SIMD_TARGET it changes arithmetic, never which calls are accepted.
//
// For bfloat16 there are two units: AVX512-BF16's vdpbf16ps (bf16_dot.hpp) and, on Intel
// from Sapphire Rapids on, the AMX tiles (amx_dot.hpp), which take the same operands. A
// call that takes the dot products takes the tiles where the CPU has them, unless
// QKV_AMX says otherwise (read once; case-insensitive):
//   auto (or unset)  the tiles where the CPU and OS have them
//   off              never (vdpbf16ps, where QKV_DOT_PRODUCTS lets the dot products run)
//   on               always: a CPU without them makes every bfloat16 call throw
// and set_amx_for_test. So on an AMX machine both units are tested: QKV_DOT_PRODUCTS=on
// with QKV_AMX=off forces vdpbf16ps, with QKV_AMX=on the tiles.
#pragma once

#include <cstddef>
#include <optional>

#include "qkv/options.hpp"

namespace qkv::cpu {

// Whether this CPU (and OS) runs the AVX512-BF16 kernels (bf16_dot.hpp).
bool cpu_has_bf16_dot();

// Whether vdpbf16ps beats the fp32 FMAs here: a fixed table by vendor (AMD yes, Intel
// no — measured, see dot_products.cpp), never a timing, so bits never depend on load.
bool bf16_dot_pays();

// Whether this CPU has AMX-BF16 tiles that the OS grants this process (amx_dot.hpp).
bool cpu_has_amx_bf16();

// The arithmetic of a bfloat16 call: the float32 FMAs (Precision::exact's), vdpbf16ps,
// or the AMX tiles. Throws qkv::Error when QKV_DOT_PRODUCTS=on or QKV_AMX=on (or their
// test hooks) ask for units the CPU lacks, or either variable holds another word.
enum class Bf16Unit { fp32_fma, avx512_bf16, amx };
Bf16Unit bf16_unit(Precision precision);

// Whether a call with this precision on bfloat16 storage takes the dot-product kernels
// (either unit: bf16_unit(precision) != fp32_fma).
bool bf16_dot_products(Precision precision);

// Whether this CPU (and OS) runs the AVX512-VNNI kernels (int8_dot.hpp).
bool cpu_has_int8_dot();

// Whether the VNNI decode beats the float32 one here (no CPU yet: see dot_products.cpp).
bool int8_dot_pays();

// Whether a decode call with this precision over an int8 cache takes the VNNI kernels.
// Throws as bf16_dot_products does (QKV_DOT_PRODUCTS=on where the CPU has no VNNI).
bool int8_dot_products(Precision precision);

// Tests: nullopt restores the environment's choice; true / false force either path
// (true on a CPU without the units makes calls throw, as QKV_DOT_PRODUCTS=on does).
void set_dot_products_for_test(std::optional<bool> forced);
// The same for QKV_AMX: true forces the tiles (throwing where there are none), false
// keeps bfloat16 dot products on vdpbf16ps, nullopt restores the environment's choice.
void set_amx_for_test(std::optional<bool> forced);

// On the AMX tiles, the forward takes the row kernel (forward_rows-inl.h: 512-key spans, P
// query-major) where the call allows it, unless QKV_AMX_ROWS=off (read once; auto or on:
// where allowed) or the test hook says otherwise: false keeps every call on the block
// kernel of forward.cpp, which the backward and the calls the row kernel does not take use
// (and the latent decode on the column step, decode_latent-inl.h's LatentBlock).
bool amx_row_forward();
void set_amx_row_forward_for_test(std::optional<bool> forced);
// Forward tasks the row kernel has run in this process (a relaxed count, one add per task
// of ≥ 64 × 64 × d products): lets tests see that a call took it.
void count_amx_row_task();
std::size_t amx_row_tasks();
// The same for the latent decode's spans (decode_latent-inl.h's LatentSpan, one add per
// span of up to 512 keys), which the same switch governs: off keeps the column step.
void count_amx_latent_span();
std::size_t amx_latent_spans();

// "bf16-amx", "bf16-dot" or "fp32-fma": what a bfloat16 call in the default precision
// runs, for benchmarks and `qkv bench`.
const char* bf16_arithmetic_name();
// "int8-dot" or "fp32-fma": the same for decode over int8 caches.
const char* int8_arithmetic_name();

}  // namespace qkv::cpu
