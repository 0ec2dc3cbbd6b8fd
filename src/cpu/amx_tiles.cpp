// The tile state of amx_tiles.hpp.
#include "cpu/amx_tiles.hpp"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace qkv::cpu::amx {

bool available() {
  static const bool granted = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
    const bool avx512_bf16 = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl");
    if (!amx_bf16 || !amx_tile || !avx512_bf16) return false;
    // Linux enables the 8 KiB tile state per process on request (XFEATURE_XTILEDATA = 18);
    // a kernel without the request, or one that refuses, leaves AMX unusable.
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return granted;
}

}  // namespace qkv::cpu::amx

#pragma GCC push_options
#pragma GCC target("amx-tile")

namespace qkv::cpu::amx {
namespace {

// Palette 1, all 8 tiles 16 rows × 64 bytes (the layout of ldtilecfg's 64-byte operand).
struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t bytes_per_row[16] = {};
  std::uint8_t rows[16] = {};
};

// In static storage: GCC 12's _tile_loadconfig tells the compiler it reads only the first
// 8 bytes of its operand, so a configuration built on the stack just before it may lose
// its row sizes to dead-store elimination (seen: palette 1 with every tile 0 × 0, and
// SIGILL at the first tile instruction).
constexpr TileConfig kTileConfig = [] {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  return config;
}();

void load_configuration() { _tile_loadconfig(&kTileConfig); }
void release_tiles() { _tile_release(); }

}  // namespace
}  // namespace qkv::cpu::amx

#pragma GCC pop_options

// The members are declared outside the target pragma (the header), so the intrinsics stay
// in the functions above.
namespace qkv::cpu::amx {
namespace {
// Whether a TileScope of this thread holds the configuration now.
thread_local bool tiles_held = false;
}  // namespace

TileScope::TileScope(bool active) : owner_(active && available() && !tiles_held) {
  if (!owner_) return;
  load_configuration();
  tiles_held = true;
}

TileScope::~TileScope() {
  if (!owner_) return;
  release_tiles();
  tiles_held = false;
}

CallTiles::CallTiles() : owner_(!tiles_held) {
  if (owner_) load_configuration();
}

CallTiles::~CallTiles() {
  if (owner_) release_tiles();
}

}  // namespace qkv::cpu::amx

#else  // not x86-64: available() is false, so no kernel ever asks for the tiles.

namespace qkv::cpu::amx {
bool available() { return false; }
TileScope::TileScope(bool) : owner_(false) {}
TileScope::~TileScope() = default;
CallTiles::CallTiles() : owner_(false) {}
CallTiles::~CallTiles() = default;
}  // namespace qkv::cpu::amx
#endif
