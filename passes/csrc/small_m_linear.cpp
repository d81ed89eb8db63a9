// Small-M linear (see passes/small_m_linear.py for the contract): y = x @ W^T (+ bias) for the
// few rows of a decode step, streaming the weight once at close to memory bandwidth.
//
// bfloat16 x, W, bias and y; fp32 accumulation; y rounded to nearest even (as torch does).
// The weight is re-laid out once (in Python) into panels of 64 output features:
//   packed[p][i][j][t] = W[64 p + j][2 i + t]    p < ceil(N/64), i < ceil(K/2), j < 64, t < 2
// zero-padded in N and K, so one k-pair of a panel is 256 contiguous bytes (four 16-lane
// vectors) and a panel is one contiguous stream.  With AVX512-BF16 (vdpbf16ps) each vector
// of a k-pair meets the broadcast pair (x[2i], x[2i+1]) of each row: 16 outputs x 2 products
// per instruction, no horizontal reductions.  Any number of rows: up to 6 share one pass over
// a panel (24 accumulators in registers); more rows take further passes over k-blocks of the
// panel that are then in L1/L2, so the weight is streamed from memory once for all M rows.
// Panels are split over OpenMP threads (the loop is csrc/panel_loop.h, shared with the int8
// kernels).  One row (a batch-1 decode step) takes its own loop: each thread reads its panels
// two at a time, from the two halves of its share (panel_pair_m1; AVX2: four parts, two
// k-pairs of each in turn, run_share_m1), so that several weight streams per thread are in
// flight; every output keeps its operations and their order, hence its bits.
// The greedy entry (an LM head in a greedy decode step) adds an epilogue: each thread scans the
// outputs it has just stored for each row's first maximum (framework/core/csrc/row_argmax.h),
// and the ranges are folded in column order, so the sampler needs no pass over the logits.
//
// No torch headers: a C ABI on data pointers, called through ctypes (framework/core/
// native_build.py builds it with -O3 -march=native, or portable -O3 where that fails) or from
// the piecewise torch ops (csrc/torch_ops.cpp includes this file, hence the named namespace).
// The portable path runs the same layout with plain loops the compiler vectorises.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../framework/core/csrc/bf16.h"
#include "../../framework/core/csrc/row_argmax.h"
#include "panel_loop.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#define PW_AVX512BF16 1
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PW_AMX 1
#include "amx_tiles.h"
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define PW_AVX2 1
#include <immintrin.h>
#endif

namespace pw_small_m {

constexpr int kLanes = 64;                             // output features per panel
constexpr int kMaxRows = pw_panel::kMaxTileRows;       // rows per pass over a panel
constexpr int64_t kBlockPairs = 256;  // k-pairs per block (64 KB of a panel) with several passes
constexpr int64_t kParallelMinBytes = pw_panel::kParallelMinBytes;
static_assert(kMaxRows == 6, "panel<1..6> below");

using pw_bf16::bf16_to_f32;
using pw_bf16::f32_to_bf16;

struct Args {
  const uint16_t* x;
  int64_t x_st;
  int64_t m;
  const uint16_t* w;  // packed
  const uint16_t* bias;
  uint16_t* out;
  int64_t out_st;
  int64_t n;
  int64_t k;
  // set once per call by `run` (prepare_passes): the most rows a pass takes, and on AVX2,
  // where a pass takes a wide tile, x widened to fp32 (row stride k)
  int64_t most = pw_panel::kMaxTileRows;
  const float* xf = nullptr;
};

// The epilogue of the panels whose partial sums end in memory (AVX2, portable): rows
// [m0, m0 + MR) of panel p, acc MR x 64: add the bias, round once, store the valid lanes.
template <int MR>
inline void store_rows(const Args& a, int64_t p, int64_t m0, const float* acc) {
  const int64_t n0 = p * kLanes;
  const int64_t valid = std::min<int64_t>(kLanes, a.n - n0);
  for (int r = 0; r < MR; ++r) {
    uint16_t* y = a.out + (m0 + r) * a.out_st + n0;
    for (int64_t j = 0; j < valid; ++j)
      y[j] = f32_to_bf16(acc[r * kLanes + j] + (a.bias ? bf16_to_f32(a.bias[n0 + j]) : 0.0f));
  }
}

// One pass of MR rows (from m0) over k-pairs [i0, i1) of panel p.  `first`: start from zero,
// else from the partial sums in `buf` (MR x 64 floats); `last`: add the bias, round and store
// the outputs, else leave the partial sums in `buf`; `pf`: the k-pairs of the next block to
// prefetch (csrc/panel_loop.h).
#if defined(PW_AVX512BF16)

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// Row `row`'s 64 sums of panel p (four vectors): add the bias, round once to bf16, store the
// valid lanes.
inline void store_row_vectors(const Args& a, int64_t p, int64_t row, const __m512* acc) {
  const int64_t n0 = p * kLanes;
  for (int b = 0; b < 4; ++b) {
    const int64_t left = a.n - n0 - 16 * b;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    __m512 bias = _mm512_setzero_ps();
    if (a.bias) {
      const __m256i hb = _mm256_maskz_loadu_epi16(mask, a.bias + n0 + 16 * b);
      bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hb), 16));
    }
    const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(acc[b], bias));
    _mm256_mask_storeu_epi16(a.out + row * a.out_st + n0 + 16 * b, mask, (__m256i)y);
  }
}

template <int MR>
void panel_pf(const Args& a, int64_t p, int64_t m0, int64_t i0, int64_t i1, float* buf,
              bool first, bool last, const pw_panel::Prefetch& pf) {
  const int64_t kp = (a.k + 1) / 2, full = std::min(i1, a.k / 2);
  const uint16_t* w = a.w + p * kp * 2 * kLanes;
  const uint16_t* x = a.x + m0 * a.x_st;
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < 4; ++b)
      acc[r][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(buf + r * kLanes + 16 * b);
  const uint16_t* next = w + (i1 - i0) * 2 * kLanes;  // + i * 2 * kLanes: step i1 + (i - i0)
  int64_t turn = pf.phase;
  for (int64_t i = i0; i < full; ++i) {
    const uint16_t* wi = w + i * 2 * kLanes;
    if (pf.every) {
      if (turn == 0) pw_panel::prefetch_step(next + i * 2 * kLanes);
      if (++turn == pf.every) turn = 0;
    }
    const __m512bh w0 = as_bh(_mm512_loadu_si512(wi));
    const __m512bh w1 = as_bh(_mm512_loadu_si512(wi + 32));
    const __m512bh w2 = as_bh(_mm512_loadu_si512(wi + 64));
    const __m512bh w3 = as_bh(_mm512_loadu_si512(wi + 96));
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * a.x_st + 2 * i, 4);
      const __m512bh xb = as_bh(_mm512_set1_epi32(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
    }
  }
  if ((a.k & 1) && i1 == kp) {  // last k alone; its partner in the packed weight is zero
    const uint16_t* wi = w + (kp - 1) * 2 * kLanes;
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = as_bh(_mm512_set1_epi32(x[r * a.x_st + a.k - 1]));
      for (int b = 0; b < 4; ++b)
        acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xb, as_bh(_mm512_loadu_si512(wi + 32 * b)));
    }
  }
  if (!last) {
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < 4; ++b) _mm512_storeu_ps(buf + r * kLanes + 16 * b, acc[r][b]);
    return;
  }
  for (int r = 0; r < MR; ++r) store_row_vectors(a, p, m0 + r, acc[r]);
}

// Panels p and q for one row (row 0), every k-pair, side by side: two weight streams per
// thread.  The packed panels of a thread are one contiguous stream; the hardware
// prefetchers keep more bytes in flight over two (the read probe on 2 MB pages, one thread's
// share read as 1 / 2 / 4 streams: 40.4 / 42.0 / 43.4 GB/s).  Each output sees the same
// operations in the same order as in panel_pf<1>, so the bits are the same.
void panel_pair_m1(const Args& a, int64_t p, int64_t q) {
  const int64_t kp = (a.k + 1) / 2, full = a.k / 2;
  const uint16_t* wp = a.w + p * kp * 2 * kLanes;
  const uint16_t* wq = a.w + q * kp * 2 * kLanes;
  __m512 ap[4], aq[4];
  for (int b = 0; b < 4; ++b) ap[b] = aq[b] = _mm512_setzero_ps();
  for (int64_t i = 0; i < full; ++i) {
    int32_t pair;
    std::memcpy(&pair, a.x + 2 * i, 4);
    const __m512bh xb = as_bh(_mm512_set1_epi32(pair));
    const uint16_t* pi = wp + i * 2 * kLanes;
    const uint16_t* qi = wq + i * 2 * kLanes;
    for (int b = 0; b < 4; ++b) {
      ap[b] = _mm512_dpbf16_ps(ap[b], xb, as_bh(_mm512_loadu_si512(pi + 32 * b)));
      aq[b] = _mm512_dpbf16_ps(aq[b], xb, as_bh(_mm512_loadu_si512(qi + 32 * b)));
    }
  }
  if (a.k & 1) {  // last k alone; its partner in the packed weight is zero
    const __m512bh xb = as_bh(_mm512_set1_epi32(a.x[a.k - 1]));
    const uint16_t* pi = wp + (kp - 1) * 2 * kLanes;
    const uint16_t* qi = wq + (kp - 1) * 2 * kLanes;
    for (int b = 0; b < 4; ++b) {
      ap[b] = _mm512_dpbf16_ps(ap[b], xb, as_bh(_mm512_loadu_si512(pi + 32 * b)));
      aq[b] = _mm512_dpbf16_ps(aq[b], xb, as_bh(_mm512_loadu_si512(qi + 32 * b)));
    }
  }
  store_row_vectors(a, p, 0, ap);
  store_row_vectors(a, q, 0, aq);
}

#if defined(PW_AMX)

// AMX (Sapphire Rapids and later): the panel layout is AMX's VNNI layout for B -- a k-pair of
// a panel is 64 lanes x 2 bf16 -- so a 16 k-pair x 16 lane B tile is 16 rows of 64 bytes at a
// stride of 256 bytes, read in place.  Rows go in groups of at most 16 (an A tile: the group's
// rows x 32 k of x); per group and panel four C tiles (16 lanes each) accumulate over the
// k-steps of 32 (tdpbf16ps), are stored to `buf`, and the k-pairs past the last whole step
// (K % 32) are added with vdpbf16ps before the epilogue of the AVX512 path.  Every row of a
// C tile depends only on its own row of A, in one order whatever the group or M: a row's bits
// never depend on the rows beside it.  On AVX512-BF16 alone a bf16 linear of M rows costs M
// times the dot products, which on these CPUs makes the kernel compute-bound from M = 2
// (oneDNN, on AMX, was up to 1.4x faster at M = 8 and 2.6-5.3x at M = 64, every call from
// DRAM: experiments/bench/results/small_m_amx_2026-12-05.md); AMX makes
// every M up to 64 a stream of the weight.  Used for every M (M = 1 included) so the bits of
// a row are the same at every batch size.
namespace amx {

constexpr int64_t kStepPairs = 16;  // k-pairs per tile step (32 k)

// Rows [m0, m0 + mr) of panel p (tiles configured for mr rows): the whole k-steps on AMX,
// then the tail pairs and the epilogue on AVX512.
inline void panel_group(const Args& a, int64_t p, int64_t m0, int mr, float* buf) {
  const int64_t kp = (a.k + 1) / 2, steps = a.k / (2 * kStepPairs);
  const uint16_t* w = a.w + p * kp * 2 * kLanes;
  const uint16_t* x = a.x + m0 * a.x_st;
  const uint16_t* end = a.w + (a.n + kLanes - 1) / kLanes * kp * 2 * kLanes;
  pw_amx::panel_steps<pw_amx::Dot::kBF16>(x, a.x_st * 2, w, steps, buf, end);
  const int64_t full = a.k / 2;
  for (int r = 0; r < mr; ++r) {
    __m512 acc[4];
    for (int b = 0; b < 4; ++b) acc[b] = _mm512_loadu_ps(buf + r * kLanes + 16 * b);
    const uint16_t* xr = x + r * a.x_st;
    for (int64_t i = steps * kStepPairs; i < full; ++i) {
      int32_t pair;
      std::memcpy(&pair, xr + 2 * i, 4);
      const __m512bh xb = as_bh(_mm512_set1_epi32(pair));
      const uint16_t* wi = w + i * 2 * kLanes;
      for (int b = 0; b < 4; ++b)
        acc[b] = _mm512_dpbf16_ps(acc[b], xb, as_bh(_mm512_loadu_si512(wi + 32 * b)));
    }
    if (a.k & 1) {  // last k alone; its partner in the packed weight is zero
      const __m512bh xb = as_bh(_mm512_set1_epi32(xr[a.k - 1]));
      const uint16_t* wi = w + (kp - 1) * 2 * kLanes;
      for (int b = 0; b < 4; ++b)
        acc[b] = _mm512_dpbf16_ps(acc[b], xb, as_bh(_mm512_loadu_si512(wi + 32 * b)));
    }
    store_row_vectors(a, p, m0 + r, acc);
  }
}

// Panels [b, e), every row: groups of at most 16 rows, balanced (17 -> 9 + 8), each panel
// streamed once for the first group and from cache for the others.
inline void run_share(const Args& a, int64_t b, int64_t e) {
  alignas(64) float buf[pw_amx::kGroupRows * kLanes];
  int configured = 0;
  for (int64_t p = b; p < e; ++p)
    pw_amx::each_group(a.m, configured,
                       [&](int64_t m0, int rows) { panel_group(a, p, m0, rows, buf); });
  if (configured) _tile_release();
}

}  // namespace amx

#endif  // PW_AMX

#elif defined(PW_AVX2)

// AVX2 + FMA (no bf16 dot product): a 32-bit lane of the packed weight holds (W[j][2i],
// W[j][2i+1]) as two bf16, so one 256-bit load is 8 outputs' k-pair, widened exactly to fp32
// by a shift (even k) and a mask (odd k); each output takes two FMAs per k-pair, even k first.
// Sixteen ymm registers: one row sweeps the whole 64-lane panel (8 accumulators); more rows go
// in register tiles (kTileG / kTileV below: pairs over half panels, or 4-5 rows over quarter
// panels on x widened once per call), over k-blocks of kAvx2Block pairs (8 KB) that stay in
// L1 while every tile runs over them, the partial sums waiting in `acc` (on the stack); the
// sweeps of a block share out the prefetch of the weight bytes that come next
// (csrc/panel_loop.h, row_tiles).  Each output sees the same operations in the
// same order whatever MR, the grouping or the blocking, so a row's bits never depend on the
// rows beside it.
// 8 KB blocks: against 16 KB 1.01-1.07x at 2-40 rows (geometric means over the tiny and 1.1B
// shapes, same bits; 4 KB lost 6-row passes 0.84x, 32 KB every M 0.91x; the int8 kernels'
// 16 KB blocks gained nothing at 8 KB: experiments/bench/results/
// small_m_avx2_wide_tiles_2026-12-07.txt, run 4).
constexpr int64_t kAvx2Block = 32;

inline void widen_pair(const uint16_t* x, __m256& x0, __m256& x1) {
  int32_t pair;
  std::memcpy(&pair, x, 4);
  const __m256i v = _mm256_set1_epi32(pair);
  x0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  x1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xffff0000u))));
}

// Rows [r0, r0 + G) over k-pairs [i0, i1), lanes [8 v0, 8 (v0 + V)) of the panel at w.
template <int G, int V>
inline void avx2_sweep(const uint16_t* w, const uint16_t* x, int64_t x_st, int64_t i0,
                       int64_t i1, int v0, float* acc_rows, const pw_panel::SweepPrefetch& spf) {
  __m256 acc[G][V];
  for (int r = 0; r < G; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_loadu_ps(acc_rows + r * kLanes + 8 * (v0 + v));
  const __m256i hi = _mm256_set1_epi32(int32_t(0xffff0000u));
  pw_panel::sweep_steps(spf, w, 2 * kLanes * sizeof(uint16_t), i0, i1, [&](int64_t i) {
    const uint16_t* wi = w + i * 2 * kLanes + 16 * v0;
    __m256 xa[G], xb[G];
    for (int r = 0; r < G; ++r) widen_pair(x + r * x_st + 2 * i, xa[r], xb[r]);
    for (int v = 0; v < V; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wi + 16 * v));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(wv, hi));
      for (int r = 0; r < G; ++r) {
        acc[r][v] = _mm256_fmadd_ps(xa[r], w0, acc[r][v]);
        acc[r][v] = _mm256_fmadd_ps(xb[r], w1, acc[r][v]);
      }
    }
  });
  for (int r = 0; r < G; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc_rows + r * kLanes + 8 * (v0 + v), acc[r][v]);
}

// Rows [r0, r0 + G) over k-pairs [i0, i1), lanes [8 v0, 8 (v0 + V)), x already widened (xf, row
// stride xf_st): the V weight vectors of a k-pair are widened once for all G rows, and each
// x[r][k] is one broadcast load (the bf16-x sweep above widens the pair per row).  The same
// FMAs in the same order.  The loops over rows and vectors are unrolled before GCC's scalar
// replacement runs (`GCC unroll`), else it leaves the accumulators in memory for tiles of
// four rows or more and stores every one of them on every k-pair.
template <int G, int V>
inline void avx2_sweep_f(const uint16_t* w, const float* xf, int64_t xf_st, int64_t i0,
                         int64_t i1, int v0, float* acc_rows, const pw_panel::SweepPrefetch& spf) {
  __m256 acc[G][V];
  _Pragma("GCC unroll 8") for (int r = 0; r < G; ++r)
    _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v)
      acc[r][v] = _mm256_loadu_ps(acc_rows + r * kLanes + 8 * (v0 + v));
  const __m256i hi = _mm256_set1_epi32(int32_t(0xffff0000u));
  pw_panel::sweep_steps<true>(spf, w, 2 * kLanes * sizeof(uint16_t), i0, i1, [&](int64_t i) {
    const uint16_t* wi = w + i * 2 * kLanes + 16 * v0;
    const float* xi = xf + 2 * i;
    __m256 w0[V], w1[V];
    _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wi + 16 * v));
      w0[v] = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
      w1[v] = _mm256_castsi256_ps(_mm256_and_si256(wv, hi));
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < G; ++r) {
      const __m256 x0 = _mm256_broadcast_ss(xi + r * xf_st);
      _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v)
        acc[r][v] = _mm256_fmadd_ps(x0, w0[v], acc[r][v]);
      const __m256 x1 = _mm256_broadcast_ss(xi + r * xf_st + 1);
      _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v)
        acc[r][v] = _mm256_fmadd_ps(x1, w1[v], acc[r][v]);
    }
  });
  _Pragma("GCC unroll 8") for (int r = 0; r < G; ++r)
    _Pragma("GCC unroll 8") for (int v = 0; v < V; ++v)
      _mm256_storeu_ps(acc_rows + r * kLanes + 8 * (v0 + v), acc[r][v]);
}

// x[0, k) widened to fp32 (exact: a bf16 is the top half of its float).
inline void widen_row(const uint16_t* x, int64_t k, float* out) {
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j));
    const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_ps(out + j, _mm256_castsi256_ps(wide));
  }
  for (; j < k; ++j) out[j] = bf16_to_f32(x[j]);
}

// The register tile of a pass of MR rows (index MR): whether it runs on x widened to fp32
// (avx2_sweep_f), and its G rows x V vectors.  Passes of 4 and 5 rows take every row at once
// over quarter panels on widened x (4 x 2 and 5 x 2 accumulators, the weight widened once for
// all rows); 2, 3 and 6 rows keep the pairs over half panels: a 2- or 3-row wide tile holds too
// few accumulators for the FMA latency and a 6-row one (12 + 4 widened weights) spills.
// `small_m_linear --baseline 4dcb724 --kernels bf16 --models tiny 1.1b`, AVX2 Zen 3, three
// runs: M = 5 1.16x, 1.08x, 1.11x (geometric means over the ten shapes), M = 4 1.00-1.05x;
// wide tiles at 2, 3 and 6 rows measured 0.67-1.06x (tiny shapes; all in
// experiments/bench/results/small_m_avx2_wide_tiles_2026-12-07.txt).
constexpr bool kTileWide[kMaxRows + 1] = {false, false, false, false, true, true, false};
constexpr int kTileG[kMaxRows + 1] = {1, 1, 2, 2, 4, 5, 2};
constexpr int kTileV[kMaxRows + 1] = {8, 8, 4, 4, 2, 2, 4};

// The last k of an odd K alone (its partner in the packed weight is zero), for MR rows of the
// panel at w (kp k-pairs): the final operation of every output.
template <int MR>
inline void odd_k_tail(const Args& a, const uint16_t* w, const uint16_t* x, float* acc) {
  const int64_t kp = (a.k + 1) / 2;
  const uint16_t* wi = w + (kp - 1) * 2 * kLanes;
  for (int r = 0; r < MR; ++r) {
    const float x0 = bf16_to_f32(x[r * a.x_st + a.k - 1]);
    for (int j = 0; j < kLanes; ++j)
      acc[r * kLanes + j] = std::fma(x0, bf16_to_f32(wi[2 * j]), acc[r * kLanes + j]);
  }
}

template <int MR>
void panel_pf(const Args& a, int64_t p, int64_t m0, int64_t i0, int64_t i1, float* buf,
              bool first, bool last, const pw_panel::Prefetch& pf) {
  const int64_t kp = (a.k + 1) / 2, full = std::min(i1, a.k / 2);
  const uint16_t* w = a.w + p * kp * 2 * kLanes;
  const uint16_t* x = a.x + m0 * a.x_st;
  alignas(32) float acc[MR * kLanes];
  pw_panel::load_partials(acc, buf, MR * kLanes, first);
  // the sweeps stop at the last whole k-pair; the bytes after this range start at i1
  pw_panel::row_tiles<MR, kTileG[MR], kTileV[MR]>(
      i0, full, i1, kAvx2Block, pf,
      [&](auto g, auto v, int r, int64_t b0, int64_t b1, int v0, const auto& spf) {
        constexpr int G = decltype(g)::value, V = decltype(v)::value;
        if constexpr (kTileWide[MR])  // run_share widened x: a pass takes a wide tile
          avx2_sweep_f<G, V>(w, a.xf + (m0 + r) * a.k, a.k, b0, b1, v0, acc + r * kLanes, spf);
        else
          avx2_sweep<G, V>(w, x + r * a.x_st, a.x_st, b0, b1, v0, acc + r * kLanes, spf);
      });
  if ((a.k & 1) && i1 == kp) odd_k_tail<MR>(a, w, x, acc);
  if (last)
    store_rows<MR>(a, p, m0, acc);
  else
    std::copy(acc, acc + MR * kLanes, buf);
}

// One row (a batch-1 decode step): several weight streams per thread (pw_panel::
// one_row_streams; microbenchmark on the AVX2 Zen 3, 2 threads, 2 MB pages, medians of 150:
// four streams in chunks of two k-pairs 1.08x one stream at 32000 x 512, 1.06x at 1024 x 512,
// 1.07x at 2816 x 512; one stream cut into chunks alone is 2% slower).  Bits as panel_pf<1>.
// A thread's share of more than kM1BlockBytes runs as blocks of about that size, the streams
// inside each block: four streams spread over a whole share lie megabytes apart (an LM head's
// 16 MB share: 4 MB), and streams that far apart read slower on the same machine (a 32000 x
// 512 weight, 2 threads: 24 -> 29-33 GB/s with blocks of 1-8 MB, the same with the streams
// interleaved panel by panel; the kernel: 1.17-1.24x at 32000 x 512 and 32000 x 2048 in three
// runs, the other shapes within the runs' +-10% noise, shares under a block unchanged:
// experiments/bench/results/small_m_avx2_blocks_2026-12-07.txt).
constexpr int kM1Streams = 4;
constexpr int64_t kM1Chunk = 2;
constexpr int64_t kM1BlockBytes = int64_t(2) << 20;

void run_share_m1(const Args& a, int64_t b, int64_t e) {
  const int64_t kp = (a.k + 1) / 2;
  const int64_t panel_bytes = kp * 2 * kLanes * int64_t(sizeof(uint16_t));
  const int64_t blocks = std::max<int64_t>(
      1, std::min((e - b) / kM1Streams, (e - b) * panel_bytes / kM1BlockBytes));
  for (int64_t q = 0; q < blocks; ++q)
    pw_panel::one_row_streams<float, kM1Streams>(
        b + (e - b) * q / blocks, b + (e - b) * (q + 1) / blocks, a.k / 2, kM1Chunk,
        [&](int64_t p, int64_t i0, int64_t i1, float* acc) {
          avx2_sweep<1, 8>(a.w + p * kp * 2 * kLanes, a.x, a.x_st, i0, i1, 0, acc,
                           pw_panel::SweepPrefetch{});
        },
        [&](int64_t p, float* acc) {
          if (a.k & 1) odd_k_tail<1>(a, a.w + p * kp * 2 * kLanes, a.x, acc);
          store_rows<1>(a, p, 0, acc);
        });
}

#else  // portable: the same packed layout, plain loops

template <int MR>
void panel_pf(const Args& a, int64_t p, int64_t m0, int64_t i0, int64_t i1, float* buf,
              bool first, bool last, const pw_panel::Prefetch&) {
  const int64_t kp = (a.k + 1) / 2;
  const uint16_t* w = a.w + p * kp * 2 * kLanes;
  const uint16_t* x = a.x + m0 * a.x_st;
  float acc[MR][kLanes];
  float w0[kLanes], w1[kLanes];
  pw_panel::load_partials(&acc[0][0], buf, MR * kLanes, first);
  for (int64_t i = i0; i < i1; ++i) {
    const uint16_t* wi = w + i * 2 * kLanes;
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      w0[j] = bf16_to_f32(wi[2 * j]);
      w1[j] = bf16_to_f32(wi[2 * j + 1]);
    }
    for (int r = 0; r < MR; ++r) {
      const float x0 = bf16_to_f32(x[r * a.x_st + 2 * i]);
      const float x1 = 2 * i + 1 < a.k ? bf16_to_f32(x[r * a.x_st + 2 * i + 1]) : 0.0f;
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) acc[r][j] += x0 * w0[j] + x1 * w1[j];
    }
  }
  if (last)
    store_rows<MR>(a, p, m0, &acc[0][0]);
  else
    std::copy(&acc[0][0], &acc[0][0] + MR * kLanes, buf);
}

#endif

using PanelPfFn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t, float*, bool, bool,
                           const pw_panel::Prefetch&);
constexpr PanelPfFn kPanelsPf[kMaxRows + 1] = {nullptr,      panel_pf<1>, panel_pf<2>,
                                               panel_pf<3>, panel_pf<4>, panel_pf<5>,
                                               panel_pf<6>};

// The most rows a pass takes (pw_panel::RowPasses balances the passes): 6, or on AVX2 5 where
// that puts more rows in passes of 5 (the wide tile; 4-row passes measured no faster than the
// pairs): 24 -> 5 5 5 5 4 rather than 6 6 6 6, 40 -> eight of 5 rather than 6 x 5 + 5 5; 16
// stays 6 5 5 (not 4 4 4 4), 8 stays 4 4.
inline int64_t pass_rows(int64_t m) {
#if defined(PW_AVX2)
  auto in_fives = [m](int64_t most) {
    const pw_panel::RowPasses rp(m, most);
    int64_t rows = 0;
    for (int64_t j = 0; j < rp.passes; ++j) rows += rp.rows(j) == 5 ? 5 : 0;
    return rows;
  };
  return in_fives(5) > in_fives(kMaxRows) ? 5 : kMaxRows;
#else
  (void)m;
  return kMaxRows;
#endif
}

// A pass of rows over k-pairs of a panel, for the shared driver (csrc/panel_loop.h).
struct PanelPass {
  const Args& a;
  void operator()(int64_t p, int64_t m0, int64_t mr, int64_t i0, int64_t i1, float* buf,
                  bool first, bool last, const pw_panel::Prefetch& pf) const {
    kPanelsPf[mr](a, p, m0, i0, i1, buf, first, last, pf);
  }
};

// One panel, all rows (rows in balanced passes of <= 6 over k-blocks held in L1/L2: the
// weight is read from memory once whatever M is).
void run_panel(const Args& a, int64_t p, std::vector<float>& buf) {
  pw_panel::run_panel<float>(a.m, (a.k + 1) / 2, kBlockPairs, kLanes, p, buf, PanelPass{a},
                             a.most);
}

// This thread's share of the panels, [b, e), every row.  One row (a batch-1 decode step) reads
// them two at a time, from the two halves of the share (panel_pair_m1).
void run_share(const Args& a, int64_t b, int64_t e) {
#if defined(PW_AMX)
  if (pw_amx::permitted()) {
    amx::run_share(a, b, e);
    return;
  }
#endif
#if defined(PW_AVX2)
  if (a.m == 1) {
    run_share_m1(a, b, e);
    return;
  }
#endif
#if defined(PW_AVX512BF16)
  if (a.m == 1) {
    const int64_t half = (e - b) / 2;
    for (int64_t j = 0; j < half; ++j) panel_pair_m1(a, b + j, b + half + j);
    if ((e - b) & 1) panel_pf<1>(a, e - 1, 0, 0, (a.k + 1) / 2, nullptr, true, true, {});
    return;
  }
#endif
  std::vector<float> buf;
  for (int64_t p = b; p < e; ++p) run_panel(a, p, buf);
}

// The greedy epilogue's output: per row, the column of the first maximum of the stored (bf16)
// outputs and that maximum, by the rules of framework/core/csrc/row_argmax.h.
struct Greedy {
  int64_t* idx;
  float* val;
};

// Fold a later column range's (index, value) into a row's running one: an earlier NaN stays,
// else a NaN wins, else only a strictly greater value (ties keep the earlier column).
inline void fold(int64_t& idx, float& val, int64_t i, float v) {
  if (val != val) return;
  if (v != v || v > val) {
    idx = i;
    val = v;
  }
}

// Every panel, over OpenMP threads (a static split: thread t of nt takes panels
// [P t / nt, P (t + 1) / nt)).  With `g`, each thread then scans the columns it has just
// stored, while they are in its cache, and the calling thread folds the threads' ranges in
// column order: what the sampler's pass over the whole rows gives, without reading them again.
// The per-call settings of `a` every thread reads: the pass size and, on AVX2 where a pass of
// that size takes a wide tile, x widened to fp32 once (exact), in the calling thread's buffer
// (kept for its next calls; the team only reads it).
Args prepare_passes(const Args& in) {
  Args a = in;
  a.most = pass_rows(a.m);
#if defined(PW_AVX2)
  const pw_panel::RowPasses rp(a.m, a.most);
  if (a.m > 1 && (kTileWide[rp.rows(0)] || kTileWide[rp.rows(rp.passes - 1)])) {
    thread_local std::vector<float> xf;
    xf.resize(static_cast<size_t>(a.m * a.k));
    for (int64_t r = 0; r < a.m; ++r) widen_row(a.x + r * a.x_st, a.k, xf.data() + r * a.k);
    a.xf = xf.data();
  }
#endif
  return a;
}

void run(const Args& call, const Greedy* g = nullptr) {
  const Args a = prepare_passes(call);
  const int64_t panels = (a.n + kLanes - 1) / kLanes;
  const bool parallel =
      panels > 1 &&
      a.n * a.k * 2 * pw_panel::RowPasses(a.m, a.most).passes >= kParallelMinBytes;
#ifdef _OPENMP
  const int64_t slots = parallel ? omp_get_max_threads() : 1;
#else
  const int64_t slots = 1;
#endif
  std::vector<int64_t> seg_idx(g ? slots * a.m : 0);
  std::vector<float> seg_val(g ? slots * a.m : 0);
  std::vector<int64_t> seg_cols(g ? slots : 0, 0);
#pragma omp parallel if (parallel)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t t = 0, nt = 1;
#endif
    const int64_t b = panels * t / nt, e = panels * (t + 1) / nt;
    run_share(a, b, e);
    if (g != nullptr && t < slots) {
      const int64_t c0 = b * kLanes, c1 = std::min(e * kLanes, a.n);
      seg_cols[t] = std::max<int64_t>(0, c1 - c0);
      for (int64_t r = 0; r < a.m && c1 > c0; ++r) {
        int64_t i;
        float v;
        pw_argmax::row_argmax(a.out + r * a.out_st + c0, c1 - c0, &i, &v);
        seg_idx[t * a.m + r] = c0 + i;
        seg_val[t * a.m + r] = v;
      }
    }
  }
  if (g == nullptr) return;
  for (int64_t r = 0; r < a.m; ++r) {
    bool have = false;
    for (int64_t t = 0; t < slots; ++t) {
      if (seg_cols[t] == 0) continue;
      const int64_t i = seg_idx[t * a.m + r];
      const float v = seg_val[t * a.m + r];
      if (!have) {
        g->idx[r] = i;
        g->val[r] = v;
        have = true;
      } else {
        fold(g->idx[r], g->val[r], i, v);
      }
    }
  }
}

}  // namespace pw_small_m

extern "C" {

// dtype: 1 = bfloat16 (the only one).  x [m, k] with row stride x_st, packed weight (layout
// above), bias [n] or null, out [m, n] with row stride out_st.  With idx and val (else null):
// the greedy epilogue (`run`'s Greedy), idx[r] / val[r] the column of row r's first maximum
// among its n stored outputs and that maximum (NaN first, as the sampler).  Returns 0, or 1
// for a bad dtype, 2 for bad sizes.
int piecewise_small_m_linear_greedy(const void* x, int64_t x_st, int64_t m, const void* w_packed,
                                    const void* bias, void* out, int64_t out_st, int64_t n,
                                    int64_t k, int64_t dtype, int64_t* idx, float* val) {
  using namespace pw_small_m;
  if (dtype != 1) return 1;
  if (m < 0 || n <= 0 || k <= 0 || x_st < k || out_st < n) return 2;
  if (m == 0) return 0;
  Args a{static_cast<const uint16_t*>(x), x_st, m, static_cast<const uint16_t*>(w_packed),
         static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), out_st, n, k};
  const Greedy g{idx, val};
  run(a, idx != nullptr && val != nullptr ? &g : nullptr);
  return 0;
}

// The linear alone.
int piecewise_small_m_linear(const void* x, int64_t x_st, int64_t m, const void* w_packed,
                             const void* bias, void* out, int64_t out_st, int64_t n, int64_t k,
                             int64_t dtype) {
  return piecewise_small_m_linear_greedy(x, x_st, m, w_packed, bias, out, out_st, n, k, dtype,
                                         nullptr, nullptr);
}

// Outputs per panel of the packed layout.
int64_t piecewise_small_m_linear_lanes() { return pw_small_m::kLanes; }

// Which instruction set the build uses (for logs and benchmarks).
const char* piecewise_small_m_linear_isa() {
#if defined(PW_AMX)
  if (pw_amx::permitted()) return "amx_bf16";
#endif
#if defined(PW_AVX512BF16)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(PW_AVX2)
  return "avx2_fma";
#elif defined(__AVX2__)
  return "avx2";
#elif defined(__ARM_NEON)
  return "neon";
#else
  return "portable";
#endif
}

}  // extern "C"
