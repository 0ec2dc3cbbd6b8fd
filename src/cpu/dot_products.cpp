// The dot-product switch of dot_products.hpp.
#include "cpu/dot_products.hpp"

#include <atomic>
#include <cstdlib>
#include <string>
#include <strings.h>

#include "cpu/amx_dot.hpp"
#include "qkv/error.hpp"

namespace qkv::cpu {
namespace {

enum class Choice { automatic, off, on };

Choice read_choice(const char* variable) {
  const char* wanted = std::getenv(variable);
  if (wanted == nullptr || *wanted == '\0' || strcasecmp(wanted, "auto") == 0) return Choice::automatic;
  if (strcasecmp(wanted, "off") == 0) return Choice::off;
  if (strcasecmp(wanted, "on") == 0) return Choice::on;
  throw Error(std::string(variable) + "=" + wanted + ": expected auto, on or off");
}

// Read once; a bad word throws on every call instead (the static stays unset).
Choice environment_choice() {
  static const Choice choice = read_choice("QKV_DOT_PRODUCTS");
  return choice;
}
Choice environment_amx_choice() {
  static const Choice choice = read_choice("QKV_AMX");
  return choice;
}

Choice environment_amx_rows_choice() {
  static const Choice choice = read_choice("QKV_AMX_ROWS");
  return choice;
}

// The test hooks: -1 the environment's choice, 0 off, 1 on.
std::atomic<int> forced_for_test{-1};
std::atomic<int> amx_forced_for_test{-1};
std::atomic<int> amx_rows_forced_for_test{-1};

Choice current_choice() {
  const int forced = forced_for_test.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1 ? Choice::on : Choice::off;
  return environment_choice();
}
Choice current_amx_choice() {
  const int forced = amx_forced_for_test.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1 ? Choice::on : Choice::off;
  return environment_amx_choice();
}

}  // namespace

bool bf16_dot_pays() {
  // Fixed per vendor, never timed, so that a call's bits never depend on a measurement.
  // AMD Zen 4/5 issue vdpbf16ps at the fp32 FMA's rate with twice its multiply-adds
  // (issue 23's measurements; on a Zen 5 EPYC, family 26, 442–444 GFLOP/s against 235–239
  // per core, and the bf16 forward and backward 1.0–1.4× faster with it, bench/RESULTS.md
  // §10). Intel's cores with AVX512-BF16 (Cooper Lake, Sapphire and
  // Emerald Rapids) issue it at a quarter of the FMA rate in multiply-adds: measured on
  // an Emerald Rapids Xeon, 86 GFLOP/s against 175 for fp32 FMAs per core, and the tiled
  // bf16 forward 1.8× (one bf16 P) to 2.5× (the two-term P) slower with it (bench/RESULTS.md
  // §10; again on a Granite-Rapids-class Xeon, 108 against 218). Those Xeons from Sapphire
  // Rapids on have the AMX tiles, which bf16_unit takes first; an Intel without them keeps
  // the fp32 FMAs.
#if defined(__x86_64__)
  static const bool pays = __builtin_cpu_is("amd");
  return pays;
#else
  return false;
#endif
}

bool cpu_has_bf16_dot() {
  // __builtin_cpu_supports reads CPUID (AVX512-BF16 implies AVX512F, BW and VL there);
  // "avx512f" also needs the OS to save the zmm state, which GCC's check includes.
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;  // bf16_dot.cpp has kernels for x86-64 only (NEON BF16 would be its own file)
#endif
}

bool cpu_has_amx_bf16() { return amx::available(); }

Bf16Unit bf16_unit(Precision precision) {
  const Choice choice = current_choice(), amx = current_amx_choice();
  if (choice == Choice::on && !cpu_has_bf16_dot())
    throw Error("QKV_DOT_PRODUCTS=on: this CPU has no AVX512-BF16 dot products");
  if (amx == Choice::on && !cpu_has_amx_bf16())
    throw Error("QKV_AMX=on: this CPU has no AMX-BF16 tiles (or the OS does not grant them)");
  if (precision == Precision::exact || choice == Choice::off) return Bf16Unit::fp32_fma;
  // The tiles pay wherever they exist (bench/RESULTS.md §10: on the Xeon measured, the
  // forward several times the fp32 FMAs' speed, where vdpbf16ps was slower than them).
  if (amx != Choice::off && cpu_has_amx_bf16()) return Bf16Unit::amx;
  if (cpu_has_bf16_dot() && (choice == Choice::on || bf16_dot_pays())) return Bf16Unit::avx512_bf16;
  return Bf16Unit::fp32_fma;
}

bool bf16_dot_products(Precision precision) { return bf16_unit(precision) != Bf16Unit::fp32_fma; }

bool cpu_has_int8_dot() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;  // int8_dot.cpp has kernels for x86-64 only (NEON's sdot would be its own file)
#endif
}

bool int8_dot_pays() {
  // Not yet on any CPU measured. vpdpbusd does 4× the fp32 FMAs' multiply-adds on both
  // (682 GOP/s against 171 GFLOP/s on an Emerald Rapids core, 963 against 239 on a Zen 5
  // core), yet the VNNI decode measured 0.67–1.13× the float32 one on the Intel and
  // 0.78–1.10× on the Zen 5 (bench/int8_dot_ab.sh, bench/RESULTS.md §10d): the two-term
  // splits, the per-block transposes and the int32 → float finish cost more than the
  // unit saves, and from DRAM (32k keys) the kernel waits on rows. Until a schedule that
  // streams as well as the float one is built, Precision::fast keeps the float32
  // arithmetic unless forced.
  return false;
}

bool int8_dot_products(Precision precision) {
  const Choice choice = current_choice();
  if (choice == Choice::on && !cpu_has_int8_dot())
    throw Error("QKV_DOT_PRODUCTS=on: this CPU has no AVX512-VNNI dot products");
  if (precision == Precision::exact || choice == Choice::off) return false;
  return cpu_has_int8_dot() && (choice == Choice::on || int8_dot_pays());
}

void set_dot_products_for_test(std::optional<bool> forced) {
  forced_for_test.store(forced ? (*forced ? 1 : 0) : -1, std::memory_order_relaxed);
}

void set_amx_for_test(std::optional<bool> forced) {
  amx_forced_for_test.store(forced ? (*forced ? 1 : 0) : -1, std::memory_order_relaxed);
}

bool amx_row_forward() {
  const int forced = amx_rows_forced_for_test.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1;
  return environment_amx_rows_choice() != Choice::off;
}

void set_amx_row_forward_for_test(std::optional<bool> forced) {
  amx_rows_forced_for_test.store(forced ? (*forced ? 1 : 0) : -1, std::memory_order_relaxed);
}

namespace {
std::atomic<std::size_t> row_tasks{0};
std::atomic<std::size_t> latent_spans{0};
}  // namespace

void count_amx_row_task() { row_tasks.fetch_add(1, std::memory_order_relaxed); }
std::size_t amx_row_tasks() { return row_tasks.load(std::memory_order_relaxed); }
void count_amx_latent_span() { latent_spans.fetch_add(1, std::memory_order_relaxed); }
std::size_t amx_latent_spans() { return latent_spans.load(std::memory_order_relaxed); }

const char* bf16_arithmetic_name() {
  switch (bf16_unit(Precision::fast)) {
    case Bf16Unit::amx: return "bf16-amx";
    case Bf16Unit::avx512_bf16: return "bf16-dot";
    default: return "fp32-fma";
  }
}

const char* int8_arithmetic_name() { return int8_dot_products(Precision::fast) ? "int8-dot" : "fp32-fma"; }

}  // namespace qkv::cpu
