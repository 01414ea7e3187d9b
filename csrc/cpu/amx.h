// AMX tiles for our bf16 kernels (attention_bf16.cpp, linear_bf16.cpp): asking Linux for
// them, switching them in and out, and the one tile configuration both libraries' users load.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace blockserve_cpu {

// Linux hands AMX's tile state to a process only once asked.
inline bool request_tiles() {
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
  return __builtin_cpu_supports("amx-bf16") &&
         syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

// Whether this process may run AMX instructions (the CPU has them and Linux granted them).
inline bool tiles_available() {
  static const bool available = request_tiles();
  return available;
}

inline std::atomic<bool> tiles_wanted{true};

// Whether the kernels that have a tile path take it: available and not switched off.
inline bool use_tiles() {
  return tiles_wanted.load(std::memory_order_relaxed) && tiles_available();
}

// Tiles 0-7, each 16 rows of 64 bytes: 16×16 float32 results or 16 rows of 32 bf16.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Around one thread's work on the tiles: configured on entry (another library's kernels,
// oneDNN's, may have left them otherwise), released on exit.
struct TileScope {
  TileScope() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

}  // namespace blockserve_cpu
