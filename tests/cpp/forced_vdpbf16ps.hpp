// Tests: bfloat16 calls with Precision::fast forced onto AVX512-BF16's vdpbf16ps (the
// dot products on, the AMX tiles off), or onto the AMX tiles, for the object's lifetime —
// restored even when an ASSERT returns early. Only on a CPU that has the unit
// (cpu::cpu_has_bf16_dot(), cpu::cpu_has_amx_bf16()): elsewhere forcing it makes every
// bfloat16 call throw.
#pragma once

#include <optional>

#include "cpu/dot_products.hpp"

namespace qkv::test {

struct ForcedVdpbf16ps {
  ForcedVdpbf16ps() {
    cpu::set_dot_products_for_test(true);
    cpu::set_amx_for_test(false);
  }
  ForcedVdpbf16ps(const ForcedVdpbf16ps&) = delete;
  ForcedVdpbf16ps& operator=(const ForcedVdpbf16ps&) = delete;
  ~ForcedVdpbf16ps() {
    cpu::set_dot_products_for_test(std::nullopt);
    cpu::set_amx_for_test(std::nullopt);
  }
};

// The same with the AMX tiles forced on (only where cpu::cpu_has_amx_bf16()).
struct ForcedAmx {
  ForcedAmx() {
    cpu::set_dot_products_for_test(true);
    cpu::set_amx_for_test(true);
  }
  ForcedAmx(const ForcedAmx&) = delete;
  ForcedAmx& operator=(const ForcedAmx&) = delete;
  ~ForcedAmx() {
    cpu::set_dot_products_for_test(std::nullopt);
    cpu::set_amx_for_test(std::nullopt);
  }
};

}  // namespace qkv::test
