// Small-M int8 linears (see passes/int8_small_m.py for the contract): y = x @ (W_q * s_w)^T
// (+ bias) for the few rows of a decode step, streaming the int8 weight once.
//
// Two entries over one weight layout:
// * W8A8, dynamic per-token activations (piecewise_int8_linear): each row of x (bf16 or fp32)
//   is quantised in the prologue exactly as passes/ops/activation_quant.py does
//   (s_x = max(absmax / 127, 1e-10); q = clamp(rint(x / s_x), -128, 127), in fp32), then
//   offset to unsigned (u = q + 128, in [0, 255]) for VNNI's u8 x s8 product `vpdpbusd`.
//   The offset is taken back with a per-channel constant computed once at packing:
//   comp[n] = 128 * sum_k W_q[n][k], so acc[m][n] = sum_k u x W_q - comp[n] = sum_k q x W_q
//   exactly (int32; no overflow for K < 2^31 / (255 * 128) = 65793).  Epilogue in fp32, in
//   the reference's order: y = float(acc) * s_x[m] * s_w[n] (+ bias[n]), rounded once to the
//   output dtype; the library is built with -ffp-contract=off, so no FMA changes a bit and the
//   result equals dynamic_per_token_quant + torch._int_mm + the scaled-mm epilogue.
// * weight-only (piecewise_int8_wo_linear): x stays in floating point; each int8 weight is
//   widened to fp32 in registers (sign-extending shifts + vcvtdq2ps) and FMA'd; y = acc * s_w
//   (+ bias), one rounding.
//
// Layout (re-laid once at load, in Python): panels of 64 output features, 4 consecutive k per
// 32-bit lane (what vpdpbusd reads):
//   packed[p][i][j][t] = W_q[64 p + j][4 i + t]    p < ceil(N/64), i < ceil(K/4), j < 64, t < 4
// zero-padded in N and K: one k-quad of a panel is 256 contiguous bytes (four 16-lane
// vectors), a panel one contiguous stream.  Any number of rows: up to 6 share one pass over a
// panel (24 accumulators); more rows take further passes over k-blocks of the panel held in
// L1/L2, so the weight is streamed from memory once for all M rows.  Panels are split over
// OpenMP threads, and the prologue's rows too (the loop is csrc/panel_loop.h, shared with the
// bf16 kernel).
//
// No torch headers: a C ABI on data pointers, called through ctypes (tests, the portable build)
// or from the piecewise torch ops (csrc/torch_ops.cpp includes this file).  Without AVX-512
// the same layout runs plain loops the compiler vectorises.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../framework/core/csrc/bf16.h"
#include "panel_loop.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PW_I8_AVX512 1
#include <immintrin.h>
#if defined(__AVX512VNNI__)
#define PW_I8_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define PW_I8_AMX 1
#include "amx_tiles.h"
#endif
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define PW_I8_AVX2 1
#include <immintrin.h>
#endif

namespace pw_int8 {

constexpr int kLanes = 64;            // output features per panel
constexpr int kQuad = 4;              // k per 32-bit lane
constexpr int kMaxRows = pw_panel::kMaxTileRows;  // rows per pass over a panel
constexpr int64_t kBlockQuads = 256;  // k-quads per block (64 KB of a panel) with several passes
static_assert(kMaxRows == 6, "qpanel<1..6> / wpanel<1..6> below");
constexpr float kQMax = 127.0f;
// W8A8 calls of at least this many rows run AMX tiles where the build has them (the sums are
// exact either way, so the choice changes no bit).  Below it the VNNI path streams the
// weight faster (AMX took 1.07-1.47x the time at M = 1, 0.68-1.16x
// at M = 3-4 and 0.38-0.92x at M = 6, M = 64 0.17-0.24x: Intel Xeon with AMX, 2 threads,
// weights in cache; experiments/bench/results/small_m_amx_2026-12-05.md).
constexpr int64_t kAmxMinRows = 6;
constexpr float kMinScale = 1e-10f;  // MIN_DYNAMIC_SCALE of passes/ops/quant_utils.py

enum : int64_t { kFloat32 = 0, kBFloat16 = 1 };

using pw_bf16::bf16_to_f32;
using pw_bf16::f32_to_bf16;

inline float load1(const void* p, int64_t i, int64_t dt) {
  return dt == kBFloat16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i])
                         : static_cast<const float*>(p)[i];
}

inline void store1(void* p, int64_t i, float v, int64_t dt) {
  if (dt == kBFloat16)
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  else
    static_cast<float*>(p)[i] = v;
}

#if defined(PW_I8_AVX512)
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

inline __m512 load16(const void* p, int64_t i, __mmask16 mask, int64_t dt) {
  if (dt == kBFloat16) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
}

inline void store16(void* p, int64_t i, __m512 v, __mmask16 mask, int64_t dt) {
  if (dt == kBFloat16) {  // round to nearest even exactly as f32_to_bf16 (NaN kept quiet)
    const __m512i u = _mm512_castps_si512(v);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, mask, _mm512_cvtepi32_epi16(r));
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(p) + i, mask, v);
  }
}
#endif

// --- the prologue: per-token quantisation (W8A8) or widening to fp32 (weight-only) ----------

// Row r of x quantised into u (kq * 4 bytes, the K tail padded with 128, i.e. q = 0); returns
// the row's scale.
inline float quantize_row(const void* x, int64_t k, int64_t dt, uint8_t* u, int64_t kpad) {
#if defined(PW_I8_AVX512)
  __m512 mx = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = tail_mask(k - i);
    mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x, i, m, dt)));
  }
  const float absmax = _mm512_reduce_max_ps(mx);
#else
  float absmax = 0.0f;
  for (int64_t i = 0; i < k; ++i) absmax = std::max(absmax, std::fabs(load1(x, i, dt)));
#endif
  const float scale = std::max(absmax / kQMax, kMinScale);
#if defined(PW_I8_AVX512)
  const __m512 s = _mm512_set1_ps(scale);
  const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
  const __m512i off = _mm512_set1_epi32(128);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = tail_mask(k - i);
    __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(load16(x, i, m, dt), s));  // rint (RNE)
    q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), off);
    _mm512_mask_cvtusepi32_storeu_epi8(u + i, m, q);
  }
#else
  for (int64_t i = 0; i < k; ++i) {
    float q = std::nearbyint(load1(x, i, dt) / scale);
    q = std::min(std::max(q, -128.0f), 127.0f);
    u[i] = static_cast<uint8_t>(static_cast<int32_t>(q) + 128);
  }
#endif
  std::memset(u + k, 128, kpad - k);
  return scale;
}

// --- W8A8 panels -------------------------------------------------------------------------------

struct QArgs {
  const uint8_t* u;  // quantised rows, offset by 128: [m][kq * 4]
  const float* xs;   // per-row scales [m]
  int64_t m;
  const int8_t* w;      // packed
  const int32_t* comp;  // [n]: 128 * sum_k W_q[n][k]
  const float* ws;      // [n]
  const void* bias;     // [n] in dt, or null
  void* out;
  int64_t out_st;
  int64_t n;
  int64_t kq;  // ceil(K / 4)
  int64_t dt;  // dtype of x, bias and out
};

// The W8A8 epilogue of the panels whose partial sums end in memory (AVX2, portable), in the
// reference's order: y = float(acc - comp) * s_x * s_w (+ bias), one rounding; comp null when
// acc is already sum q x W_q (the AVX2 path).
template <int MR>
inline void q_store_rows(const QArgs& a, int64_t p, int64_t m0, const int32_t* acc,
                         const int32_t* comp) {
  const int64_t n0 = p * kLanes;
  const int64_t valid = std::min<int64_t>(kLanes, a.n - n0);
  for (int r = 0; r < MR; ++r) {
    const int64_t row = (m0 + r) * a.out_st + n0;
    for (int64_t j = 0; j < valid; ++j) {
      float y = static_cast<float>(acc[r * kLanes + j] - (comp ? comp[n0 + j] : 0));
      y = y * a.xs[m0 + r];
      y = y * a.ws[n0 + j];
      if (a.bias) y = y + load1(a.bias, n0 + j, a.dt);
      store1(a.out, row + j, y, a.dt);
    }
  }
}

// One pass of MR rows (from m0) over k-quads [i0, i1) of panel p.  `first`: start from zero,
// else from the partial sums in `buf` (MR x 64 int32); `last`: run the epilogue, else leave the
// partial sums in `buf`; `pf`: the k-quads of the next block to prefetch (csrc/panel_loop.h;
// the portable loops leave it to the hardware).
#if defined(PW_I8_VNNI)

template <int MR>
void qpanel(const QArgs& a, int64_t p, int64_t m0, int64_t i0, int64_t i1, int32_t* buf,
            bool first, bool last, const pw_panel::Prefetch& pf) {
  const int8_t* w = a.w + p * a.kq * kQuad * kLanes;
  const int64_t ust = a.kq * kQuad;
  const uint8_t* u = a.u + m0 * ust;
  __m512i acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < 4; ++b)
      acc[r][b] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(buf + r * kLanes + 16 * b);
  const int8_t* next = w + (i1 - i0) * kQuad * kLanes;  // + i * 256: step i1 + (i - i0)
  int64_t turn = pf.phase;
  for (int64_t i = i0; i < i1; ++i) {
    const int8_t* wi = w + i * kQuad * kLanes;
    if (pf.every) {
      if (turn == 0) pw_panel::prefetch_step(next + i * kQuad * kLanes);
      if (++turn == pf.every) turn = 0;
    }
    const __m512i w0 = _mm512_loadu_si512(wi);
    const __m512i w1 = _mm512_loadu_si512(wi + 64);
    const __m512i w2 = _mm512_loadu_si512(wi + 128);
    const __m512i w3 = _mm512_loadu_si512(wi + 192);
    for (int r = 0; r < MR; ++r) {
      int32_t quad;
      std::memcpy(&quad, u + r * ust + kQuad * i, 4);
      const __m512i xb = _mm512_set1_epi32(quad);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], xb, w2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], xb, w3);
    }
  }
  if (!last) {
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < 4; ++b) _mm512_storeu_si512(buf + r * kLanes + 16 * b, acc[r][b]);
    return;
  }
  const int64_t n0 = p * kLanes;
  for (int b = 0; b < 4; ++b) {
    const int64_t left = a.n - n0 - 16 * b;
    if (left <= 0) break;
    const __mmask16 mask = tail_mask(left);
    const __m512i comp = _mm512_maskz_loadu_epi32(mask, a.comp + n0 + 16 * b);
    const __m512 ws = _mm512_maskz_loadu_ps(mask, a.ws + n0 + 16 * b);
    const __m512 bias = a.bias ? load16(a.bias, n0 + 16 * b, mask, a.dt) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][b], comp));
      y = _mm512_mul_ps(y, _mm512_set1_ps(a.xs[m0 + r]));
      y = _mm512_mul_ps(y, ws);
      if (a.bias) y = _mm512_add_ps(y, bias);
      store16(a.out, (m0 + r) * a.out_st + n0 + 16 * b, y, mask, a.dt);
    }
  }
}

#if defined(PW_I8_AMX)

// AMX (Sapphire Rapids and later): tdpbusd is vpdpbusd on tiles -- u8 x s8 k-quads into int32
// -- and the panel layout is its B layout (csrc/amx_tiles.h), so the sums are exact integers,
// the same as the VNNI path's, and the epilogue is the same arithmetic: the same bits at any
// M.  Rows go in groups of at most 16 (an A tile: the group's rows x 16 k-quads of u); per
// group and panel four C tiles accumulate over the k-steps of 16 quads, the quads past the
// last whole step are added with vpdpbusd, then the epilogue.  On VNNI alone a W8A8 linear of
// M rows costs M times the dot products: compute-bound from M = 8 on such a CPU (int8_small_m.py).
namespace amx {

constexpr int64_t kStepQuads = 16;  // k-quads per tile step (64 k)

inline void qgroup(const QArgs& a, int64_t p, int64_t m0, int mr, int32_t* buf) {
  const int8_t* w = a.w + p * a.kq * kQuad * kLanes;
  const int64_t ust = a.kq * kQuad, steps = a.kq / kStepQuads, ws = kQuad * kLanes;
  const uint8_t* u = a.u + m0 * ust;
  const int8_t* end = a.w + (a.n + kLanes - 1) / kLanes * a.kq * kQuad * kLanes;
  pw_amx::panel_steps<pw_amx::Dot::kInt8>(u, ust, w, steps, buf, end);
  const int64_t n0 = p * kLanes;
  for (int r = 0; r < mr; ++r) {
    __m512i acc[4];
    for (int b = 0; b < 4; ++b) acc[b] = _mm512_loadu_si512(buf + r * kLanes + 16 * b);
    for (int64_t i = steps * kStepQuads; i < a.kq; ++i) {
      int32_t quad;
      std::memcpy(&quad, u + r * ust + kQuad * i, 4);
      const __m512i xb = _mm512_set1_epi32(quad);
      const int8_t* wi = w + i * ws;
      for (int b = 0; b < 4; ++b)
        acc[b] = _mm512_dpbusd_epi32(acc[b], xb, _mm512_loadu_si512(wi + 64 * b));
    }
    for (int b = 0; b < 4; ++b) {  // the VNNI path's epilogue, element for element
      const int64_t left = a.n - n0 - 16 * b;
      if (left <= 0) break;
      const __mmask16 mask = tail_mask(left);
      const __m512i comp = _mm512_maskz_loadu_epi32(mask, a.comp + n0 + 16 * b);
      const __m512 wsc = _mm512_maskz_loadu_ps(mask, a.ws + n0 + 16 * b);
      __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[b], comp));
      y = _mm512_mul_ps(y, _mm512_set1_ps(a.xs[m0 + r]));
      y = _mm512_mul_ps(y, wsc);
      if (a.bias) y = _mm512_add_ps(y, load16(a.bias, n0 + 16 * b, mask, a.dt));
      store16(a.out, (m0 + r) * a.out_st + n0 + 16 * b, y, mask, a.dt);
    }
  }
}

// The prologue for every row, then every panel over the same threads, static split.
template <class Prologue>
void run_quantized(const QArgs& a, const Prologue& prologue) {
  const int64_t panels = (a.n + kLanes - 1) / kLanes;
  const bool parallel = panels > 1 && a.n * a.kq * kQuad >= pw_panel::kParallelMinBytes;
#pragma omp parallel if (parallel)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.m; ++r) prologue(r);
    alignas(64) int32_t buf[pw_amx::kGroupRows * kLanes];
    int configured = 0;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p)
      pw_amx::each_group(a.m, configured,
                         [&](int64_t m0, int rows) { qgroup(a, p, m0, rows, buf); });
    if (configured) _tile_release();
  }
}

}  // namespace amx

#endif  // PW_I8_AMX

#elif defined(PW_I8_AVX2)

// AVX2 (no VNNI): vpmaddubsw multiplies u8 x s8 pairs into saturating int16 sums, so the sign
// goes to the activation side: |w| (u8, <= 128) x (q * sign(w)) with q = u ^ 0x80 = u - 128
// (|q| <= 127: the prologue's scale is absmax / 127), two products per int16 at most
// 128 * 127 * 2 = 32512, no saturation; vpmaddwd by ones sums the quad into int32.  So acc is
// sum q * w exactly (no offset, no comp), the same integer the VNNI path reaches.  One row
// sweeps the whole panel (8 accumulators); more rows go in groups of two over half panels
// over k-blocks of kI8Avx2Block quads held in L1 (as the bf16 AVX2 kernel).
constexpr int64_t kI8Avx2Block = 64;

template <int G, int V>
inline void qsweep(const int8_t* w, const uint8_t* u, int64_t ust, int64_t i0, int64_t i1,
                   int v0, int32_t* acc_rows, const pw_panel::SweepPrefetch& spf) {
  __m256i acc[G][V];
  for (int r = 0; r < G; ++r)
    for (int v = 0; v < V; ++v)
      acc[r][v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc_rows + r * kLanes +
                                                                       8 * (v0 + v)));
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(int8_t(0x80));
  pw_panel::sweep_steps(spf, w, kQuad * kLanes, i0, i1, [&](int64_t i) {
    const int8_t* wi = w + i * kQuad * kLanes + 32 * v0;
    __m256i q[G];
    for (int r = 0; r < G; ++r) {
      int32_t quad;
      std::memcpy(&quad, u + r * ust + kQuad * i, 4);
      q[r] = _mm256_xor_si256(_mm256_set1_epi32(quad), flip);
    }
    for (int v = 0; v < V; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wi + 32 * v));
      const __m256i aw = _mm256_abs_epi8(wv);
      for (int r = 0; r < G; ++r) {
        const __m256i p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(q[r], wv));
        acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(p16, ones));
      }
    }
  });
  for (int r = 0; r < G; ++r)
    for (int v = 0; v < V; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc_rows + r * kLanes + 8 * (v0 + v)),
                          acc[r][v]);
}

template <int MR>
void qpanel(const QArgs& a, int64_t p, int64_t m0, int64_t i0, int64_t i1, int32_t* buf,
            bool first, bool last, const pw_panel::Prefetch& pf) {
  const int8_t* w = a.w + p * a.kq * kQuad * kLanes;
  const int64_t ust = a.kq * kQuad;
  alignas(32) int32_t acc[MR * kLanes];
  pw_panel::load_partials(acc, buf, MR * kLanes, first);
  const uint8_t* u = a.u + m0 * ust;
  pw_panel::pair_tiles<MR>(i0, i1, i1, kI8Avx2Block, pf, [&](auto g, auto v, int r, int64_t b0,
                                                             int64_t b1, int v0, const auto& spf) {
    constexpr int G = decltype(g)::value, V = decltype(v)::value;
    qsweep<G, V>(w, u + r * ust, ust, b0, b1, v0, acc + r * kLanes, spf);
  });
  if (last)
    q_store_rows<MR>(a, p, m0, acc, nullptr);  // acc = sum u x W_q - comp, exactly
  else
    std::copy(acc, acc + MR * kLanes, buf);
}

#else  // portable: the same packed layout, plain loops

template <int MR>
void qpanel(const QArgs& a, int64_t p, int64_t m0, int64_t i0, int64_t i1, int32_t* buf,
            bool first, bool last, const pw_panel::Prefetch& /*pf*/) {
  const int8_t* w = a.w + p * a.kq * kQuad * kLanes;
  const int64_t ust = a.kq * kQuad;
  const uint8_t* u = a.u + m0 * ust;
  int32_t acc[MR][kLanes];
  pw_panel::load_partials(&acc[0][0], buf, MR * kLanes, first);
  for (int64_t i = i0; i < i1; ++i) {
    const int8_t* wi = w + i * kQuad * kLanes;
    for (int r = 0; r < MR; ++r) {
      const uint8_t* ur = u + r * ust + kQuad * i;
      const int32_t u0 = ur[0], u1 = ur[1], u2 = ur[2], u3 = ur[3];
#pragma omp simd
      for (int j = 0; j < kLanes; ++j)
        acc[r][j] += u0 * wi[4 * j] + u1 * wi[4 * j + 1] + u2 * wi[4 * j + 2] + u3 * wi[4 * j + 3];
    }
  }
  if (last)
    q_store_rows<MR>(a, p, m0, &acc[0][0], a.comp);
  else
    std::copy(&acc[0][0], &acc[0][0] + MR * kLanes, buf);
}

#endif

// --- weight-only panels ---------------------------------------------------------------------

struct WArgs {
  const float* x;  // rows widened to fp32: [m][kq * 4], K tail zero
  int64_t m;
  const int8_t* w;   // packed
  const float* ws;   // [n]
  const void* bias;  // [n] in dt, or null
  void* out;
  int64_t out_st;
  int64_t n;
  int64_t kq;
  int64_t dt;
};

// The weight-only epilogue of the panels whose partial sums end in memory (AVX2, portable):
// y = acc * s_w (+ bias), one rounding.
template <int MR>
inline void w_store_rows(const WArgs& a, int64_t p, int64_t m0, const float* acc) {
  const int64_t n0 = p * kLanes;
  const int64_t valid = std::min<int64_t>(kLanes, a.n - n0);
  for (int r = 0; r < MR; ++r) {
    const int64_t row = (m0 + r) * a.out_st + n0;
    for (int64_t j = 0; j < valid; ++j) {
      float y = acc[r * kLanes + j] * a.ws[n0 + j];
      if (a.bias) y = y + load1(a.bias, n0 + j, a.dt);
      store1(a.out, row + j, y, a.dt);
    }
  }
}

#if defined(PW_I8_AVX512)

template <int MR>
void wpanel(const WArgs& a, int64_t p, int64_t m0, int64_t i0, int64_t i1, float* buf, bool first,
            bool last, const pw_panel::Prefetch& pf) {
  const int8_t* w = a.w + p * a.kq * kQuad * kLanes;
  const int64_t xst = a.kq * kQuad;
  const float* x = a.x + m0 * xst;
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < 4; ++b)
      acc[r][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(buf + r * kLanes + 16 * b);
  const int8_t* next = w + (i1 - i0) * kQuad * kLanes;
  int64_t turn = pf.phase;
  for (int64_t i = i0; i < i1; ++i) {
    const int8_t* wi = w + i * kQuad * kLanes;
    if (pf.every) {
      if (turn == 0) pw_panel::prefetch_step(next + i * kQuad * kLanes);
      if (++turn == pf.every) turn = 0;
    }
    for (int b = 0; b < 4; ++b) {
      const __m512i v = _mm512_loadu_si512(wi + 64 * b);
      // byte t of each lane, sign-extended: (v << (24 - 8t)) >> 24 (arithmetic)
      const __m512 f0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));
      const __m512 f1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24));
      const __m512 f2 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24));
      const __m512 f3 = _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24));
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * xst + kQuad * i;
        __m512 s = acc[r][b];
        s = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), f0, s);
        s = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), f1, s);
        s = _mm512_fmadd_ps(_mm512_set1_ps(xr[2]), f2, s);
        acc[r][b] = _mm512_fmadd_ps(_mm512_set1_ps(xr[3]), f3, s);
      }
    }
  }
  if (!last) {
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < 4; ++b) _mm512_storeu_ps(buf + r * kLanes + 16 * b, acc[r][b]);
    return;
  }
  const int64_t n0 = p * kLanes;
  for (int b = 0; b < 4; ++b) {
    const int64_t left = a.n - n0 - 16 * b;
    if (left <= 0) break;
    const __mmask16 mask = tail_mask(left);
    const __m512 ws = _mm512_maskz_loadu_ps(mask, a.ws + n0 + 16 * b);
    const __m512 bias = a.bias ? load16(a.bias, n0 + 16 * b, mask, a.dt) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      __m512 y = _mm512_mul_ps(acc[r][b], ws);
      if (a.bias) y = _mm512_add_ps(y, bias);
      store16(a.out, (m0 + r) * a.out_st + n0 + 16 * b, y, mask, a.dt);
    }
  }
}

#elif defined(PW_I8_AVX2)

// Weight-only on AVX2: byte t of each lane sign-extended by shifts and widened to fp32, four
// FMAs per k-quad in k order (as the AVX-512 path); tiles as the W8A8 AVX2 kernel.
template <int G, int V>
inline void wsweep(const int8_t* w, const float* x, int64_t xst, int64_t i0, int64_t i1, int v0,
                   float* acc_rows, const pw_panel::SweepPrefetch& spf) {
  __m256 acc[G][V];
  for (int r = 0; r < G; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_loadu_ps(acc_rows + r * kLanes + 8 * (v0 + v));
  pw_panel::sweep_steps(spf, w, kQuad * kLanes, i0, i1, [&](int64_t i) {
    const int8_t* wi = w + i * kQuad * kLanes + 32 * v0;
    for (int v = 0; v < V; ++v) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wi + 32 * v));
      const __m256 f0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(wv, 24), 24));
      const __m256 f1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(wv, 16), 24));
      const __m256 f2 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(wv, 8), 24));
      const __m256 f3 = _mm256_cvtepi32_ps(_mm256_srai_epi32(wv, 24));
      for (int r = 0; r < G; ++r) {
        const float* xr = x + r * xst + kQuad * i;
        __m256 s = acc[r][v];
        s = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), f0, s);
        s = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), f1, s);
        s = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 2), f2, s);
        acc[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 3), f3, s);
      }
    }
  });
  for (int r = 0; r < G; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc_rows + r * kLanes + 8 * (v0 + v), acc[r][v]);
}

template <int MR>
void wpanel(const WArgs& a, int64_t p, int64_t m0, int64_t i0, int64_t i1, float* buf, bool first,
            bool last, const pw_panel::Prefetch& pf) {
  const int8_t* w = a.w + p * a.kq * kQuad * kLanes;
  const int64_t xst = a.kq * kQuad;
  alignas(32) float acc[MR * kLanes];
  pw_panel::load_partials(acc, buf, MR * kLanes, first);
  const float* x = a.x + m0 * xst;
  pw_panel::pair_tiles<MR>(i0, i1, i1, kI8Avx2Block, pf, [&](auto g, auto v, int r, int64_t b0,
                                                             int64_t b1, int v0, const auto& spf) {
    constexpr int G = decltype(g)::value, V = decltype(v)::value;
    wsweep<G, V>(w, x + r * xst, xst, b0, b1, v0, acc + r * kLanes, spf);
  });
  if (last)
    w_store_rows<MR>(a, p, m0, acc);
  else
    std::copy(acc, acc + MR * kLanes, buf);
}

#else

template <int MR>
void wpanel(const WArgs& a, int64_t p, int64_t m0, int64_t i0, int64_t i1, float* buf, bool first,
            bool last, const pw_panel::Prefetch& /*pf*/) {
  const int8_t* w = a.w + p * a.kq * kQuad * kLanes;
  const int64_t xst = a.kq * kQuad;
  const float* x = a.x + m0 * xst;
  float acc[MR][kLanes];
  pw_panel::load_partials(&acc[0][0], buf, MR * kLanes, first);
  for (int64_t i = i0; i < i1; ++i) {
    const int8_t* wi = w + i * kQuad * kLanes;
    for (int r = 0; r < MR; ++r) {
      const float* xr = x + r * xst + kQuad * i;
      const float x0 = xr[0], x1 = xr[1], x2 = xr[2], x3 = xr[3];
#pragma omp simd
      for (int j = 0; j < kLanes; ++j)
        acc[r][j] += x0 * wi[4 * j] + x1 * wi[4 * j + 1] + x2 * wi[4 * j + 2] + x3 * wi[4 * j + 3];
    }
  }
  if (last)
    w_store_rows<MR>(a, p, m0, &acc[0][0]);
  else
    std::copy(&acc[0][0], &acc[0][0] + MR * kLanes, buf);
}

#endif

// --- the driver: csrc/panel_loop.h (panels over threads, rows in passes of <= 6) ----------

template <class Prologue>
void run_quantized(const QArgs& a, const Prologue& prologue) {
#if defined(PW_I8_AMX)
  if (a.m >= kAmxMinRows && pw_amx::permitted()) return amx::run_quantized(a, prologue);
#endif
  pw_panel::run_panels<int32_t>(
      a.m, (a.n + kLanes - 1) / kLanes, a.kq, kBlockQuads, kLanes, a.n * a.kq * kQuad, prologue,
      [&a](int64_t p, int64_t m0, int64_t mr, int64_t i0, int64_t i1, int32_t* buf, bool first,
           bool last, const pw_panel::Prefetch& pf) {
        switch (mr) {
          case 1: return qpanel<1>(a, p, m0, i0, i1, buf, first, last, pf);
          case 2: return qpanel<2>(a, p, m0, i0, i1, buf, first, last, pf);
          case 3: return qpanel<3>(a, p, m0, i0, i1, buf, first, last, pf);
          case 4: return qpanel<4>(a, p, m0, i0, i1, buf, first, last, pf);
          case 5: return qpanel<5>(a, p, m0, i0, i1, buf, first, last, pf);
          default: return qpanel<6>(a, p, m0, i0, i1, buf, first, last, pf);
        }
      });
}

template <class Prologue>
void run_weight_only(const WArgs& a, const Prologue& prologue) {
  pw_panel::run_panels<float>(
      a.m, (a.n + kLanes - 1) / kLanes, a.kq, kBlockQuads, kLanes, a.n * a.kq * kQuad, prologue,
      [&a](int64_t p, int64_t m0, int64_t mr, int64_t i0, int64_t i1, float* buf, bool first,
           bool last, const pw_panel::Prefetch& pf) {
        switch (mr) {
          case 1: return wpanel<1>(a, p, m0, i0, i1, buf, first, last, pf);
          case 2: return wpanel<2>(a, p, m0, i0, i1, buf, first, last, pf);
          case 3: return wpanel<3>(a, p, m0, i0, i1, buf, first, last, pf);
          case 4: return wpanel<4>(a, p, m0, i0, i1, buf, first, last, pf);
          case 5: return wpanel<5>(a, p, m0, i0, i1, buf, first, last, pf);
          default: return wpanel<6>(a, p, m0, i0, i1, buf, first, last, pf);
        }
      });
}

// Row r of x widened to fp32 (kpad floats, the K tail zero).
inline void widen_row(const void* x, int64_t k, int64_t dt, float* xf, int64_t kpad) {
  if (dt == kBFloat16) {
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < k; ++i) xf[i] = bf16_to_f32(xb[i]);
  } else {
    std::memcpy(xf, x, static_cast<size_t>(k) * sizeof(float));
  }
  std::fill(xf + k, xf + kpad, 0.0f);
}

inline int check(int64_t m, int64_t x_st, int64_t out_st, int64_t n, int64_t k, int64_t dt) {
  if (dt != kFloat32 && dt != kBFloat16) return 1;
  if (m < 0 || n <= 0 || k <= 0 || x_st < k || out_st < n) return 2;
  return 0;
}

inline const char* byte_offset(const void* p, int64_t elems, int64_t dt) {
  return static_cast<const char*>(p) + elems * (dt == kBFloat16 ? 2 : 4);
}

}  // namespace pw_int8

extern "C" {

// W8A8 with dynamic per-token activation quantisation.  x [m, k] (row stride x_st) and out
// [m, n] (row stride out_st) in `dtype` (0 = float32, 1 = bfloat16), as is bias [n] (or null);
// w the packed int8 weight (layout above), comp [n] int32 = 128 * row sums of W_q, w_scale [n]
// fp32.  Returns 0, or 1 for a bad dtype, 2 for bad sizes.
int piecewise_int8_linear(const void* x, int64_t x_st, int64_t m, const void* w_packed,
                          const int32_t* comp, const float* w_scale, const void* bias, void* out,
                          int64_t out_st, int64_t n, int64_t k, int64_t dtype) {
  using namespace pw_int8;
  if (int rc = check(m, x_st, out_st, n, k, dtype)) return rc;
  if (m == 0) return 0;
  const int64_t kq = (k + kQuad - 1) / kQuad, kpad = kq * kQuad;
  thread_local std::vector<uint8_t> u;
  thread_local std::vector<float> xs;
  u.resize(m * kpad);
  xs.resize(m);
  uint8_t* const up = u.data();
  float* const xsp = xs.data();
  const QArgs a{up,     xsp, m,  static_cast<const int8_t*>(w_packed), comp, w_scale, bias, out,
                out_st, n,   kq, dtype};
  run_quantized(a, [=](int64_t r) {
    xsp[r] = quantize_row(byte_offset(x, r * x_st, dtype), k, dtype, up + r * kpad, kpad);
  });
  return 0;
}

// Weight-only int8: x, bias, out as above; w_scale [n] fp32.
int piecewise_int8_wo_linear(const void* x, int64_t x_st, int64_t m, const void* w_packed,
                             const float* w_scale, const void* bias, void* out, int64_t out_st,
                             int64_t n, int64_t k, int64_t dtype) {
  using namespace pw_int8;
  if (int rc = check(m, x_st, out_st, n, k, dtype)) return rc;
  if (m == 0) return 0;
  const int64_t kq = (k + kQuad - 1) / kQuad, kpad = kq * kQuad;
  thread_local std::vector<float> xf;
  xf.resize(m * kpad);
  float* const xp = xf.data();
  const WArgs a{xp, m, static_cast<const int8_t*>(w_packed), w_scale, bias, out, out_st, n, kq,
                dtype};
  run_weight_only(a, [=](int64_t r) {
    widen_row(byte_offset(x, r * x_st, dtype), k, dtype, xp + r * kpad, kpad);
  });
  return 0;
}

// Outputs per panel and k per lane of the packed layout.
int64_t piecewise_int8_linear_lanes() { return pw_int8::kLanes; }
int64_t piecewise_int8_linear_quad() { return pw_int8::kQuad; }

// Which instruction set the build uses (for logs and benchmarks).
const char* piecewise_int8_linear_isa() {
#if defined(PW_I8_AMX)
  if (pw_amx::permitted()) return "amx_int8";
#endif
#if defined(PW_I8_VNNI)
  return "avx512_vnni";
#elif defined(PW_I8_AVX512)
  return "avx512";
#elif defined(PW_I8_AVX2)
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
