// Paged attention on CPU for decodes and short extends: K/V read in place from the
// slot-indexed pool (no gather copy). Parallel over sequences; fp32 accumulation. Also
// returns each (row, head)'s log-sum-exp of scaled scores, so that a caller can merge this
// result with attention over other keys (a shared prefix attended once for many sequences).
#include "ops.h"

#if defined(__AVX512F__)
#include "avx512_math.h"
#endif

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

template <typename scalar_t>
inline float to_float(scalar_t x) { return static_cast<float>(x); }

// New rows of one sequence the vectorized decode takes (a draft + 1).
constexpr int64_t kMaxDecodeRows = 16;

// Batch-invariant engines attend keys in chunks of kKvChunk positions (the callers' kv_chunk),
// aligned to the sequence's first key, and merge each chunk's result into the running one in
// order. A row's result then depends on its own keys alone: a shared prefix of whole chunks
// attended once for many sequences (prefix_attention) and continued per sequence
// (paged_decode_merge) computes every operation that the sequence attended alone computes, so
// batching never changes a token, in any dtype (the vectorized decodes; windows and
// soft-capping take the general kernel, unchunked). kv_chunk 0: all keys as one chunk.
constexpr int64_t kKvChunk = 64;

// Slots are scattered after eviction churn: fetch rows a few steps ahead of use.
constexpr int64_t kPrefetch = 6;

template <typename scalar_t>
inline void prefetch_row(const scalar_t* ptr, int64_t n) {
  const char* p = reinterpret_cast<const char*>(ptr);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(scalar_t)); off += 64)
    __builtin_prefetch(p + off, 0, 1);
}

#if defined(__AVX512F__)
// A decode (one query row) vectorized across keys, 16 at a time: each head's 16 dot products
// are summed by one transpose-and-add tree, softmax runs on whole vectors, and P·V
// accumulates in registers; out gets the heads' fp32 results, for the caller to round or merge.
// Sequences with several new rows, windows or soft-capping take the general kernel below.
constexpr int64_t kMaxGroup = 16;  // query heads per KV head this path handles

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 rows (of D values, one KV head) -> fp32 in buf, or in place when already fp32.
template <typename scalar_t>
inline void rows_f32(const scalar_t* base, const int64_t* seq, int64_t count,
                             int64_t row, int64_t D, float* buf, const float** ptrs) {
  for (int64_t jj = 0; jj < count; ++jj) {
    const scalar_t* src = base + seq[jj] * row;
    if constexpr (std::is_same_v<scalar_t, float>) {
      ptrs[jj] = src;
    } else {
      for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(buf + jj * D + c, load16(src + c));
      ptrs[jj] = buf + jj * D;
    }
  }
}

// Keys j0.. (up to 16) of one KV head as fp32 rows in `ptrs`, the next 16 prefetched.
template <typename scalar_t>
inline int64_t key_block(const scalar_t* pool, const int64_t* seq, int64_t j0, int64_t L,
                         int64_t hk, int64_t row, int64_t D, float* buf, const float** ptrs) {
  const int64_t count = std::min<int64_t>(16, L - j0);
  for (int64_t jj = 0; jj < count && j0 + 16 + jj < L; ++jj)
    prefetch_row(pool + seq[j0 + 16 + jj] * row + hk * D, D);
  rows_f32(pool + hk * D, seq + j0, count, row, D, buf, ptrs);
  return count;
}

template <typename scalar_t>
void decode_one(const scalar_t* q, const scalar_t* k_pool, const scalar_t* v_pool,
                const int64_t* seq, int64_t L, int64_t n, int64_t first_keys, float* out,
                float* lse, int64_t H, int64_t KVH, int64_t D, float scale,
                std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& qf,
                int64_t hk0, int64_t hk1) {
  using namespace flowlang_avx512;
  // n query rows; row r sees the first first_keys + r of the L keys (a verified draft: its
  // rows are the last positions, causal among them); the n x G query heads of a KV head share
  // each key load. Per row the operations are a single-row decode's over its own keys, in the
  // same order: masked keys add exact zeros.
  const int64_t G = H / KVH, row = KVH * D, L_pad = (L + 15) / 16 * 16, NG = n * G;
  constexpr float kLog2e = 1.4426950408889634f;
  scores.resize(n * H * L_pad);
  acc.assign(n * H * D, 0.f);
  qf.resize(NG * D);
  alignas(64) float buf[16 * 256];
  alignas(64) static const float zero_row[256] = {};
  const float* ptrs[16];
  for (int64_t hk = hk0; hk < hk1; ++hk) {
    for (int64_t vg = 0; vg < NG; ++vg)  // scores kept in base 2: exp2 below
      for (int64_t i = 0; i < D; ++i)
        qf[vg * D + i] =
            static_cast<float>(q[((vg / G) * H + hk * G + vg % G) * D + i]) * scale * kLog2e;
    // scores[r][h][j] = q_rh · k_j: 16 keys' dot products side by side (independent chains,
    // each summed over the features in order); a block's missing keys read a zero row
    for (int64_t j0 = 0; j0 < L; j0 += 16) {
      const int64_t count = key_block(k_pool, seq, j0, L, hk, row, D, buf, ptrs);
      for (int64_t jj = count; jj < 16; ++jj) ptrs[jj] = zero_row;
      for (int64_t vg = 0; vg < NG; ++vg) {
        const int64_t r = vg / G, visible = std::min<int64_t>(count, first_keys + r - j0);
        __m512 dots[16];
        for (int64_t jj = 0; jj < 16; ++jj) dots[jj] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) {
          const __m512 qc = _mm512_loadu_ps(qf.data() + vg * D + c);
          for (int64_t jj = 0; jj < 16; ++jj)
            dots[jj] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(ptrs[jj] + c), dots[jj]);
        }
        __m512 partial[16];
        for (int64_t jj = 0; jj < 16; ++jj) partial[sum_slot(jj)] = dots[jj];
        const __mmask16 valid = visible >= 16 ? __mmask16(0xFFFF)
                                : visible <= 0 ? __mmask16(0)
                                               : __mmask16((1u << visible) - 1);
        _mm512_storeu_ps(&scores[(r * H + hk * G + vg % G) * L_pad + j0],
                         _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, sum_lanes16(partial)));
      }
    }
  }
  // softmax per head, in place: scores become probabilities
  for (int64_t rh = 0; rh < n * H; ++rh) {
    const int64_t h = rh % H;
    if (h < hk0 * G || h >= hk1 * G) continue;
    float* s = &scores[rh * L_pad];
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < L_pad; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
    const float m = _mm512_reduce_max_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < L_pad; j += 16) {
      const __m512 e = exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(m)));
      total = _mm512_add_ps(total, e);
      _mm512_storeu_ps(s + j, e);
    }
    const float sum = _mm512_reduce_add_ps(total);
    lse[rh] = (m + std::log2(sum)) / kLog2e;
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    for (int64_t j = 0; j < L_pad; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
  }
  // acc[h] = Σ_j p[h][j] v_j, 16 keys at a time
  for (int64_t hk = hk0; hk < hk1; ++hk) {
    for (int64_t j0 = 0; j0 < L; j0 += 16) {
      const int64_t count = key_block(v_pool, seq, j0, L, hk, row, D, buf, ptrs);
      int64_t vg = 0;
      if (D % 64 == 0) {  // two heads x 64 features: 8 independent chains, keys in order
        for (; vg + 2 <= NG; vg += 2) {
          const int64_t rh0 = (vg / G) * H + hk * G + vg % G;
          const int64_t rh1 = ((vg + 1) / G) * H + hk * G + (vg + 1) % G;
          const float *p0 = &scores[rh0 * L_pad + j0], *p1 = &scores[rh1 * L_pad + j0];
          for (int64_t c = 0; c < D; c += 64) {
            float *a0 = &acc[rh0 * D + c], *a1 = &acc[rh1 * D + c];
            __m512 s0[4], s1[4];
            for (int i = 0; i < 4; ++i) {
              s0[i] = _mm512_loadu_ps(a0 + 16 * i);
              s1[i] = _mm512_loadu_ps(a1 + 16 * i);
            }
            for (int64_t jj = 0; jj < count; ++jj) {
              const __m512 w0 = _mm512_set1_ps(p0[jj]), w1 = _mm512_set1_ps(p1[jj]);
              for (int i = 0; i < 4; ++i) {
                const __m512 v = _mm512_loadu_ps(ptrs[jj] + c + 16 * i);
                s0[i] = _mm512_fmadd_ps(w0, v, s0[i]);
                s1[i] = _mm512_fmadd_ps(w1, v, s1[i]);
              }
            }
            for (int i = 0; i < 4; ++i) {
              _mm512_storeu_ps(a0 + 16 * i, s0[i]);
              _mm512_storeu_ps(a1 + 16 * i, s1[i]);
            }
          }
        }
      }
      for (; vg < NG; ++vg) {
        const int64_t rh = (vg / G) * H + hk * G + vg % G;
        const float* p = &scores[rh * L_pad + j0];
        float* a = &acc[rh * D];
        for (int64_t c = 0; c < D; c += 16) {
          __m512 sum = _mm512_loadu_ps(a + c);
          for (int64_t jj = 0; jj < count; ++jj)
            sum = _mm512_fmadd_ps(_mm512_set1_ps(p[jj]), _mm512_loadu_ps(ptrs[jj] + c), sum);
          _mm512_storeu_ps(a + c, sum);
        }
      }
    }
  }
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = hk0 * G * D; i < hk1 * G * D; ++i) out[r * H * D + i] = acc[r * H * D + i];
}
#endif

#if defined(__AVX512BF16__)
// Σ_j p[h][j] v_j for NV query heads of one KV head over L keys, from pairs of keys (each lane
// holds v_j[d], v_j+1[d], built with one permute per 16 features) against bf16 pairs of
// probabilities; fp32 out. Every (head, feature) chain takes the pairs in order, so a head's
// result does not depend on the other heads of its group.
template <int ND, int NV>
void pv_heads(const at::BFloat16* v, const int64_t* seq, int64_t L, int64_t row,
              const uint16_t* const* probs, float* const* out) {
  constexpr int64_t D = 16 * ND, NZ = ND / 2;
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                          40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33,
                                          1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  alignas(64) uint32_t pairs[8 * D];  // 8 key pairs: lane d holds (v_2t[d], v_2t+1[d])
  __m512 sums[NV][ND];
  for (int h = 0; h < NV; ++h)
    for (int c = 0; c < ND; ++c) sums[h][c] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, L - j0);
    for (int64_t jj = 0; jj < count && j0 + 16 + jj < L; ++jj)
      prefetch_row(v + seq[j0 + 16 + jj] * row, D);
    const int64_t num_pairs = (count + 1) / 2;
    for (int64_t t = 0; t < num_pairs; ++t) {
      const at::BFloat16* va = v + seq[j0 + 2 * t] * row;
      const bool odd = j0 + 2 * t + 1 >= L;  // no second key: its probability is 0
      const at::BFloat16* vb = odd ? va : v + seq[j0 + 2 * t + 1] * row;
      for (int c = 0; c < NZ; ++c) {
        const __m512i a = _mm512_loadu_si512(va + 32 * c), b = _mm512_loadu_si512(vb + 32 * c);
        _mm512_storeu_si512(pairs + t * D + 32 * c, _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_storeu_si512(pairs + t * D + 32 * c + 16, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
    }
    // key pairs outer, heads inner: the heads' chains interleave
    for (int64_t t = 0; t < num_pairs; ++t) {
      __m512i vz[ND];
      for (int c = 0; c < ND; ++c) vz[c] = _mm512_loadu_si512(pairs + t * D + 16 * c);
      for (int h = 0; h < NV; ++h) {
        const uint32_t* pp = reinterpret_cast<const uint32_t*>(probs[h] + j0);
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[t]));
        for (int c = 0; c < ND; ++c) sums[h][c] = _mm512_dpbf16_ps(sums[h][c], p, (__m512bh)vz[c]);
      }
    }
  }
  for (int h = 0; h < NV; ++h)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(out[h] + 16 * c, sums[h][c]);
}

// P·V of nv (<= NV) query heads of one KV head (v: its first row's features) over L keys, the
// heads' accumulators in registers (NV is a compile-time bound: every loop unrolls).
template <int ND, int NV>
void pv_group(int64_t nv, const at::BFloat16* v, const int64_t* seq, int64_t L, int64_t row,
              const uint16_t* const* probs, float* const* out) {
  switch (nv) {  // the count as a constant, so that no accumulator is indexed at run time
    case NV: return pv_heads<ND, NV>(v, seq, L, row, probs, out);
    default:
      if constexpr (NV > 1) return pv_group<ND, NV - 1>(nv, v, seq, L, row, probs, out);
  }
}

// The same decode for bf16 on vdpbf16ps (fp32 outputs, as above): q·k straight from the
// pool's bf16 rows (pairs of features per lane), and P·V from pairs of keys (each lane holds
// v_j[d], v_j+1[d], built with one permute per 16 features) against bf16 pairs of
// probabilities, as the flash kernel rounds them. ND = D / 16 accumulators per head.
template <int ND>
void decode_one_bf16(const at::BFloat16* q, const at::BFloat16* k_pool,
                     const at::BFloat16* v_pool, const int64_t* seq, int64_t L, int64_t n,
                     int64_t first_keys, float* out, float* lse, int64_t H, int64_t KVH, float scale,
                     std::vector<float>& scores, std::vector<float>& acc, int64_t hk0, int64_t hk1) {
  using namespace flowlang_avx512;
  constexpr int64_t D = 16 * ND, NZ = ND / 2;  // NZ zmm of 32 bf16 per row
  constexpr float kLog2e = 1.4426950408889634f;
  // n rows as in decode_one: the n x G query heads of a KV head go in chunks of at most
  // kMaxGroup (registers), each chunk reading the KV head's rows once
  const int64_t G = H / KVH, row = KVH * D, L_pad = (L + 15) / 16 * 16, NG = n * G;
  scores.resize(n * H * L_pad);
  acc.resize(n * H * L_pad / 2);  // the probabilities as bf16 pairs
  const __m512 factor = _mm512_set1_ps(scale * kLog2e);  // scores in base 2: exp2 below
  const uint16_t* qbits = reinterpret_cast<const uint16_t*>(q);
  auto head_of = [&](int64_t hk, int64_t vg) { return (vg / G) * H + hk * G + vg % G; };
  for (int64_t hk = hk0; hk < hk1; ++hk) {
    for (int64_t vg0 = 0; vg0 < NG; vg0 += kMaxGroup) {
      const int64_t vg1 = std::min<int64_t>(NG, vg0 + kMaxGroup);
      for (int64_t j0 = 0; j0 < L; j0 += 16) {
        const int64_t count = std::min<int64_t>(16, L - j0);
        for (int64_t jj = 0; jj < count && j0 + 16 + jj < L; ++jj)
          prefetch_row(k_pool + seq[j0 + 16 + jj] * row + hk * D, D);
        __m512 partial[kMaxGroup][16];
        for (int64_t jj = 0; jj < 16; ++jj) {
          if (jj >= count) {
            for (int64_t vg = vg0; vg < vg1; ++vg) partial[vg - vg0][sum_slot(jj)] = _mm512_setzero_ps();
            continue;
          }
          const at::BFloat16* kr = k_pool + seq[j0 + jj] * row + hk * D;
          __m512i kz[NZ];
          for (int c = 0; c < NZ; ++c) kz[c] = _mm512_loadu_si512(kr + 32 * c);
          for (int64_t vg = vg0; vg < vg1; ++vg) {
            const uint16_t* qh = qbits + head_of(hk, vg) * D;
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < NZ; ++c)
              sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(qh + 32 * c), (__m512bh)kz[c]);
            partial[vg - vg0][sum_slot(jj)] = sum;
          }
        }
        for (int64_t vg = vg0; vg < vg1; ++vg) {
          const int64_t visible = std::min<int64_t>(count, first_keys + vg / G - j0);
          const __mmask16 valid = visible >= 16 ? __mmask16(0xFFFF)
                                  : visible <= 0 ? __mmask16(0)
                                                 : __mmask16((1u << visible) - 1);
          _mm512_storeu_ps(&scores[head_of(hk, vg) * L_pad + j0],
                           _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid,
                                              sum_lanes16(partial[vg - vg0]), factor));
        }
      }
    }
  }
  // softmax per head; probabilities normalized, then rounded to bf16 pairs
  uint16_t* probs = reinterpret_cast<uint16_t*>(acc.data());
  for (int64_t rh = 0; rh < n * H; ++rh) {
    const int64_t h = rh % H;
    if (h < hk0 * G || h >= hk1 * G) continue;
    float* s = &scores[rh * L_pad];
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < L_pad; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < L_pad; j += 16) {
      const __m512 e = exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
      total = _mm512_add_ps(total, e);
      _mm512_storeu_ps(s + j, e);
    }
    const float sum = _mm512_reduce_add_ps(total);
    lse[rh] = (_mm512_reduce_max_ps(top) + std::log2(sum)) / kLog2e;
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    for (int64_t j = 0; j < L_pad; j += 16) {
      const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(s + j), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + rh * L_pad + j),
                          (__m256i)_mm512_cvtneps_pbh(p));
    }
  }
  // out[h] = Σ_j p[h][j] v_j over pairs of keys, in groups of query heads whose accumulators
  // fit the registers (a draft's rows make up to 16 x G heads), evenly sized
  constexpr int64_t kPv = 24 / ND;
  const int64_t pv_groups = (NG + kPv - 1) / kPv, pv_size = (NG + pv_groups - 1) / pv_groups;
  for (int64_t hk = hk0; hk < hk1; ++hk) {
    for (int64_t vg0 = 0; vg0 < NG; vg0 += pv_size) {
      const int64_t nv = std::min<int64_t>(NG, vg0 + pv_size) - vg0;
      const uint16_t* rows_p[kPv];
      float* rows_out[kPv];
      for (int64_t i = 0; i < nv; ++i) {
        rows_p[i] = probs + head_of(hk, vg0 + i) * L_pad;
        rows_out[i] = out + head_of(hk, vg0 + i) * D;
      }
      pv_group<ND, kPv>(nv, v_pool + hk * D, seq, L, row, rows_p, rows_out);
    }
  }
}

#endif

#if defined(__AVX512F__)
// Whether `decode_heads` takes a decode of this shape (a few rows: a verified draft).
inline bool vector_decode(int64_t D, int64_t G) { return D % 16 == 0 && D <= 256 && G <= kMaxGroup; }

// A decode of n rows (causal among them) of KV heads [hk0, hk1) over L keys at `seq`: fp32
// out (n, H, D) and lse (n, H), written for those heads only.
template <typename scalar_t>
void decode_heads(const scalar_t* q, const scalar_t* k_pool, const scalar_t* v_pool,
                  const int64_t* seq, int64_t L, int64_t n, int64_t first_keys, float* out,
                  float* lse, int64_t H, int64_t KVH, int64_t D, float scale,
                  std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& qf,
                  int64_t hk0, int64_t hk1) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (D == 64)
      return decode_one_bf16<4>(q, k_pool, v_pool, seq, L, n, first_keys, out, lse, H, KVH, scale, scores, acc, hk0, hk1);
    if (D == 128)
      return decode_one_bf16<8>(q, k_pool, v_pool, seq, L, n, first_keys, out, lse, H, KVH, scale, scores, acc, hk0, hk1);
  }
#endif
  decode_one(q, k_pool, v_pool, seq, L, n, first_keys, out, lse, H, KVH, D, scale, scores, acc,
             qf, hk0, hk1);
}

// (o, lse) over earlier keys merged with (oc, lsec) over the next chunk, in fp32 (lse natural).
// Explicit intrinsics: the compiler may not contract these differently at different call sites.
inline void merge_into(float* o, float* lse, const float* oc, float lsec, int64_t D) {
  const float top = std::max(*lse, lsec);
  const float wa = std::exp(*lse - top), wb = std::exp(lsec - top);
  const float total = wa + wb;
  const float inv = 1.f / total;
  const __m512 va = _mm512_set1_ps(wa * inv), vb = _mm512_set1_ps(wb * inv);
  for (int64_t d = 0; d < D; d += 16)
    _mm512_storeu_ps(o + d, _mm512_fmadd_ps(_mm512_loadu_ps(o + d), va,
                                            _mm512_mul_ps(_mm512_loadu_ps(oc + d), vb)));
  *lse = top + std::log(total);
}

// decode_heads chunk by chunk: n rows over L keys (causal: the rows are the last positions, as
// in decode_one; else every row sees every key), fp32 out (n, H, D) and lse (n, H) for KV heads
// [hk0, hk1), `chunk` keys at a time (0: all at once). `resume`: out/lse already hold the rows'
// attention over earlier keys (a shared prefix), which these keys continue.
template <typename scalar_t>
void decode_chunked(const scalar_t* q, const scalar_t* k_pool, const scalar_t* v_pool,
                    const int64_t* seq, int64_t L, int64_t n, bool causal, bool resume,
                    float* out, float* lse, int64_t H, int64_t KVH, int64_t D, float scale,
                    std::vector<float>& scores, std::vector<float>& acc,
                    std::vector<float>& qf, std::vector<float>& chunk_out,
                    std::vector<float>& chunk_lse, int64_t hk0, int64_t hk1, int64_t chunk) {
  const int64_t G = H / KVH, h0 = hk0 * G, h1 = hk1 * G;
  const int64_t step = chunk > 0 ? chunk : std::max<int64_t>(L, 1);
  chunk_out.resize(n * H * D);
  chunk_lse.resize(n * H);
  for (int64_t c0 = 0; c0 < L; c0 += step) {
    const int64_t count = std::min<int64_t>(step, L - c0);
    // causal: rows before r0 end before this chunk (a draft's first rows, in its last chunk)
    const int64_t r0 = causal ? std::max<int64_t>(0, c0 - (L - n)) : 0;
    const int64_t first_keys = causal ? L - n + r0 + 1 - c0 : count;
    const bool first = c0 == 0 && !resume;
    float* dst = first ? out : chunk_out.data();
    float* dst_lse = first ? lse : chunk_lse.data();
    decode_heads(q + r0 * H * D, k_pool, v_pool, seq + c0, count, n - r0, first_keys,
                 dst + r0 * H * D, dst_lse + r0 * H, H, KVH, D, scale, scores, acc, qf, hk0, hk1);
    if (first) continue;
    for (int64_t r = r0; r < n; ++r)
      for (int64_t h = h0; h < h1; ++h)
        merge_into(out + (r * H + h) * D, lse + r * H + h, chunk_out.data() + (r * H + h) * D,
                   chunk_lse[r * H + h], D);
  }
}
#endif

// n fp32 results rounded to the model dtype (bf16 16 lanes at a time, to nearest even).
template <typename scalar_t>
inline void store_rounded(scalar_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>)
    for (; i + 16 <= n; i += 16) flowlang_avx512::store_bf16(dst + i, _mm512_loadu_ps(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
}

template <typename scalar_t>
void attention_kernel(
    const scalar_t* q,          // (T, H, D): the new tokens' queries, sequence after sequence
    const scalar_t* k_pool,     // (S, KVH, D)
    const scalar_t* v_pool,     // (S, KVH, D)
    const int64_t* slots,       // concatenated slot lists (cached prefix + new tokens)
    const int64_t* kv_indptr,   // (B + 1,) offsets into slots
    const int64_t* qo_indptr,   // (B + 1,) offsets into q rows
    scalar_t* out,              // (T, H, D)
    float* lse,                 // (T, H): log-sum-exp of the scaled scores
    int64_t B, int64_t H, int64_t KVH, int64_t D, float scale, int64_t window, float softcap,
    int64_t kv_chunk) {
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;  // one slot's K (or V) for all kv heads: contiguous
  // One task per sequence: each K/V row is read once, whole, for every head and query row.
  // With fewer sequences than a few per thread, a single-row decode is split by KV head too
  // (its heads are independent), so that one sequence still keeps every core busy.
  // Query row r of a sequence with L keys and n queries sits at position L - n + r and
  // attends to keys [max(0, pos - window + 1), pos].
  // A few sequences' drafts are split by rows too (each row is a decode of its own keys), so
  // that the tasks spread evenly over the threads (3 KV heads on 2 threads: 2 to 1). Each
  // group reads its KV head again: worth it from 2 rows in 16-bit dtypes, from 8 in fp32
  // (measured at 500-2,000 keys: twice the bytes, a head's rows no longer stay in cache).
  const int64_t threads = at::get_num_threads();
  const int64_t parts = B < 4 * threads ? KVH : 1;
  const int64_t split_from = sizeof(scalar_t) == 2 ? 2 : 8;
  int64_t max_rows = 1;
  for (int64_t b = 0; b < B; ++b) max_rows = std::max(max_rows, qo_indptr[b + 1] - qo_indptr[b]);
  int64_t row_groups = 1;
  if (parts > 1 && max_rows >= split_from)
    while (row_groups < max_rows && (B * parts * row_groups) % threads != 0 &&
           B * parts * row_groups < 4 * threads)
      ++row_groups;
  const int64_t tasks_per_seq = parts * row_groups;
  at::parallel_for(0, B * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores, rowf(row), head_out, chunk_out, chunk_lse;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_seq, part = task % tasks_per_seq % parts;
      const int64_t group = task % tasks_per_seq / parts;
      const int64_t hk0 = parts == 1 ? 0 : part, hk1 = parts == 1 ? KVH : part + 1;
      const int64_t n = qo_indptr[b + 1] - qo_indptr[b];
      const int64_t L = kv_indptr[b + 1] - kv_indptr[b];
      const int64_t* seq = slots + kv_indptr[b];
#if defined(__AVX512F__)
      if constexpr (!std::is_same_v<scalar_t, double>) {
        if (n <= kMaxDecodeRows && window == 0 && softcap == 0.f && vector_decode(D, G)) {
          // rows [r0, r1): the last of them sees the first L - (n - r1) keys
          const int64_t r0 = n * group / row_groups, r1 = n * (group + 1) / row_groups;
          if (r0 == r1) continue;
          const int64_t i0 = qo_indptr[b] + r0;
          head_out.resize((r1 - r0) * H * D);
          decode_chunked(q + i0 * H * D, k_pool, v_pool, seq, L - (n - r1), r1 - r0, true,
                         false, head_out.data(), lse + i0 * H, H, KVH, D, scale, scores, acc, qf,
                         chunk_out, chunk_lse, hk0, hk1, kv_chunk);
          for (int64_t r = 0; r < r1 - r0; ++r)
            store_rounded(out + ((i0 + r) * H + hk0 * G) * D,
                          head_out.data() + (r * H + hk0 * G) * D, (hk1 - hk0) * G * D);
          continue;
        }
      }
#endif
      if (part != 0 || group != 0) continue;  // the general path: once per sequence, all heads
      const int64_t lo = window > 0 ? std::max<int64_t>(0, L - n - window + 1) : 0;
      const int64_t span = L - lo;  // keys any row of this sequence may see
      qf.resize(n * H * D);
      acc.assign(n * H * D, 0.f);
      scores.assign(n * H * span, -INFINITY);
      for (int64_t i = 0; i < n * H * D; ++i)
        qf[i] = to_float(q[qo_indptr[b] * H * D + i]) * scale;
      // pass 1: scores (n, H, span)
      for (int64_t j = lo; j < L; ++j) {
        if (j + kPrefetch < L) prefetch_row(k_pool + seq[j + kPrefetch] * row, row);
        const scalar_t* kr = k_pool + seq[j] * row;
        for (int64_t i = 0; i < row; ++i) rowf[i] = to_float(kr[i]);
        for (int64_t r = 0; r < n; ++r) {
          const int64_t pos = L - n + r;
          if (j > pos || (window > 0 && j <= pos - window)) continue;
          for (int64_t h = 0; h < H; ++h) {
            const float* qh = qf.data() + (r * H + h) * D;
            const float* kh = rowf.data() + (h / G) * D;
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
            if (softcap > 0.f) s = softcap * std::tanh(s / softcap);  // Gemma 2's logit cap
            scores[(r * H + h) * span + (j - lo)] = s;
          }
        }
      }
      // softmax per (row, head); masked keys stay at -inf and become 0
      for (int64_t rh = 0; rh < n * H; ++rh) {
        float* sh = scores.data() + rh * span;
        float m = -INFINITY;
        for (int64_t j = 0; j < span; ++j) m = std::max(m, sh[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < span; ++j) {
          sh[j] = sh[j] == -INFINITY ? 0.f : std::exp(sh[j] - m);
          sum += sh[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < span; ++j) sh[j] *= inv;
        lse[qo_indptr[b] * H + rh] = m + std::log(sum);
      }
      // pass 2: weighted sums of V rows
      for (int64_t j = lo; j < L; ++j) {
        if (j + kPrefetch < L) prefetch_row(v_pool + seq[j + kPrefetch] * row, row);
        const scalar_t* vr = v_pool + seq[j] * row;
        for (int64_t i = 0; i < row; ++i) rowf[i] = to_float(vr[i]);
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t h = 0; h < H; ++h) {
            const float p = scores[(r * H + h) * span + (j - lo)];
            if (p == 0.f) continue;
            const float* vh = rowf.data() + (h / G) * D;
            float* ah = acc.data() + (r * H + h) * D;
            for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
          }
        }
      }
      for (int64_t i = 0; i < n * H * D; ++i)
        out[qo_indptr[b] * H * D + i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

#if defined(__AVX512F__)
// Decodes that share a prefix attended elsewhere (a cascade), each of a few rows (a verified
// draft: causal among them): sequence b's queries are q's consecutive rows rows[qo_indptr[b]]..,
// its own keys slots[kv_indptr[b]:kv_indptr[b+1]], its rows the last of them. Each row's fp32
// attention over the prefix (prefix_out[i], prefix_lse[i], i its index in rows: prefix_attention's
// result over whole chunks) is continued over these keys and written, rounded, to out's row
// rows[i]: bit for bit what the row gets as a decode of its sequence alone.
template <typename scalar_t>
void decode_merge_kernel(const scalar_t* q, const scalar_t* k_pool, const scalar_t* v_pool,
                         const int64_t* slots, const int64_t* kv_indptr, const int64_t* qo_indptr,
                         const int64_t* rows, const float* prefix_out, const float* prefix_lse,
                         scalar_t* out, int64_t B, int64_t H, int64_t KVH, int64_t D, float scale,
                         int64_t kv_chunk) {
  const int64_t G = H / KVH;
  const int64_t parts = B < 4 * at::get_num_threads() ? KVH : 1;
  at::parallel_for(0, B * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc, scores, qf, head_out, head_lse, chunk_out, chunk_lse;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / parts, part = task % parts;
      const int64_t hk0 = parts == 1 ? 0 : part, hk1 = parts == 1 ? KVH : part + 1;
      const int64_t L = kv_indptr[b + 1] - kv_indptr[b];
      const int64_t i0 = qo_indptr[b], n = qo_indptr[b + 1] - i0;
      const int64_t h0 = hk0 * G, h1 = hk1 * G;
      head_out.resize(n * H * D);
      head_lse.resize(n * H);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t h = h0; h < h1; ++h) {
          std::copy_n(prefix_out + ((i0 + r) * H + h) * D, D, head_out.data() + (r * H + h) * D);
          head_lse[r * H + h] = prefix_lse[(i0 + r) * H + h];
        }
      decode_chunked(q + rows[i0] * H * D, k_pool, v_pool, slots + kv_indptr[b], L, n, true,
                     true, head_out.data(), head_lse.data(), H, KVH, D, scale, scores, acc, qf,
                     chunk_out, chunk_lse, hk0, hk1, kv_chunk);
      for (int64_t r = 0; r < n; ++r)
        store_rounded(out + (rows[i0 + r] * H + h0) * D, head_out.data() + (r * H + h0) * D,
                      (h1 - h0) * D);
    }
  });
}

// Rows of many sequences over one shared prefix (every row sees every key): q (R, H, D)
// gathered rows, fp32 out (R, H, D) and lse (R, H), chunk by chunk as decode_chunked attends
// them for one sequence. Tasks: blocks of rows by KV head, each block sharing its key loads.
template <typename scalar_t>
void prefix_kernel(const scalar_t* q, const scalar_t* k_pool, const scalar_t* v_pool,
                   const int64_t* slots, int64_t L, int64_t R, float* out, float* lse, int64_t H,
                   int64_t KVH, int64_t D, float scale) {
  constexpr int64_t kRowBlock = 16;
  const int64_t blocks = (R + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, blocks * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc, scores, qf, chunk_out, chunk_lse, block_out, block_lse;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t blk = task / KVH, hk = task % KVH;
      const int64_t r0 = blk * kRowBlock, n = std::min<int64_t>(kRowBlock, R - r0);
      decode_chunked(q + r0 * H * D, k_pool, v_pool, slots, L, n, false, false,
                     out + r0 * H * D, lse + r0 * H, H, KVH, D, scale, scores, acc, qf,
                     chunk_out, chunk_lse, hk, hk + 1, kKvChunk);
    }
  });
}
#endif

}  // namespace

void paged_decode_merge(const at::Tensor& q, const at::Tensor& k_pool,
                        const at::Tensor& v_pool, const at::Tensor& slots,
                        const at::Tensor& kv_indptr, const at::Tensor& qo_indptr,
                        const at::Tensor& rows, const at::Tensor& prefix_out,
                        const at::Tensor& prefix_lse, double scale, int64_t kv_chunk,
                        at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(),
              "q (T,H,D) and pools (S,KVH,D) expected");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  out.is_contiguous() && prefix_out.is_contiguous() && prefix_lse.is_contiguous() &&
                  kv_indptr.is_contiguous() && qo_indptr.is_contiguous() && rows.is_contiguous(),
              "contiguous tensors expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && kv_indptr.scalar_type() == at::kLong &&
                  qo_indptr.scalar_type() == at::kLong && rows.scalar_type() == at::kLong,
              "int64 slots, indptrs and rows expected");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k_pool.scalar_type() == dtype && out.scalar_type() == dtype &&
                  prefix_out.scalar_type() == at::kFloat && prefix_lse.scalar_type() == at::kFloat,
              "q, pools and out share a dtype; prefix_out and prefix_lse are fp32");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pool.size(1);
  const int64_t B = kv_indptr.numel() - 1, R = rows.numel();
  TORCH_CHECK(H % KVH == 0 && k_pool.size(2) == D, "head shapes disagree");
  TORCH_CHECK(B >= 0 && qo_indptr.numel() == B + 1, "qo_indptr and kv_indptr disagree");
  TORCH_CHECK(prefix_out.dim() == 3 && prefix_out.size(0) == R && prefix_out.size(1) == H &&
                  prefix_out.size(2) == D && prefix_lse.numel() == R * H,
              "prefix_out (rows, H, D) and prefix_lse (rows, H) expected");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(kv_chunk >= 0, "kv_chunk must be 0 (one chunk) or more, not ", kv_chunk);
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* qo = qo_indptr.data_ptr<int64_t>();
  const int64_t* kv = kv_indptr.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < T, "row ", r[i], " outside q's ", T, " rows");
  TORCH_CHECK(B == 0 || (qo[0] == 0 && qo[B] == R), "qo_indptr must run from 0 to the ", R, " rows");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qo[b + 1] - qo[b], L = kv[b + 1] - kv[b];
    TORCH_CHECK(n >= 1 && n <= kMaxDecodeRows, "sequence ", b, " has ", n,
                " rows; 1 to ", kMaxDecodeRows, " expected");
    TORCH_CHECK(L == 0 || L >= n, "sequence ", b, "'s ", n, " rows are the last of its keys, but it has ", L);
    for (int64_t i = qo[b] + 1; i < qo[b + 1]; ++i)
      TORCH_CHECK(r[i] == r[i - 1] + 1, "sequence ", b, "'s rows must be consecutive rows of q");
  }
#if defined(__AVX512F__)
  TORCH_CHECK(vector_decode(D, H / KVH), "head_dim ", D, " and ", H / KVH,
              " heads per KV head: no vectorized decode for this shape");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "paged_decode_merge", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "fp64 has no vectorized decode");
    } else {
      decode_merge_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(),
                                    v_pool.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), kv, qo,
                                    r, prefix_out.data_ptr<float>(), prefix_lse.data_ptr<float>(),
                                    out.data_ptr<scalar_t>(), B, H, KVH, D,
                                    static_cast<float>(scale), kv_chunk);
    }
  });
#else
  TORCH_CHECK(false, "paged_decode_merge needs AVX-512");
#endif
}


std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q, const at::Tensor& rows,
                                                    const at::Tensor& k_pool,
                                                    const at::Tensor& v_pool,
                                                    const at::Tensor& slots, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(),
              "q (T,H,D) and pools (S,KVH,D) expected");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && slots.is_contiguous(),
              "contiguous pools and slots expected");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong,
              "int64 rows and slots expected");
  TORCH_CHECK(k_pool.scalar_type() == q.scalar_type(), "q and the pools share a dtype");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_pool.size(1), L = slots.numel();
  TORCH_CHECK(H % KVH == 0 && k_pool.size(2) == D, "head shapes disagree");
  TORCH_CHECK(L % kKvChunk == 0, "a shared prefix of ", L, " keys; whole chunks of ", kKvChunk,
              " expected (a sequence attended alone splits its keys there)");
#if defined(__AVX512F__)
  TORCH_CHECK(vector_decode(D, H / KVH), "head_dim ", D, " and ", H / KVH,
              " heads per KV head: no vectorized decode for this shape");
  const at::Tensor qg = q.index_select(0, rows).contiguous();  // (R, H, D)
  const int64_t R = qg.size(0);
  auto out = at::empty({R, H, D}, q.options().dtype(at::kFloat));
  auto lse = at::empty({R, H}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefix_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "fp64 has no vectorized decode");
    } else {
      prefix_kernel<scalar_t>(qg.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(),
                              v_pool.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), L, R,
                              out.data_ptr<float>(), lse.data_ptr<float>(), H, KVH, D,
                              static_cast<float>(scale));
    }
  });
  return {out, lse};
#else
  TORCH_CHECK(false, "prefix_attention needs AVX-512");
#endif
}

std::tuple<at::Tensor, at::Tensor> paged_attention(const at::Tensor& q, const at::Tensor& k_pool,
                              const at::Tensor& v_pool, const at::Tensor& slots,
                              const at::Tensor& kv_indptr, const at::Tensor& qo_indptr,
                              double scale, int64_t window, double softcap, int64_t kv_chunk) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3, "q (T,H,D) and pools (S,KVH,D) expected");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "contiguous tensors expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && kv_indptr.scalar_type() == at::kLong &&
                  qo_indptr.scalar_type() == at::kLong,
              "int64 slots and indptrs expected");
  const int64_t B = kv_indptr.numel() - 1, H = q.size(1), D = q.size(2), KVH = k_pool.size(1);
  TORCH_CHECK(H % KVH == 0 && k_pool.size(2) == D, "head shapes disagree");
  TORCH_CHECK(qo_indptr.numel() == B + 1, "qo_indptr and kv_indptr disagree");
  TORCH_CHECK(kv_chunk >= 0, "kv_chunk must be 0 (one chunk) or more, not ", kv_chunk);
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), H}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention",
                                  [&] {
    attention_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(),
                               v_pool.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(),
                               kv_indptr.data_ptr<int64_t>(), qo_indptr.data_ptr<int64_t>(),
                               out.data_ptr<scalar_t>(), lse.data_ptr<float>(), B, H, KVH, D,
                               static_cast<float>(scale), window,
                               static_cast<float>(softcap), kv_chunk);
  });
  return {out, lse};
}

// A registered op (torch.ops.flowlang.paged_attention): visible to the profiler, no pybind.
TORCH_LIBRARY(flowlang, m) {
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, "
        "Tensor kv_indptr, Tensor qo_indptr, float scale, int window, float softcap, "
        "int kv_chunk) -> "
        "(Tensor, Tensor)");
  m.def("paged_decode_merge(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, "
        "Tensor kv_indptr, Tensor qo_indptr, Tensor rows, Tensor prefix_out, Tensor prefix_lse, "
        "float scale, int kv_chunk, Tensor(a!) out) -> ()");
  m.def("prefix_attention(Tensor q, Tensor rows, Tensor k_pool, Tensor v_pool, Tensor slots, "
        "float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flowlang, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_decode_merge", &paged_decode_merge);
  m.impl("prefix_attention", &prefix_attention);
}
