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

#include "panel_loop.h"

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

// Every group of rows of one panel, at most kGroupRows each, their sizes differing by at most
// one (17 -> 9 + 8): fn(m0, rows), the tiles (re)configured when the group height changes;
// `configured` is the height this thread's tiles hold (0: none yet).
template <class Fn>
inline void each_group(int64_t m, int& configured, const Fn& fn) {
  const pw_panel::RowPasses groups(m, kGroupRows);
  for (int64_t j = 0; j < groups.passes; ++j) {
    const int rows = static_cast<int>(groups.rows(j));
    if (rows != configured) {
      configure(rows);
      configured = rows;
    }
    fn(groups.start(j), rows);
  }
}

enum class Dot { kBF16, kInt8 };  // tdpbf16ps (bf16 pairs, fp32) / tdpbusd (u8 x s8, int32)

// C tiles c0 and c1 += A (tile 4) x B (tiles 5 and 6), by the kind of dot product D.  A macro:
// the tile intrinsics take their tile numbers as literals (they are spelled into the asm).
#if defined(__AMX_BF16__)
#define PW_AMX_DP_BF16(c, a, b) _tile_dpbf16ps(c, a, b)
#else
#define PW_AMX_DP_BF16(c, a, b) ((void)0)
#endif
#if defined(__AMX_INT8__)
#define PW_AMX_DP_INT8(c, a, b) _tile_dpbusd(c, a, b)
#else
#define PW_AMX_DP_INT8(c, a, b) ((void)0)
#endif
#define PW_AMX_DOT_PAIR(D, c0, c1)       \
  do {                                   \
    if constexpr (D == Dot::kBF16) {     \
      PW_AMX_DP_BF16(c0, 4, 5);          \
      PW_AMX_DP_BF16(c1, 4, 6);          \
    } else {                             \
      PW_AMX_DP_INT8(c0, 4, 5);          \
      PW_AMX_DP_INT8(c1, 4, 6);          \
    }                                    \
  } while (0)

constexpr int64_t kB = 256;  // bytes per k-step of a panel: a B tile's row stride
constexpr int64_t kStepWeightBytes = 16 * kB;  // one tile step of a panel: four B tiles

// Touch the 4096 bytes at `p` (the next tile step) with one plain load per 256 bytes, where
// they lie before `end`.  A step's B tiles go into the two tile registers the last step's dot
// products read, so its loads wait for them: tile loads alone kept few lines in flight, and a
// one-row call streamed its weight from DRAM 4-7% slower than the AVX512 path.  Plain loads
// into vector registers have no such wait: they start the next step's lines early, and the
// prefetchers bring the rest of each 256 bytes.  On a Xeon with AMX, weights from DRAM: bf16
// calls 3-4% faster at M = 1 and 8 than tile loads alone, every output's bits the same;
// software prefetch (prefetcht1, 2-16 steps ahead) was slower than these loads
// (experiments/bench/results/amx_touch_2026-12-06.md).
inline __m512i touch_step(const char* p, const char* end, __m512i sink) {
  if (p + kStepWeightBytes > end) return sink;
  for (int64_t r = 0; r < 16; ++r)
    sink = _mm512_or_si512(sink, _mm512_loadu_si512(p + r * kB));
  return sink;
}

// One panel's whole k-steps for a group's rows (tiles configured for them): C tiles 0-3 (lanes
// 0-15, 16-31, 32-47, 48-63) start at zero and take, per step, the A tile of the rows' next 64
// bytes of x (`a`, rows `a_stride` bytes apart) against the panel's next 16 k-steps (`w`, 4096
// bytes: four B tiles side by side); then they are stored to `out` (rows x 64 32-bit sums).
// `end` is one past the packed weight's last byte: the step after each one is touched early
// (touch_step) where it lies inside the weight.
template <Dot D>
inline void panel_steps(const void* a, int64_t a_stride, const void* w, int64_t steps,
                        void* out, const void* end) {
  const char* ac = static_cast<const char*>(a);
  const char* wc = static_cast<const char*>(w);
  const char* we = static_cast<const char*>(end);
  __m512i sink = _mm512_setzero_si512();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const char* ws = wc + s * kStepWeightBytes;
    sink = touch_step(ws + kStepWeightBytes, we, sink);
    _tile_loadd(4, ac + s * kStepBytes, a_stride);
    _tile_loadd(5, ws, kB);
    _tile_loadd(6, ws + 64, kB);
    PW_AMX_DOT_PAIR(D, 0, 1);
    _tile_loadd(5, ws + 128, kB);
    _tile_loadd(6, ws + 192, kB);
    PW_AMX_DOT_PAIR(D, 2, 3);
  }
  char* oc = static_cast<char*>(out);
  _tile_stored(0, oc, kB);
  _tile_stored(1, oc + 64, kB);
  _tile_stored(2, oc + 128, kB);
  _tile_stored(3, oc + 192, kB);
  asm volatile("" : : "v"(sink));  // the touches are kept: their value is "used"
}

}  // namespace pw_amx
