// The AMX tile unit, shared by linear_bf16.cpp and prefill_bf16.cpp: TANDEM_AMX where the build has
// AMX-BF16 (with AVX512-BF16 for the epilogues), the process's permission to use the tile state, and
// the one tile shape both kernels use. Linux hands out the tile state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), asked once per process; where that fails the kernels
// run their AVX512-BF16 paths.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#define TANDEM_AMX 1

namespace tandem_amx {

inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// LDTILECFG's 64-byte operand, palette 1: tiles 0-7 each 16 rows of 64 bytes (16 float32 sums, 32
// bfloat16 inputs, or 16 pairs of bfloat16).
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// The calling thread's tiles, configured for its lifetime and released after.
struct Tiles {
  Tiles() { const Config cfg; _tile_loadconfig(&cfg); }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

}  // namespace tandem_amx
#endif
