// AMX tile plumbing the small-M kernels share (small_m_linear.cpp: bf16 tdpbf16ps;
// int8_linear.cpp: u8 x s8 tdpbusd).  Both kernels' panel layouts hold, per k-step of a
// 64-lane panel, 256 contiguous bytes: 64 lanes x 4 bytes (a bf16 k-pair or an int8 k-quad),
// which is AMX's VNNI layout for B, so a B tile -- 16 k-steps x 16 lanes, 16 rows of 64 bytes
// -- is read in place at a row stride of 256 bytes.  The tile set: 0-3 C (the group's rows x
// 16 lanes of 32-bit sums: a panel's 64 lanes), 4 A (the group's rows x 64 bytes of x), 5-6 B.
// Included only where the build targets AMX (-march=native on Sapphire Rapids and later).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pw_amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The process may use the tile data registers (Linux asks for it once: arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); false where the kernel refuses (the callers then
// run their AVX512 paths).
inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

constexpr int kGroupRows = 16;  // rows of an A / C tile
constexpr int64_t kStepBytes = 64;  // bytes of x per A tile row: 16 k-steps of 4 bytes

// Tiles 0-4 for `rows` rows of 64 bytes, 5-6 for 16 rows of 64 bytes (this thread).
inline void configure(int rows) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = 64;
  }
  for (int t = 5; t < 7; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// m rows in groups of at most kGroupRows whose sizes differ by at most one (17 -> 9 + 8).
struct Groups {
  int64_t count, base, extra;
  explicit Groups(int64_t m)
      : count((m + kGroupRows - 1) / kGroupRows),
        base(count ? m / count : 0),
        extra(count ? m % count : 0) {}
  int rows(int64_t g) const { return static_cast<int>(base + (g < extra ? 1 : 0)); }
};

// Every group of rows of one panel: fn(m0, rows), tiles (re)configured when the group height
// changes; `configured` is the height the thread's tiles hold (0: none yet).
template <class Fn>
inline void each_group(const Groups& g, int& configured, const Fn& fn) {
  for (int64_t j = 0, m0 = 0; j < g.count; ++j) {
    const int rows = g.rows(j);
    if (rows != configured) {
      configure(rows);
      configured = rows;
    }
    fn(m0, rows);
    m0 += rows;
  }
}

}  // namespace pw_amx
