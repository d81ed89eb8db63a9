// The row argmax both greedy kernels share: the sampler's pass over logits rows
// (framework/engine/csrc/greedy_argmax.cpp) and the LM head's fused epilogue
// (passes/csrc/small_m_linear.cpp, over the columns a thread just wrote).
//
// row_argmax(x, n, &idx, &val): over n bf16 (uint16_t bits) or float values, the index of the
// first maximum and that maximum.  A row holding a NaN gets its first NaN's index and a NaN
// value (as numpy's argmax and torch.max); ties go to the first index; a row of -inf gets
// index 0.
//
// The pass keeps 16 lanes (lane l sees columns l, l + 16, ...), each with its running maximum
// and the column of its FIRST occurrence (strict >); the row's first maximum is then the
// smallest column among the lanes that hold the row's maximum.  A NaN seen anywhere is noted
// in the same pass; only such rows are scanned again for their first NaN.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pw_argmax {

constexpr int kLanes = 16;

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {  // bfloat16 bits: exact
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The first NaN of a row holding one.
template <typename T>
void first_nan(const T* x, int64_t n, int64_t* idx, float* val) {
  for (int64_t j = 0; j < n; ++j) {
    const float v = to_f32(x[j]);
    if (v != v) {
      *idx = j;
      *val = v;
      return;
    }
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The same rule in registers: kSets x 16 lanes (set s takes the chunks of 16 columns whose
// number is s mod kSets, so the compare-and-keep chains of the sets run side by side), the
// columns as int32 (rows of < 2^31 values).
constexpr int kSets = 4;

template <typename T>
void row_argmax(const T* x, int64_t n, int64_t* idx, float* val) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 best[kSets];
  __m512i col[kSets];
  for (int k = 0; k < kSets; ++k) {
    best[k] = ninf;
    col[k] = iota;  // a set that never sees a column keeps -inf: it loses every tie below
  }
  __mmask16 nan = 0;
  const int64_t group = kSets * kLanes, full = n / group * group;
  for (int64_t j0 = 0; j0 < full; j0 += group) {
    for (int k = 0; k < kSets; ++k) {
      const __m512 v = load16(x + j0 + k * kLanes, 0xffff);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 more = _mm512_cmp_ps_mask(v, best[k], _CMP_GT_OQ);
      best[k] = _mm512_mask_mov_ps(best[k], more, v);
      col[k] = _mm512_mask_mov_epi32(
          col[k], more,
          _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(j0 + k * kLanes))));
    }
  }
  for (int64_t j0 = full, k = 0; j0 < n; j0 += kLanes, ++k) {  // the tail, set by set
    const int64_t left = n - j0;
    const __mmask16 live =
        left >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 v = _mm512_mask_mov_ps(ninf, live, load16(x + j0, live));
    nan |= _mm512_mask_cmp_ps_mask(live, v, v, _CMP_UNORD_Q);
    const __mmask16 more = _mm512_cmp_ps_mask(v, best[k], _CMP_GT_OQ);
    best[k] = _mm512_mask_mov_ps(best[k], more, v);
    col[k] = _mm512_mask_mov_epi32(
        col[k], more, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(j0))));
  }
  if (nan) return first_nan(x, n, idx, val);
  __m512 b = best[0];
  for (int k = 1; k < kSets; ++k) b = _mm512_max_ps(b, best[k]);
  const float m = _mm512_reduce_max_ps(b);
  const __m512 mv = _mm512_set1_ps(m);
  int64_t first = INT32_MAX;
  for (int k = 0; k < kSets; ++k) {
    const __mmask16 at = _mm512_cmp_ps_mask(best[k], mv, _CMP_EQ_OQ);
    if (at) first = std::min<int64_t>(first, _mm512_mask_reduce_min_epi32(at, col[k]));
  }
  if (first >= n) first = 0;  // every value -inf: the first column
  *idx = first;
  *val = m;
}
#else
template <typename T>
void row_argmax(const T* x, int64_t n, int64_t* idx, float* val) {
  float best[kLanes];
  int64_t col[kLanes];
  int nan = 0;
  for (int l = 0; l < kLanes; ++l) {
    best[l] = -std::numeric_limits<float>::infinity();
    col[l] = l;
  }
  const int64_t full = n / kLanes * kLanes;
  for (int64_t j = 0; j < full; j += kLanes) {
#pragma omp simd reduction(| : nan)
    for (int l = 0; l < kLanes; ++l) {
      const float v = to_f32(x[j + l]);
      nan |= v != v;
      const bool more = v > best[l];
      best[l] = more ? v : best[l];
      col[l] = more ? j + l : col[l];
    }
  }
  for (int64_t j = full; j < n; ++j) {  // the tail, into its lanes
    const float v = to_f32(x[j]);
    const int l = static_cast<int>(j - full);
    nan |= v != v;
    if (v > best[l]) {
      best[l] = v;
      col[l] = j;
    }
  }
  if (nan) return first_nan(x, n, idx, val);
  float m = best[0];
  for (int l = 1; l < kLanes; ++l) m = best[l] > m ? best[l] : m;
  int64_t first = n;  // lanes whose column is past the row (n < 16) hold -inf and lose ties
  for (int l = 0; l < kLanes; ++l)
    if (best[l] == m && col[l] < first) first = col[l];
  if (first >= n) first = 0;
  *idx = first;
  *val = m;
}
#endif

}  // namespace pw_argmax
