// The AMX tile state that every AMX kernel (amx_dot.cpp, amx_rows.cpp) shares: whether
// this process may use the tiles, and who loads and releases their configuration. All 8
// tiles are configured alike, 16 rows × 64 bytes (palette 1): a float32 tile of 16 × 16,
// a bfloat16 one of 16 × 32, or 16 rows of 16 pair words.
#pragma once

#include <cstddef>

namespace qkv::cpu::amx {

constexpr std::size_t kTileRows = 16;    // rows of every tile
constexpr std::size_t kTileValues = 32;  // bfloat16 values of a left operand's row (64 bytes)
constexpr std::size_t kTileWords = 16;   // words of a right operand's row (16 columns of pairs)

// Whether this CPU has AMX-TILE and AMX-BF16 and the OS lets this process use them
// (asked once; the answer is kept).
bool available();

// Keeps this thread's tile configuration loaded from construction to destruction, so
// that the products called in between skip their own ldtilecfg / tilerelease: that pair
// took 100–250 ns (an Emerald Rapids Xeon VM, family 6 model 207), against ~0.9 µs of
// tile products in a 64 × 64 block pair at d = 128. Only for stretches where no other
// code runs between the products: a user's score_mod / mask_mod may call into oneDNN,
// which loads its own configuration (or releases the tiles), so callers with hooks pass
// active = false and each product configures itself.
class TileScope {
 public:
  explicit TileScope(bool active);
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
  ~TileScope();

 private:
  bool owner_;
};

// For the kernels themselves: loads the configuration for one call unless a TileScope of
// this thread holds it, and releases the tiles at the end of the call if it loaded them.
class CallTiles {
 public:
  CallTiles();
  CallTiles(const CallTiles&) = delete;
  CallTiles& operator=(const CallTiles&) = delete;
  ~CallTiles();

 private:
  bool owner_;
};

}  // namespace qkv::cpu::amx
