// Fused CPU paged attention (see backends/attention/cpu_paged.py for the contract).
//
// One call writes the new K/V rows at their cache slots, then computes causal attention of
// every query token straight from the block table with an online softmax (fp32 accumulation),
// for decode and mixed prefill+decode batches.  GQA/MQA: a work item is (request, KV head,
// tile of query tokens) and handles all Hq/Hkv query heads that share the KV head, so K/V are
// read once per item and never repeated; on the direct bf16 path, where a call's tiles are
// decode or verify sized and at least two per thread, an item takes every KV head of its tile
// instead, reading each key row whole rather than a head's slice of it (the same arithmetic
// per row, hence the same bits: b8 / b32 decode calls 0.8-0.93x the time, `attention_ab`).  Sliding window: keys in [pos - window + 1, pos].
//
// bf16 caches on AVX512-BF16 builds (head_dim 32/64/128/256) take the direct path
// (namespace `direct` below): K and V are read from the cache as bf16, never staged, the
// scores come from `vdpbf16ps` and the rows of a query group share each widened V row.
// Everything else (fp32, other head sizes, AVX2 and portable builds) takes the staged path:
// per KV block, the block's K and V rows of the head are staged once in fp32; the scores of
// 16 keys come from D/16 FMAs per key and one transposing reduction when the build targets
// AVX-512 (8 keys from D/8 FMAs and two horizontal-add levels on AVX2 + FMA; a plain
// `omp simd` dot product elsewhere); the value accumulator of a row stays in registers across
// the block's keys.  With AVX-512 the block's softmax max and exp run 16 keys per
// instruction (8 with AVX2 + FMA), the exp bit-identical to the scalar one (GCC left that loop
// scalar: a fifth of a decode call); `python -m experiments.bench.attention_ab` times a change
// of this file against an earlier revision and checks the bits.
//
// No torch headers: plain C ABI called through ctypes on data pointers, so the build is one
// g++ call of ~1-2 s.  Other loops are vectorised by the compiler (`omp simd`, built with
// -O3 -march=native when the build is per machine; see cpu_paged_build.py).  Threads come from
// OpenMP; the library links libgomp.so.1 by soname, which resolves to the copy torch already
// loaded, so torch.set_num_threads governs it and no second thread pool exists.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int kQueryTile = 16;      // query tokens per work item (prefill rows share K/V reads)
constexpr int kMaxHeadDim = 256;
// KV blocks prefetched ahead of the one being read (see run_item).  2-4 blocks ahead were
// tried (tiny model, b8 decode in the engine, and cold calls of the attention bench) and
// were no better than 1 within this machine's noise; 2 again with the direct bf16 path
// (attention_ab, 9 rounds: cold 0.91-1.05x, hot 0.95-1.15x of 1 block), so still 1.
constexpr int64_t kPrefetchBlocks = 1;
// Query tiles per thread from which an item takes every KV head of its tile (direct path).
constexpr int64_t kGroupTilesPerThread = 2;
constexpr int32_t kGroupMaxQuery = 8;  // ... and the longest query of the call is at most this

// The same conversions as framework/core/csrc/bf16.h (the other native kernels' one home for
// them), written here again because this file is built alone, also from other revisions
// (experiments.bench.attention_ab copies it into a scratch folder without the project's headers).
inline float bf16_to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline void load_row(const float* src, float* dst, int n) { std::memcpy(dst, src, n * 4); }
inline void load_row(const uint16_t* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
inline void store_row(const float* src, float* dst, int n, float mul) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = src[i] * mul;
}
inline void store_row(const float* src, uint16_t* dst, int n, float mul) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i] * mul);
}

// exp for x <= 0 (Cephes expf polynomial, ~1-2 ulp); vectorisable; returns 0 below -87.
inline float exp_neg(float x) {
  const bool underflow = x < -87.0f;
  x = std::max(x, -87.0f);
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  int32_t e = static_cast<int32_t>(n) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float p;
  std::memcpy(&p, &bits, 4);
  return underflow ? 0.0f : y * p;
}

#if defined(__AVX512F__)
// exp_neg on 16 lanes: the same operations in the same order (GCC contracts the scalar
// version's multiply-adds into the same FMAs), so every lane has exp_neg's bits; checked on
// 64 M inputs in [-100, 0] plus 0, -0, -87, -inf and NaN.  (GCC leaves the scalar one
// unvectorised in the softmax loop: there it cost a fifth of a decode call.)
inline __m512 exp_neg16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(lo, x);  // (lo, x): a NaN x stays NaN, as std::max(x, lo) leaves it
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), y,
                             _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}

inline __mmask16 first_lanes(int n) {  // the first n (0..16) of 16 lanes
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}

// Lane j of the result = the sum of the 16 lanes of v[j]: 16 keys' partial-product vectors
// turned into their 16 scores by one transposing reduction (no per-key horizontal sum).
inline __m512 sum_each16(const __m512* v) {
  __m512 t8[8], u4[4];
  for (int i = 0; i < 8; ++i)
    t8[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                          _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x0 = _mm512_castps_pd(t8[2 * i]), x1 = _mm512_castps_pd(t8[2 * i + 1]);
    u4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x0, x1)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(x0, x1)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u4[0], u4[1], 0x88),
                                  _mm512_shuffle_f32x4(u4[0], u4[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u4[2], u4[3], 0x88),
                                  _mm512_shuffle_f32x4(u4[2], u4[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// sr[j] = exp(sr[j] - m) for j < nk and 0 for nk <= j < bs, 16 keys per instruction; returns
// the lane-wise sums of the 16-key groups (what the direct path reduces into the block's sum).
inline __m512 block_exp16(float* sr, int nk, int bs, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int j0 = 0; j0 < bs; j0 += 16) {
    const __mmask16 slots = first_lanes(bs - j0), live = first_lanes(std::max(0, nk - j0));
    const __m512 e = _mm512_maskz_mov_ps(
        live, exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sr + j0), mv)));
    _mm512_mask_storeu_ps(sr + j0, slots, e);
    sum = _mm512_add_ps(sum, e);
  }
  return sum;
}
#elif defined(__AVX2__) && defined(__FMA__)
// exp_neg on 8 lanes, as exp_neg16 on 16: the same operations in the same order, so every
// lane has exp_neg's bits (the scalar one contracted into the same FMAs; checked by the
// tests on 200 k inputs in [-100, 0] plus the edges).  Without it GCC leaves the softmax's
// exp scalar on AVX2 builds too.
inline __m256 exp_neg8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, x);  // (lo, x): a NaN x stays NaN, as std::max(x, lo) leaves it
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(y, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_andnot_ps(under,
                          _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23))));
}

inline __m256i first_lanes8(int n) {  // all-ones in the first n (any int) of 8 lanes
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// sr[j] = exp(sr[j] - m) for j < nk and 0 for nk <= j < bs, 8 keys per instruction.
inline void block_exp8(float* sr, int nk, int bs, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  for (int j0 = 0; j0 < bs; j0 += 8) {
    const __m256i slots = first_lanes8(bs - j0), live = first_lanes8(nk - j0);
    const __m256 e = _mm256_and_ps(
        _mm256_castsi256_ps(live), exp_neg8(_mm256_sub_ps(_mm256_maskload_ps(sr + j0, live), mv)));
    _mm256_maskstore_ps(sr + j0, slots, e);
  }
}
#endif

// The largest of sr[0, nk) (-inf when nk is 0).
inline float row_max(const float* sr, int nk) {
#if defined(__AVX512F__)
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int j0 = 0; j0 < nk; j0 += 16) {
    const __mmask16 live = first_lanes(nk - j0);
    mx = _mm512_mask_max_ps(mx, live, mx, _mm512_maskz_loadu_ps(live, sr + j0));
  }
  return _mm512_reduce_max_ps(mx);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int j0 = 0; j0 < nk; j0 += 8) {
    const __m256i live = first_lanes8(nk - j0);
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(mx, _mm256_maskload_ps(sr + j0, live),
                                            _mm256_castsi256_ps(live)));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
#else
  float mb = -INFINITY;
  for (int j = 0; j < nk; ++j) mb = std::max(mb, sr[j]);
  return mb;
#endif
}

// sr[j] = exp(sr[j] - m) for j < nk and 0 for nk <= j < bs; returns the sum over all bs
// slots.  The sum's association depends on bs only, not on nk: a verify row of a speculative
// step reads more (masked) keys than the decode step it stands for, and must give its bits.
// (The sum is the compiler's `omp simd` reduction, as before the exp was vectorised: its
// association is part of the bf16 results, and greedy tokens of the random-weight test models
// flip on an ulp.)
inline float block_exp_sum(float* sr, int nk, int bs, float m) {
#if defined(__AVX512F__)
  block_exp16(sr, nk, bs, m);
#elif defined(__AVX2__) && defined(__FMA__)
  block_exp8(sr, nk, bs, m);
#else
#pragma omp simd
  for (int j = 0; j < nk; ++j) sr[j] = exp_neg(sr[j] - m);
  std::fill(sr + nk, sr + bs, 0.0f);
#endif
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < bs; ++j) sum += sr[j];
  return sum;
}

struct Args {
  const void* q; int64_t q_st;        // [T, Hq, D], token stride in elements
  const void* k; int64_t k_st;        // [T, Hkv, D]
  const void* v; int64_t v_st;
  void* out; int64_t out_st;          // [T_pad, Hq, D]
  void* kv_cache;                     // [2, NB, BS, Hkv, D] contiguous
  int64_t num_blocks, block_size;
  const int64_t* slot_mapping;        // [T]
  const int32_t* block_table; int64_t bt_st;
  const int32_t* qsl;                 // [R + 1]
  const int32_t* seq_lens;            // [R]
  int64_t num_reqs, num_tokens, num_padded;
  int64_t hq, hkv, d;
  float scale;
  int64_t window;
};

// s[r * s_stride + j] = dot(q[r], k[j]) for r < rows, j < nk (q, k fp32 rows of length d).
template <int kD>
inline void block_scores(const float* __restrict q, int rows, const float* __restrict k, int nk,
                         int d_rt, float* __restrict s, int s_stride) {
#if defined(__AVX512F__)
  if constexpr (kD > 0 && kD % 16 == 0) {
    // 16 keys at a time: per key a vector of D/16 partial products, then one transposing
    // reduction turns 16 such vectors into the 16 scores (no per-key horizontal sum).
    constexpr int V = kD / 16;
    for (int r = 0; r < rows; ++r) {
      __m512 qv[V];
      for (int x = 0; x < V; ++x) qv[x] = _mm512_loadu_ps(q + r * kD + 16 * x);
      for (int j0 = 0; j0 < nk; j0 += 16) {
        const int n = std::min(16, nk - j0);
        __m512 accs[16];
        for (int j = 0; j < 16; ++j) {
          __m512 t = _mm512_setzero_ps();
          if (j < n) {
            const float* kr = k + (j0 + j) * kD;
            for (int x = 0; x < V; ++x) t = _mm512_fmadd_ps(qv[x], _mm512_loadu_ps(kr + 16 * x), t);
          }
          accs[j] = t;
        }
        _mm512_mask_storeu_ps(s + r * s_stride + j0, first_lanes(n), sum_each16(accs));
      }
    }
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (kD > 0 && kD % 8 == 0) {
    // 8 keys at a time: per key a vector of D/8 partial products, then two horizontal-add
    // levels and one 128-bit lane swap turn 8 such vectors into the 8 scores.
    constexpr int V = kD / 8;
    for (int r = 0; r < rows; ++r) {
      __m256 qv[V];
      for (int x = 0; x < V; ++x) qv[x] = _mm256_loadu_ps(q + r * kD + 8 * x);
      for (int j0 = 0; j0 < nk; j0 += 8) {
        const int n = std::min(8, nk - j0);
        __m256 accs[8];
        for (int j = 0; j < 8; ++j) {
          __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps();
          if (j < n) {
            const float* kr = k + (j0 + j) * kD;
            for (int x = 0; x + 1 < V; x += 2) {
              t0 = _mm256_fmadd_ps(qv[x], _mm256_loadu_ps(kr + 8 * x), t0);
              t1 = _mm256_fmadd_ps(qv[x + 1], _mm256_loadu_ps(kr + 8 * x + 8), t1);
            }
            if constexpr (V % 2)
              t0 = _mm256_fmadd_ps(qv[V - 1], _mm256_loadu_ps(kr + 8 * (V - 1)), t0);
          }
          accs[j] = _mm256_add_ps(t0, t1);
        }
        // h[i] = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] for keys (2i, 2i+1)
        const __m256 h0 = _mm256_hadd_ps(accs[0], accs[1]), h1 = _mm256_hadd_ps(accs[2], accs[3]);
        const __m256 h2 = _mm256_hadd_ps(accs[4], accs[5]), h3 = _mm256_hadd_ps(accs[6], accs[7]);
        // u0 = [k0 k1 k2 k3 | k0 k1 k2 k3]: lanes 0..3 of each key summed, then lanes 4..7
        const __m256 u0 = _mm256_hadd_ps(h0, h1), u1 = _mm256_hadd_ps(h2, h3);
        const __m256 sc = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                        _mm256_permute2f128_ps(u0, u1, 0x31));
        if (n == 8) {
          _mm256_storeu_ps(s + r * s_stride + j0, sc);
        } else {
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, sc);
          for (int j = 0; j < n; ++j) s[r * s_stride + j0 + j] = tmp[j];
        }
      }
    }
    return;
  }
#endif
  const int d = kD > 0 ? kD : d_rt;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < nk; ++j) {
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int x = 0; x < d; ++x) sum += q[r * d + x] * k[j * d + x];
      s[r * s_stride + j] = sum;
    }
}

// acc[x] += sum_j p[j] * v[j][x]; the accumulator stays in registers across the keys.
template <int kD>
inline void accumulate_values(float* __restrict acc, const float* __restrict p,
                              const float* __restrict v, int nk, int d_rt) {
#if defined(__AVX512F__)
  if constexpr (kD > 0 && kD % 16 == 0) {  // the row in kD / 16 registers across the keys
    constexpr int V = kD / 16;
    __m512 a[V];
    for (int x = 0; x < V; ++x) a[x] = _mm512_loadu_ps(acc + 16 * x);
    for (int j = 0; j < nk; ++j) {
      const __m512 pj = _mm512_set1_ps(p[j]);
      for (int x = 0; x < V; ++x)
        a[x] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + j * kD + 16 * x), a[x]);
    }
    for (int x = 0; x < V; ++x) _mm512_storeu_ps(acc + 16 * x, a[x]);
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // The row in kD / 8 registers across the keys (as the AVX-512 path): against GCC's
  // `omp simd` loop below, 0.89-0.99x hot and 0.84-0.99x cold, same bits (attention_ab,
  // 15 rounds: experiments/bench/results/attention_ab_avx2_values_2026-12-07.txt).
  if constexpr (kD > 0 && kD % 8 == 0 && kD <= 96) {
    constexpr int V = kD / 8;
    __m256 a[V];
    for (int x = 0; x < V; ++x) a[x] = _mm256_loadu_ps(acc + 8 * x);
    for (int j = 0; j < nk; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      for (int x = 0; x < V; ++x)
        a[x] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * kD + 8 * x), a[x]);
    }
    for (int x = 0; x < V; ++x) _mm256_storeu_ps(acc + 8 * x, a[x]);
    return;
  }
#endif
  if constexpr (kD > 0) {
    float a[kD];
#pragma omp simd
    for (int x = 0; x < kD; ++x) a[x] = acc[x];
    for (int j = 0; j < nk; ++j) {
      const float pj = p[j];
#pragma omp simd
      for (int x = 0; x < kD; ++x) a[x] += pj * v[j * kD + x];
    }
#pragma omp simd
    for (int x = 0; x < kD; ++x) acc[x] = a[x];
  } else {
    for (int j = 0; j < nk; ++j)
#pragma omp simd
      for (int x = 0; x < d_rt; ++x) acc[x] += p[j] * v[j * d_rt + x];
  }
}

// A work item: query tokens [q0, q1) of request `req` against KV heads [head, head + heads).
struct Item { int32_t req, q0, q1, head, heads; };

// The item's K/V rows are block_size rows of D elements at a stride of Hkv * D, in blocks
// anywhere in the cache: no hardware prefetcher follows them, and a decode step's KV comes
// from DRAM (the step's weights evicted it).  So the rows of the next kPrefetchBlocks blocks
// are prefetched ahead of their use (block b of the item's table; none past b_last or for an
// id outside the cache, which the loop reports when it reaches it).
template <typename T>
inline void prefetch_block(const Args& a, const Item& it, const T* kc, const T* vc,
                           int64_t b, int64_t b_last) {
  if (b > b_last) return;
  const int32_t id = a.block_table[it.req * a.bt_st + b];
  if (id < 0 || id >= a.num_blocks) return;
  const int64_t nbase = static_cast<int64_t>(id) * a.block_size;
  const int64_t d = a.d;
  const int64_t bytes = d * it.heads * static_cast<int64_t>(sizeof(T));  // the item's heads
  for (int64_t j = 0; j < a.block_size; ++j) {
    const int64_t row = ((nbase + j) * a.hkv + it.head) * d;
    for (int64_t x = 0; x < bytes; x += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(kc + row) + x);
      __builtin_prefetch(reinterpret_cast<const char*>(vc + row) + x);
    }
  }
}

// The keys an item's tile reads: its first query's window start .. its last query's position
// (inclusive), and the blocks of the item's table that hold them.  Rows of the tile see
// [pos - window + 1, pos] with pos from pos0 (first query) to pos1 (last).
struct ItemKeys {
  int64_t pos0, pos1, win, kend, b_first, b_last;
  ItemKeys(const Args& a, const Item& it) {
    const int32_t qs = a.qsl[it.req], ql = a.qsl[it.req + 1] - qs;
    const int64_t L = a.seq_lens[it.req];
    pos0 = L - ql + it.q0;
    pos1 = L - ql + it.q1 - 1;
    win = a.window;
    const int64_t kstart = win > 0 ? std::max<int64_t>(0, pos0 - win + 1) : 0;
    kend = pos1;
    b_first = kstart / a.block_size;
    b_last = kend / a.block_size;
  }
};

// block(b, base, nk) for each KV block b of the item, in order: its first cache row `base`
// and its nk keys (from the block's start, so a key's score sits at its offset in the block
// whatever the tile's window start; those before the window are masked by the caller),
// kPrefetchBlocks blocks prefetched ahead.  False (and no further call) when the table names
// a block outside the cache.
template <typename T, class Block>
inline bool for_each_block(const Args& a, const Item& it, const ItemKeys& keys, const T* kc,
                           const T* vc, Block&& block) {
  const int32_t* table = a.block_table + it.req * a.bt_st;
  const int64_t bs = a.block_size;
  for (int64_t b = keys.b_first; b < keys.b_first + kPrefetchBlocks; ++b)
    prefetch_block(a, it, kc, vc, b, keys.b_last);
  for (int64_t b = keys.b_first; b <= keys.b_last; ++b) {
    if (table[b] < 0 || table[b] >= a.num_blocks) return false;
    prefetch_block(a, it, kc, vc, b + kPrefetchBlocks, keys.b_last);
    block(b, static_cast<int64_t>(table[b]) * bs,
          static_cast<int>(std::min<int64_t>(keys.kend - b * bs + 1, bs)));
  }
  return true;
}

// Rows are (query token, head) pairs; row r sees keys [pos - window + 1, pos] with
// pos = pos0 + r / g.  The scores s[r * bs + j] of keys kb0 + j (j < nk) outside a row's range
// become -inf; a block inside every row's range (all of a decode's blocks but the window's
// edge) is left as it is.
inline void mask_block(float* s, int rows, int g, int bs, int nk, int64_t kb0, int64_t pos0,
                       int64_t pos1, int64_t win) {
  const int64_t kb1 = kb0 + nk - 1;
  if (kb1 <= pos0 && (win <= 0 || kb0 > pos1 - win)) return;
  for (int r = 0; r < rows; ++r) {
    const int64_t pos = pos0 + r / g;
    for (int j = 0; j < nk; ++j) {
      const int64_t kpos = kb0 + j;
      if (kpos > pos || (win > 0 && kpos <= pos - win)) s[r * bs + j] = -INFINITY;
    }
  }
}

// Returns false when the block table names a block outside the cache.
// kD > 0: head_dim known at compile time (fully unrolled, no loop remainders); 0: generic.
template <typename T, int kD>
bool run_item(const Args& a, const Item& it, std::vector<float>& scratch) {
  const int d = kD > 0 ? kD : static_cast<int>(a.d), g = static_cast<int>(a.hq / a.hkv);
  const int bs = static_cast<int>(a.block_size);
  const int qs = a.qsl[it.req];
  const int nq = it.q1 - it.q0, rows = nq * g;
  scratch.resize(static_cast<size_t>(rows) * (2 * d + bs + 2) + 2 * static_cast<size_t>(bs) * d);
  float* qf = scratch.data();                   // [rows, d], pre-scaled
  float* acc = qf + rows * d;                   // [rows, d]
  float* s = acc + rows * d;                    // [rows, bs]
  float* m = s + rows * bs;                     // [rows]
  float* l = m + rows;                          // [rows]
  float* kblk = l + rows;                       // [bs, d]: this block's keys in fp32
  float* vblk = kblk + bs * d;                  // [bs, d]: values
  const T* q = static_cast<const T*>(a.q);
  for (int i = 0; i < nq; ++i)
    for (int j = 0; j < g; ++j) {
      const T* src = q + (qs + it.q0 + i) * a.q_st + (it.head * g + j) * d;
      float* dst = qf + (i * g + j) * d;
      load_row(src, dst, d);
#pragma omp simd
      for (int x = 0; x < d; ++x) dst[x] *= a.scale;
    }
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(m, m + rows, -INFINITY);
  std::fill(l, l + rows, 0.0f);
  const ItemKeys keys(a, it);
  const T* kc = static_cast<const T*>(a.kv_cache);
  const T* vc = kc + a.num_blocks * a.block_size * a.hkv * d;
  const bool ok = for_each_block(a, it, keys, kc, vc, [&](int64_t b, int64_t base, int nk) {
    for (int j = 0; j < nk; ++j) {
      load_row(kc + ((base + j) * a.hkv + it.head) * d, kblk + j * d, d);
      load_row(vc + ((base + j) * a.hkv + it.head) * d, vblk + j * d, d);
    }
    block_scores<kD>(qf, rows, kblk, nk, d, s, bs);
    mask_block(s, rows, g, bs, nk, b * bs, keys.pos0, keys.pos1, keys.win);
    for (int r = 0; r < rows; ++r) {
      float* sr = s + r * bs;
      const float mb = row_max(sr, nk);
      if (mb == -INFINITY) {  // every key of this block is masked for this row
        for (int j = 0; j < nk; ++j) sr[j] = 0.0f;
        continue;
      }
      float* ar = acc + r * d;
      const float m_new = std::max(m[r], mb);
      if (m_new > m[r]) {
        const float alpha = exp_neg(m[r] - m_new);
#pragma omp simd
        for (int x = 0; x < d; ++x) ar[x] *= alpha;
        l[r] *= alpha;
        m[r] = m_new;
      }
      l[r] += block_exp_sum(sr, nk, bs, m_new);
      accumulate_values<kD>(ar, sr, vblk, nk, d);
    }
  });
  if (!ok) return false;
  T* out = static_cast<T*>(a.out);
  for (int i = 0; i < nq; ++i)
    for (int j = 0; j < g; ++j) {
      const int r = i * g + j;
      T* dst = out + (qs + it.q0 + i) * a.out_st + (it.head * g + j) * d;
      store_row(acc + r * d, dst, d, l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
    }
  return true;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PW_ATTN_BF16_DIRECT 1
// bf16 K/V read straight from the cache, never staged (AVX512-BF16 builds, head_dim a
// multiple of 32).  The staged path above converts a block's K and V rows to fp32 in scratch
// and reads them back per row: on a decode step (2 query rows a KV head) that staging was
// the largest part of a call, with the softmax sum's serial adds the next.  Here:
//
// * scores: one `vdpbf16ps` per 32 elements of a key row against the query row as bf16 (the
//   model's own q; products of two bf16 are exact in fp32, summed in fp32), 16 keys' partial
//   vectors turned into their 16 scores by the same transposing reduction, then x scale;
// * values: the rows of a KV head's query group (up to value_rows() at a time) keep their
//   output accumulators in registers while each key's V row is widened to fp32 once and
//   meets every row's probability (fp32, as before: no bf16 rounding of P);
// * the softmax sum of a block is one vector reduction (its association depends on the block
//   size only, as before).
//
// Every row's result depends only on its own query, keys and the block size, never on the
// other rows of its tile or the tile's size: a verify row of a speculative step has the bits
// of the decode step it stands for.
namespace direct {

// Rows whose value accumulators share one pass over a block's V rows: D / 16 registers each,
// beside the key's widened V row (D / 16) and the broadcast probability, in 32 registers.
template <int kD>
constexpr int value_rows() {
  return std::max(1, (31 - kD / 16) / (kD / 16));
}

// exp(sr[j] - m) in place for j < nk, 0 for nk <= j < bs; returns their sum.
inline float exp_sum(float* sr, int nk, int bs, float m) {
  return _mm512_reduce_add_ps(block_exp16(sr, nk, bs, m));
}

// s[j] = scale * dot(q, K row j) for j < nk (q: the query row, bf16, as kD / 32 vectors).
template <int kD>
inline void row_scores(const __m512bh* qv, const uint16_t* k0, int64_t k_st, int nk,
                       float scale, float* s) {
  constexpr int V = kD / 32;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int j0 = 0; j0 < nk; j0 += 16) {
    const int n = std::min(16, nk - j0);
    __m512 accs[16];
    for (int j = 0; j < 16; ++j) {
      __m512 t = _mm512_setzero_ps();
      if (j < n) {
        const uint16_t* kr = k0 + (j0 + j) * k_st;
        for (int x = 0; x < V; ++x)
          t = _mm512_dpbf16_ps(t, qv[x], (__m512bh)_mm512_loadu_si512(kr + 32 * x));
      }
      accs[j] = t;
    }
    _mm512_mask_storeu_ps(s + j0, first_lanes(n), _mm512_mul_ps(sum_each16(accs), sv));
  }
}

// acc[r] += sum_j p[r][j] * V row j for the R rows listed in `rows` (acc and p: fp32, row r
// at acc + rows[r] * kD and p + rows[r] * p_st); V rows bf16, widened once per key.
template <int kD, int R>
inline void rows_values(float* acc, const float* p, int p_st, const int* rows,
                        const uint16_t* v0, int64_t v_st, int nk) {
  constexpr int V = kD / 16;
  __m512 a[R][V];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < V; ++x) a[r][x] = _mm512_loadu_ps(acc + rows[r] * kD + 16 * x);
  for (int j = 0; j < nk; ++j) {
    const uint16_t* vr = v0 + j * v_st;
    __m512 vf[V];
    for (int x = 0; x < V; ++x)
      vf[x] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + 16 * x))),
          16));
    for (int r = 0; r < R; ++r) {
      const __m512 pj = _mm512_set1_ps(p[rows[r] * p_st + j]);
      for (int x = 0; x < V; ++x) a[r][x] = _mm512_fmadd_ps(pj, vf[x], a[r][x]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < V; ++x) _mm512_storeu_ps(acc + rows[r] * kD + 16 * x, a[r][x]);
}

template <int kD, int R = value_rows<kD>()>
inline void values(float* acc, const float* p, int p_st, const int* rows, int n,
                   const uint16_t* v0, int64_t v_st, int nk) {
  if constexpr (R > 1) {
    if (n < R) return values<kD, R - 1>(acc, p, p_st, rows, n, v0, v_st, nk);
  }
  int i = 0;
  for (; i + R <= n; i += R) rows_values<kD, R>(acc, p, p_st, rows + i, v0, v_st, nk);
  if (i < n) values<kD>(acc, p, p_st, rows + i, n - i, v0, v_st, nk);
}

template <int kD>
bool run_item(const Args& a, const Item& it, std::vector<float>& scratch) {
  constexpr int V = kD / 32;
  const int d = kD, g = static_cast<int>(a.hq / a.hkv);
  const int bs = static_cast<int>(a.block_size);
  const int qs = a.qsl[it.req];
  const int nq = it.q1 - it.q0, rows = nq * g, nh = it.heads;
  const size_t per_head = static_cast<size_t>(rows) * (d + bs + 3);
  scratch.resize(per_head * nh);
  // Per head of the item: acc [rows, d], s [rows, bs], m [rows], l [rows], live [rows].
  auto acc_of = [&](int h) { return scratch.data() + h * per_head; };
  for (int h = 0; h < nh; ++h) {
    float* acc = acc_of(h);
    std::fill(acc, acc + rows * d, 0.0f);
    std::fill(acc + rows * (d + bs), acc + rows * (d + bs + 1), -INFINITY);
    std::fill(acc + rows * (d + bs + 1), acc + rows * (d + bs + 2), 0.0f);
  }
  const uint16_t* q = static_cast<const uint16_t*>(a.q);
  const ItemKeys keys(a, it);
  const int64_t row_st = a.hkv * d;  // elements between two keys' rows of one head
  const uint16_t* kc = static_cast<const uint16_t*>(a.kv_cache);
  const uint16_t* vc = kc + a.num_blocks * a.block_size * row_st;
  const bool ok = for_each_block(a, it, keys, kc, vc, [&](int64_t b, int64_t base, int nk) {
    for (int h = 0; h < nh; ++h) {  // the heads of one block: adjacent in each key's row
      const int head = it.head + h;
      float* acc = acc_of(h);
      float* s = acc + rows * d;
      float* m = s + rows * bs;
      float* l = m + rows;
      int* live = reinterpret_cast<int*>(l + rows);
      const uint16_t* k0 = kc + base * row_st + head * d;
      const uint16_t* v0 = vc + base * row_st + head * d;
      for (int r = 0; r < rows; ++r) {
        const uint16_t* qr = q + (qs + it.q0 + r / g) * a.q_st + (head * g + r % g) * d;
        __m512bh qv[V];
        for (int x = 0; x < V; ++x) qv[x] = (__m512bh)_mm512_loadu_si512(qr + 32 * x);
        row_scores<kD>(qv, k0, row_st, nk, a.scale, s + r * bs);
      }
      mask_block(s, rows, g, bs, nk, b * bs, keys.pos0, keys.pos1, keys.win);
      int n_live = 0;
      for (int r = 0; r < rows; ++r) {
        float* sr = s + r * bs;
        const float mb = row_max(sr, nk);
        if (mb == -INFINITY) continue;  // every key of this block is masked for this row
        float* ar = acc + r * d;
        const float m_new = std::max(m[r], mb);
        if (m_new > m[r]) {
          const float alpha = exp_neg(m[r] - m_new);
          const __m512 av = _mm512_set1_ps(alpha);
          for (int x = 0; x < d; x += 16)
            _mm512_storeu_ps(ar + x, _mm512_mul_ps(av, _mm512_loadu_ps(ar + x)));
          l[r] *= alpha;
          m[r] = m_new;
        }
        l[r] += exp_sum(sr, nk, bs, m_new);
        live[n_live++] = r;
      }
      values<kD>(acc, s, bs, live, n_live, v0, row_st, nk);
    }
  });
  if (!ok) return false;
  uint16_t* out = static_cast<uint16_t*>(a.out);
  for (int h = 0; h < nh; ++h) {
    const float* acc = acc_of(h);
    const float* l = acc + rows * (d + bs + 1);
    for (int r = 0; r < rows; ++r) {
      uint16_t* dst = out + (qs + it.q0 + r / g) * a.out_st + ((it.head + h) * g + r % g) * d;
      store_row(acc + r * d, dst, d, l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
    }
  }
  return true;
}

}  // namespace direct
#endif

template <typename T>
void write_kv(const Args& a) {
  const int64_t row = a.hkv * a.d;
  T* kc = static_cast<T*>(a.kv_cache);
  T* vc = kc + a.num_blocks * a.block_size * row;
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    const int64_t slot = a.slot_mapping[t];
    if (slot < 0) continue;
    std::memcpy(kc + slot * row, k + t * a.k_st, row * sizeof(T));
    std::memcpy(vc + slot * row, v + t * a.v_st, row * sizeof(T));
  }
}

// Whether bf16 calls of head size d take the direct path (namespace direct).
inline bool direct_bf16(int64_t d) {
#ifdef PW_ATTN_BF16_DIRECT
  return d == 32 || d == 64 || d == 128 || d == 256;
#else
  (void)d;
  return false;
#endif
}

// The query tiles of a call (kQueryTile tokens each) and its longest query.
struct QueryTiles {
  int64_t tiles = 0;
  int32_t max_ql = 0;
  QueryTiles(const int32_t* qsl, int64_t num_reqs) {
    for (int64_t r = 0; r < num_reqs; ++r) {
      const int32_t ql = qsl[r + 1] - qsl[r];
      if (ql <= 0) continue;
      tiles += (ql + kQueryTile - 1) / kQueryTile;
      max_ql = std::max(max_ql, ql);
    }
  }
};

// KV heads per work item.  An item reads its heads' slices of each key row; all of a row's
// heads in one item read the block's rows whole (contiguous): on the direct path, where there
// are tiles enough to keep every thread busy and the tiles are decode or verify sized (a
// prefill tile's rows already fill the item, and its heads' state would not stay in L1).
inline int32_t item_heads(bool direct, const QueryTiles& q, int64_t hkv) {
#ifdef _OPENMP
  const int64_t threads = omp_get_max_threads();
#else
  const int64_t threads = 1;
#endif
  const bool group =
      direct && q.max_ql <= kGroupMaxQuery && q.tiles >= kGroupTilesPerThread * threads;
  return group ? static_cast<int32_t>(hkv) : 1;
}

template <typename T>
int run(const Args& a) {
  if (a.d > kMaxHeadDim || a.hkv <= 0 || a.hq % a.hkv != 0) return 2;
  write_kv<T>(a);
  bool (*item_fn)(const Args&, const Item&, std::vector<float>&) =
      a.d == 32 ? run_item<T, 32> : a.d == 64 ? run_item<T, 64> : a.d == 128 ? run_item<T, 128>
      : a.d == 256 ? run_item<T, 256> : run_item<T, 0>;
  const bool direct = std::is_same_v<T, uint16_t> && direct_bf16(a.d);
#ifdef PW_ATTN_BF16_DIRECT
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (a.d == 32) item_fn = direct::run_item<32>;
    else if (a.d == 64) item_fn = direct::run_item<64>;
    else if (a.d == 128) item_fn = direct::run_item<128>;
    else if (a.d == 256) item_fn = direct::run_item<256>;
  }
#endif
  int64_t work = 0;  // query-key pairs, to decide whether threads pay off
  for (int32_t r = 0; r < a.num_reqs; ++r) {
    const int32_t ql = a.qsl[r + 1] - a.qsl[r];
    if (ql <= 0) continue;
    if (a.seq_lens[r] < ql) return 3;
    work += static_cast<int64_t>(ql) * a.seq_lens[r];
  }
  const int32_t heads = item_heads(direct, QueryTiles(a.qsl, a.num_reqs), a.hkv);
  std::vector<Item> items;
  for (int32_t r = 0; r < a.num_reqs; ++r) {
    const int32_t qs = a.qsl[r], ql = a.qsl[r + 1] - qs;
    if (ql <= 0) continue;
    for (int32_t q0 = 0; q0 < ql; q0 += kQueryTile)
      for (int32_t h = 0; h < a.hkv; h += heads)
        items.push_back({r, q0, std::min(ql, q0 + kQueryTile), h, heads});
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  // Threads from ~16k query-key-dim products on (a b1 decode of 32+ tokens): in a decode step
  // the team is already awake (the linears just ran on it), and the KV rows come from DRAM,
  // where a second thread doubles the misses in flight (b1, ctx ~160, in the engine: 0.33 ms a
  // step against 0.46-0.60 ms serial).  Tiny calls stay on the calling thread.
  const bool parallel = work * a.hq * a.d >= (1 << 14) && n_items > 1;
  int bad_block = 0;
#pragma omp parallel if (parallel) reduction(| : bad_block)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i)
      if (!item_fn(a, items[i], scratch)) bad_block = 1;
  }
  if (bad_block) return 4;
  // Padding rows get zeros.
  T* out = static_cast<T*>(a.out);
  for (int64_t t = a.num_tokens; t < a.num_padded; ++t)
    std::memset(out + t * a.out_st, 0, a.hq * a.d * sizeof(T));
  return 0;
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16.  Returns 0 on success, 1 bad dtype, 2 bad head shape,
// 3 a request with more query tokens than context, 4 a block id outside the cache.
int piecewise_cpu_paged_attention(
    const void* q, int64_t q_st, const void* k, int64_t k_st, const void* v, int64_t v_st,
    void* out, int64_t out_st, void* kv_cache, int64_t num_blocks, int64_t block_size,
    const int64_t* slot_mapping, const int32_t* block_table, int64_t bt_st,
    const int32_t* qsl, const int32_t* seq_lens, int64_t num_reqs, int64_t num_tokens,
    int64_t num_padded, int64_t hq, int64_t hkv, int64_t d, float scale, int64_t window,
    int64_t dtype) {
  Args a{q, q_st, k, k_st, v, v_st, out, out_st, kv_cache, num_blocks, block_size,
         slot_mapping, block_table, bt_st, qsl, seq_lens, num_reqs, num_tokens, num_padded,
         hq, hkv, d, scale, window};
  if (dtype == 0) return run<float>(a);
  if (dtype == 1) return run<uint16_t>(a);
  return 1;
}

// The same call with every argument a 64-bit word (the scale: its float's bits in the low 32):
// what a replay of recorded native calls can make (backends/piecewise/csrc/replay.cpp passes
// integer and pointer words only; a float would travel in a vector register).
int piecewise_cpu_paged_attention_words(
    const void* q, int64_t q_st, const void* k, int64_t k_st, const void* v, int64_t v_st,
    void* out, int64_t out_st, void* kv_cache, int64_t num_blocks, int64_t block_size,
    const int64_t* slot_mapping, const int32_t* block_table, int64_t bt_st,
    const int32_t* qsl, const int32_t* seq_lens, int64_t num_reqs, int64_t num_tokens,
    int64_t num_padded, int64_t hq, int64_t hkv, int64_t d, int64_t scale_bits, int64_t window,
    int64_t dtype) {
  const uint32_t bits = static_cast<uint32_t>(scale_bits);
  float scale;
  std::memcpy(&scale, &bits, 4);
  return piecewise_cpu_paged_attention(q, q_st, k, k_st, v, v_st, out, out_st, kv_cache,
                                       num_blocks, block_size, slot_mapping, block_table, bt_st,
                                       qsl, seq_lens, num_reqs, num_tokens, num_padded, hq, hkv,
                                       d, scale, window, dtype);
}

// KV heads per work item of a call with these query lengths (qsl[0 .. num_reqs]), head size d
// and dtype (0 float32, 1 bfloat16), at the calling thread's OpenMP thread count (for tests).
int64_t piecewise_cpu_paged_item_heads(const int32_t* qsl, int64_t num_reqs, int64_t hkv,
                                       int64_t d, int64_t dtype) {
  return item_heads(dtype == 1 && direct_bf16(d), QueryTiles(qsl, num_reqs), hkv);
}

// The softmax's exp on n inputs (for tests): vec[i] by the kernel's block path (16 lanes at a
// time where the build has AVX-512, 8 with AVX2 + FMA, else the scalar function), scalar[i]
// by exp_neg.
void piecewise_cpu_paged_exp_neg(const float* x, float* vec, float* scalar, int64_t n) {
  for (int64_t i = 0; i < n; ++i) scalar[i] = exp_neg(x[i]);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t c = std::min<int64_t>(16, n - i0);
#if defined(__AVX512F__)
    const __mmask16 live = first_lanes(static_cast<int>(c));
    _mm512_mask_storeu_ps(vec + i0, live, exp_neg16(_mm512_maskz_loadu_ps(live, x + i0)));
#elif defined(__AVX2__) && defined(__FMA__)
    for (int64_t h = 0; h < c; h += 8) {
      const __m256i live = first_lanes8(static_cast<int>(c - h));
      _mm256_maskstore_ps(vec + i0 + h, live, exp_neg8(_mm256_maskload_ps(x + i0 + h, live)));
    }
#else
    for (int64_t i = i0; i < i0 + c; ++i) vec[i] = exp_neg(x[i]);
#endif
  }
}

// Which instruction set the compiler vectorised for (for logs and benchmarks).
const char* piecewise_cpu_paged_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#elif defined(__ARM_NEON)
  return "neon";
#else
  return "portable";
#endif
}

}  // extern "C"
