// Small AVX-512 helpers shared by the native kernels.
#pragma once

#include <immintrin.h>

namespace flowlang_avx512 {

// 2^x for x <= 0; below -126 (and -inf) gives 0. Degree-6 polynomial on the fraction:
// relative error ~1e-7.
inline __m512 exp2_neg(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-126.f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.540353e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.333356e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550411e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

// out[i] = the sum of v[slot(i)]'s 16 lanes, where slot(i) = 4 * (i % 4) + i / 4: a
// transpose-and-add tree (45 shuffles and adds for 16 sums instead of 16 reductions).
inline int sum_slot(int i) { return 4 * (i % 4) + i / 4; }

inline __m512 sum_lanes16(const __m512* v) {
  __m512 w[8], u[4], s[2];
  for (int k = 0; k < 8; ++k)  // halves: lanes 0-7 from v[2k], 8-15 from v[2k+1]
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int m = 0; m < 4; ++m)  // quarters: 128-bit lane l holds v[4m + l]'s four partials
    u[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0xDD));
  for (int t = 0; t < 2; ++t)
    s[t] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * t], u[2 * t + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * t], u[2 * t + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], 0x88), _mm512_shuffle_ps(s[0], s[1], 0xDD));
}

#if defined(__AVX512BF16__)
#include <c10/util/BFloat16.h>

// bf16 <-> fp32, 16 lanes (masked for a row's tail); rounding is to nearest even, as c10's.
inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 m = 0xFFFF) {
  const __m256i bits = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline void store_bf16(c10::BFloat16* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

inline __m512 round_bf16(__m512 v) {  // to bf16 and back, as a cast to the model dtype does
  const __m256i bits = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}
#endif

// x * sigmoid(x), from 2^(-|x| log2 e) so that the exponential never overflows.
inline __m512 silu(__m512 x) {
  const __m512 e = exp2_neg(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-1.4426950408889634f)));
  const __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 num = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), negative, e);
  return _mm512_mul_ps(x, _mm512_div_ps(num, denom));
}

}  // namespace flowlang_avx512
