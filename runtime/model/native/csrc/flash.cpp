// Flash attention on AVX-512 for the CPU backend's long attention (a shared prefix attended
// once for a cascade's query rows, and long extends), in two flavours of one loop:
// - bf16: both products (Q·Kᵀ and P·V) on vdpbf16ps, pairs of bf16 multiplied into fp32 sums,
//   P rounded to bf16 as torch's kernel does. torch's CPU flash kernel widens bf16 to fp32 and
//   runs no faster than in fp32; this does twice the multiply-adds per instruction.
// - fp32: the same blocking on fp32 FMAs.
// The online softmax runs in fp32, in base 2.
//
// The heads that share a KV head are folded into the query rows ("rows" below: row f is query
// token f / G, head kv * G + f % G), so each K/V row is packed once per KV head and met by all
// of its heads. K is repacked into tiles of 16 keys per feature (bf16: per feature pair), V
// into pair-interleaved rows (bf16) or plain rows (fp32); that costs O(L·D) against the
// O(rows·L·D) products.
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "avx512_math.h"

namespace {

using flowlang_avx512::exp2_neg;

constexpr int64_t kTile = 16;        // keys per packed K tile: one zmm of scores per row
constexpr int64_t kStepKeys = 256;   // keys per online-softmax step (a multiple of 2 tiles)
constexpr int64_t kBlockRows = 48;   // rows per task: a multiple of both kernels' row counts
constexpr int64_t kQkRows = 8;       // rows per Q·Kᵀ micro-kernel call (x 2 tiles of keys)
constexpr int64_t kPvKeys = 64;      // keys per P·V pass over the rows (V chunk stays in L1)
constexpr float kLog2e = 1.4426950408889634f;

// Keys padded to whole pairs of K tiles.
inline int64_t padded_keys(int64_t L) { return (L + 31) / 32 * 32; }

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// The keys below `limit`, of the 16 starting at `first`.
inline __mmask16 keys_below(int64_t limit, int64_t first) {
  const int64_t n = limit - first;
  return n >= kTile ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// What one dtype packs: K tiles and V rows hold `Packed` units; a unit is a feature pair
// (bf16) or one feature (fp32) of K, a key pair or one key of V; P is stored as `Prob`.
template <typename T>
struct Flavour;

template <>
struct Flavour<at::BFloat16> {
  using Packed = uint32_t;
  using Prob = uint16_t;
  static constexpr int64_t kPerUnit = 2;
};

template <>
struct Flavour<float> {
  using Packed = float;
  using Prob = float;
  static constexpr int64_t kPerUnit = 1;
};

// The row of key j: slot[j] where the keys are gathered from a pool, else j.
inline int64_t key_row(const int64_t* slot, int64_t j) { return slot ? slot[j] : j; }

// K of one KV head -> tiles (L_pad / 16, D / per_unit, 16): tile t, unit u holds keys
// 16t..16t+15, each as its unit u. Keys past L are zero.
template <typename T>
void pack_k(const T* k, int64_t row_stride, const int64_t* slot, int64_t L, int64_t D,
            typename Flavour<T>::Packed* out, int64_t L_pad) {
  using Packed = typename Flavour<T>::Packed;
  const int64_t units = D / Flavour<T>::kPerUnit;
  std::memset(out, 0, sizeof(Packed) * L_pad * units);
  for (int64_t j = 0; j < L; ++j) {
    const Packed* src = reinterpret_cast<const Packed*>(k + key_row(slot, j) * row_stride);
    Packed* dst = out + (j / kTile) * units * kTile + j % kTile;
    for (int64_t u = 0; u < units; ++u) dst[u * kTile] = src[u];
  }
}

// V of one KV head. bf16: (L_pad / 2, D) of uint32, pair t, column d holding
// (v[2t][d], v[2t+1][d]). fp32: (L_pad, D), rows as they are. Keys past L are zero.
template <typename T>
void pack_v(const T* v, int64_t row_stride, const int64_t* slot, int64_t L, int64_t D,
            typename Flavour<T>::Packed* out, int64_t L_pad) {
  using Packed = typename Flavour<T>::Packed;
  std::memset(out, 0, sizeof(Packed) * (L_pad / Flavour<T>::kPerUnit) * D);
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < L; ++j)
      std::memcpy(out + j * D, v + key_row(slot, j) * row_stride, sizeof(float) * D);
  } else {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(v);
    for (int64_t j = 0; j < L; ++j) {
      const uint16_t* src = bits + key_row(slot, j) * row_stride;
      uint16_t* dst = reinterpret_cast<uint16_t*>(out + (j / 2) * D) + j % 2;
      for (int64_t d = 0; d < D; ++d) dst[2 * d] = src[d];
    }
  }
}

// Scores of 8 rows against the 32 keys of two K tiles from key `first`, scaled, -inf at and
// past each row's limit, into out (row stride out_stride). q as packed units.
template <typename T>
inline void qk_8x32(const typename Flavour<T>::Packed* q, int64_t units,
                    const typename Flavour<T>::Packed* tile, float scale, const int64_t* limit,
                    int64_t first, float* out, int64_t out_stride) {
  __m512 acc[kQkRows][2];  // local, so they live in registers
  for (int r = 0; r < kQkRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const auto* tile2 = tile + units * kTile;
  for (int64_t u = 0; u < units; ++u) {
    if constexpr (std::is_same_v<T, float>) {
      const __m512 b0 = _mm512_loadu_ps(tile + u * kTile), b1 = _mm512_loadu_ps(tile2 + u * kTile);
      for (int r = 0; r < kQkRows; ++r) {
        const __m512 a = _mm512_set1_ps(q[r * units + u]);
        acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      }
    } else {
      const __m512bh b0 = as_bh(_mm512_loadu_si512(tile + u * kTile));
      const __m512bh b1 = as_bh(_mm512_loadu_si512(tile2 + u * kTile));
      for (int r = 0; r < kQkRows; ++r) {
        const __m512bh a = as_bh(_mm512_set1_epi32(static_cast<int>(q[r * units + u])));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      }
    }
  }
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), factor = _mm512_set1_ps(scale);
  for (int r = 0; r < kQkRows; ++r)
    for (int h = 0; h < 2; ++h) {
      const __mmask16 keys = keys_below(limit[r], first + h * kTile);
      const __m512 x = _mm512_mask_mul_ps(neg_inf, keys, acc[r][h], factor);
      _mm512_storeu_ps(out + r * out_stride + h * kTile, x);
    }
}

// acc[r] += P[r] · V over `units` units of keys (bf16: key pairs) for MR rows; ND zmm per row
// (D = 16 ND).
template <typename T, int ND, int MR>
inline void pv_rows(const typename Flavour<T>::Packed* p, int64_t p_stride,
                    const typename Flavour<T>::Packed* v, int64_t units, float* acc,
                    int64_t acc_stride) {
  __m512 sum[MR][ND];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < ND; ++c) sum[r][c] = _mm512_loadu_ps(acc + r * acc_stride + 16 * c);
  for (int64_t t = 0; t < units; ++t) {
    if constexpr (std::is_same_v<T, float>) {
      __m512 b[ND];
      for (int c = 0; c < ND; ++c) b[c] = _mm512_loadu_ps(v + t * 16 * ND + 16 * c);
      for (int r = 0; r < MR; ++r) {
        const __m512 a = _mm512_set1_ps(p[r * p_stride + t]);
        for (int c = 0; c < ND; ++c) sum[r][c] = _mm512_fmadd_ps(a, b[c], sum[r][c]);
      }
    } else {
      __m512bh b[ND];
      for (int c = 0; c < ND; ++c) b[c] = as_bh(_mm512_loadu_si512(v + t * 16 * ND + 16 * c));
      for (int r = 0; r < MR; ++r) {
        const __m512bh a = as_bh(_mm512_set1_epi32(static_cast<int>(p[r * p_stride + t])));
        for (int c = 0; c < ND; ++c) sum[r][c] = _mm512_dpbf16_ps(sum[r][c], a, b[c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(acc + r * acc_stride + 16 * c, sum[r][c]);
}

template <typename T>
struct Problem {
  using Packed = typename Flavour<T>::Packed;
  const T* q;             // (T, H, D) contiguous
  const int64_t* q_rows;  // (n,): query i is q's token q_rows[i]; null: token i
  int64_t n, H, KVH, D, L;
  float scale_log2;       // scale · log2(e): scores kept in base 2
  bool causal;            // query token i sits at key position L - n + i
  const Packed* k_packed; // per KV head: (L_pad / 16, D / per_unit, 16)
  const Packed* v_packed; // per KV head: (L_pad / per_unit, D)
  int64_t L_pad;
  T* out;                 // (n, H, D)
  float* lse;             // (n, H), natural log
};

// One task: `rows` folded rows from `row0` of KV head `kv`, over all their keys.
template <typename T, int ND>
void attend_block(const Problem<T>& pb, int64_t kv, int64_t row0, int64_t rows) {
  using Packed = typename Flavour<T>::Packed;
  using Prob = typename Flavour<T>::Prob;
  constexpr int64_t per_unit = Flavour<T>::kPerUnit;
  constexpr int MR = 24 / ND;  // PV rows per call: MR x ND accumulators fit the 32 registers
  const int64_t D = pb.D, G = pb.H / pb.KVH, units = D / per_unit;
  const int64_t padded = (rows + 23) / 24 * 24;
  std::vector<Packed> qb(padded * units, Packed{});
  std::vector<int64_t> limit(padded, pb.L);  // each row's keys: [0, limit)
  for (int64_t f = 0; f < rows; ++f) {
    const int64_t token = (row0 + f) / G, head = kv * G + (row0 + f) % G;
    const int64_t q_token = pb.q_rows ? pb.q_rows[token] : token;
    std::memcpy(&qb[f * units], pb.q + (q_token * pb.H + head) * D, sizeof(T) * D);
    if (pb.causal) limit[f] = pb.L - pb.n + token + 1;
  }
  const int64_t key_end = *std::max_element(limit.begin(), limit.begin() + rows);
  std::vector<float> scores(padded * kStepKeys), acc(padded * D, 0.f);
  std::vector<float> m(padded, -INFINITY), l(padded, 0.f);
  std::vector<Prob> probs(padded * kStepKeys);
  const Packed* k_head = pb.k_packed + kv * pb.L_pad * units;
  const Packed* v_head = pb.v_packed + kv * (pb.L_pad / per_unit) * D;
  for (int64_t j0 = 0; j0 < key_end; j0 += kStepKeys) {
    const int64_t width = std::min(kStepKeys, (key_end - j0 + 31) / 32 * 32);
    // scores, scaled to base 2, -inf past each row's limit
    for (int64_t c = 0; c < width; c += 2 * kTile) {  // a K chunk stays in L1 for all rows
      for (int64_t r0 = 0; r0 < padded; r0 += kQkRows) {
        qk_8x32<T>(&qb[r0 * units], units, k_head + (j0 + c) / kTile * units * kTile,
                   pb.scale_log2, &limit[r0], j0 + c, &scores[r0 * kStepKeys + c], kStepKeys);
      }
    }
    // online softmax: P = 2^(s - m), running max and sum, earlier sums rescaled
    for (int64_t r = 0; r < padded; ++r) {
      float* s = &scores[r * kStepKeys];
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (int64_t c = 0; c < width; c += kTile) top = _mm512_max_ps(top, _mm512_loadu_ps(s + c));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(top));
      Prob* p = &probs[r * kStepKeys];
      if (m_new == -INFINITY) {  // no key yet for this row
        std::memset(p, 0, sizeof(Prob) * width);
        continue;
      }
      const float alpha = std::exp2(m[r] - m_new);
      if (alpha != 1.f) {
        l[r] *= alpha;
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= alpha;
      }
      m[r] = m_new;
      __m512 total = _mm512_setzero_ps();
      for (int64_t c = 0; c < width; c += kTile) {
        const __m512 e = exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(s + c), _mm512_set1_ps(m_new)));
        total = _mm512_add_ps(total, e);
        if constexpr (std::is_same_v<T, float>)
          _mm512_storeu_ps(p + c, e);
        else
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + c), (__m256i)_mm512_cvtneps_pbh(e));
      }
      l[r] += _mm512_reduce_add_ps(total);
    }
    // acc += P · V
    constexpr int64_t chunk_units = kPvKeys / per_unit;
    const int64_t step_units = width / per_unit;
    for (int64_t t0 = 0; t0 < step_units; t0 += chunk_units) {  // a V chunk stays in L1
      const Packed* v_chunk = v_head + (j0 / per_unit + t0) * D;
      const int64_t chunk = std::min(chunk_units, step_units - t0);
      for (int64_t r0 = 0; r0 < padded; r0 += MR)
        pv_rows<T, ND, MR>(reinterpret_cast<const Packed*>(&probs[r0 * kStepKeys]) + t0,
                           kStepKeys / per_unit, v_chunk, chunk, &acc[r0 * D], D);
    }
  }
  for (int64_t f = 0; f < rows; ++f) {
    const int64_t token = (row0 + f) / G, head = kv * G + (row0 + f) % G;
    const float inv = 1.f / l[f];
    T* o = pb.out + (token * pb.H + head) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[f * D + d] * inv);
    pb.lse[token * pb.H + head] = (m[f] + std::log2(l[f])) / kLog2e;
  }
}

template <typename T, int ND>
void attend_all(const Problem<T>& pb) {
  const int64_t G = pb.H / pb.KVH, rows = pb.n * G;
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, pb.KVH * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kv = task / blocks, row0 = (task % blocks) * kBlockRows;
      attend_block<T, ND>(pb, kv, row0, std::min(kBlockRows, rows - row0));
    }
  });
}

// Packed K and V of L keys (rows `slot` of k/v, or the first L) into kp/vp, each
// (KVH, L_pad · D / per_unit) of Packed; one task per KV head and tensor.
template <typename T>
void pack_all(const T* kd, const T* vd, int64_t row_stride, const int64_t* slot, int64_t L,
              int64_t KVH, int64_t D, typename Flavour<T>::Packed* kp,
              typename Flavour<T>::Packed* vp) {
  const int64_t L_pad = padded_keys(L), head_elems = L_pad * D / Flavour<T>::kPerUnit;
  at::parallel_for(0, 2 * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / 2;
      if (i % 2 == 0)
        pack_k<T>(kd + h * D, row_stride, slot, L, D, kp + h * head_elems, L_pad);
      else
        pack_v<T>(vd + h * D, row_stride, slot, L, D, vp + h * head_elems, L_pad);
    }
  });
}

template <typename T>
void attend(const at::Tensor& q, const int64_t* q_rows, int64_t n,
            const typename Flavour<T>::Packed* kp, const typename Flavour<T>::Packed* vp,
            int64_t L, int64_t KVH, double scale, bool causal, at::Tensor& out,
            at::Tensor& lse) {
  const int64_t H = q.size(1), D = q.size(2);
  const Problem<T> pb{q.data_ptr<T>(), q_rows, n, H, KVH, D, L,
                      static_cast<float>(scale) * kLog2e, causal, kp, vp, padded_keys(L),
                      out.data_ptr<T>(), lse.data_ptr<float>()};
  if (D == 64)
    attend_all<T, 4>(pb);
  else
    attend_all<T, 8>(pb);
}

// Packed K/V of a call that packs its own keys: kept between calls (a fresh multi-MB
// buffer each call is mmap-ed and page-faulted, which costs more than the packing).
std::vector<uint32_t>& pack_workspace() {
  static thread_local std::vector<uint32_t> buffer;
  return buffer;
}

void check_kv(const at::Tensor& k, const at::Tensor& v, at::ScalarType dtype) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3, "k/v (L, KVH, D) expected");
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype,
              "k and v must have q's dtype, bf16 or fp32");
  TORCH_CHECK(k.sizes() == v.sizes() && k.stride(0) == v.stride(0), "k and v shapes disagree");
  const int64_t D = k.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head_dim 64 or 128 expected, got ", D);
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D,
              "k/v rows must hold their heads contiguously");
}

}  // namespace

bool native_flash_supported() { return true; }

std::tuple<at::Tensor, at::Tensor> flash_attention(const at::Tensor& q,
                                                         const at::Tensor& k,
                                                         const at::Tensor& v, double scale,
                                                         bool causal) {
  TORCH_CHECK(q.dim() == 3, "q (n, H, D) expected");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "bf16 or fp32 q expected");
  TORCH_CHECK(q.is_contiguous(), "contiguous q expected");
  check_kv(k, v, dtype);
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), L = k.size(0), KVH = k.size(1);
  TORCH_CHECK(k.size(2) == D, "k and v shapes disagree with q");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(L > 0 && (!causal || L >= n), "every query row needs a key");
  auto out = at::empty_like(q);
  auto lse = at::empty({n, H}, q.options().dtype(at::kFloat));
  // both packed tensors, in 4-byte units (a bf16 feature pair, or an fp32 feature)
  const int64_t unit_elems = KVH * padded_keys(L) * D / (dtype == at::kFloat ? 1 : 2);
  auto& buffer = pack_workspace();
  if (buffer.size() < static_cast<size_t>(2 * unit_elems)) buffer.resize(2 * unit_elems);
  if (dtype == at::kFloat) {
    float* kp = reinterpret_cast<float*>(buffer.data());
    pack_all<float>(k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0), nullptr, L, KVH, D,
                    kp, kp + unit_elems);
    attend<float>(q, nullptr, n, kp, kp + unit_elems, L, KVH, scale, causal, out, lse);
  } else {
    uint32_t* kp = buffer.data();
    pack_all<at::BFloat16>(k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), k.stride(0),
                           nullptr, L, KVH, D, kp, kp + unit_elems);
    attend<at::BFloat16>(q, nullptr, n, kp, kp + unit_elems, L, KVH, scale, causal, out, lse);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> flash_pack(const at::Tensor& k_pool,
                                                    const at::Tensor& v_pool,
                                                    const at::Tensor& slots) {
  const auto dtype = k_pool.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "bf16 or fp32 pools expected");
  check_kv(k_pool, v_pool, dtype);
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots: a contiguous int64 vector expected");
  const int64_t L = slots.numel(), KVH = k_pool.size(1), D = k_pool.size(2);
  TORCH_CHECK(L > 0, "no keys to pack");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t rows = k_pool.size(0);
  for (int64_t j = 0; j < L; ++j)
    TORCH_CHECK(slot[j] >= 0 && slot[j] < rows, "slot ", slot[j], " outside the pool of ", rows);
  const int64_t head_elems = padded_keys(L) * D / (dtype == at::kFloat ? 1 : 2);
  const auto packed_dtype = dtype == at::kFloat ? at::kFloat : at::kInt;
  auto kp = at::empty({KVH, head_elems}, k_pool.options().dtype(packed_dtype));
  auto vp = at::empty({KVH, head_elems}, k_pool.options().dtype(packed_dtype));
  if (dtype == at::kFloat)
    pack_all<float>(k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), k_pool.stride(0), slot,
                    L, KVH, D, kp.data_ptr<float>(), vp.data_ptr<float>());
  else
    pack_all<at::BFloat16>(k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>(),
                           k_pool.stride(0), slot, L, KVH, D,
                           reinterpret_cast<uint32_t*>(kp.data_ptr<int32_t>()),
                           reinterpret_cast<uint32_t*>(vp.data_ptr<int32_t>()));
  return {kp, vp};
}

std::tuple<at::Tensor, at::Tensor> flash_attention_packed(
    const at::Tensor& q, const at::Tensor& q_rows, const at::Tensor& k_packed,
    const at::Tensor& v_packed, int64_t length, double scale, bool causal) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "contiguous q (T, H, D) expected");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "bf16 or fp32 q expected");
  const auto packed_dtype = dtype == at::kFloat ? at::kFloat : at::kInt;
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head_dim 64 or 128 expected, got ", D);
  TORCH_CHECK(k_packed.dim() == 2 && k_packed.sizes() == v_packed.sizes() &&
                  k_packed.scalar_type() == packed_dtype &&
                  v_packed.scalar_type() == packed_dtype && k_packed.is_contiguous() &&
                  v_packed.is_contiguous(),
              "k/v packed by flash_pack for q's dtype expected");
  const int64_t KVH = k_packed.size(0);
  TORCH_CHECK(length > 0 && k_packed.size(1) == padded_keys(length) * D / (dtype == at::kFloat ? 1 : 2),
              "the packed keys disagree with length ", length, " and head_dim ", D);
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q_rows.dim() == 1 && q_rows.scalar_type() == at::kLong && q_rows.is_contiguous(),
              "q_rows: a contiguous int64 vector expected");
  const int64_t n = q_rows.numel();
  const int64_t* rows = q_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < T, "query row ", rows[i], " outside q's ", T, " rows");
  TORCH_CHECK(n > 0 && (!causal || length >= n), "every query row needs a key");
  auto out = at::empty({n, H, D}, q.options());
  auto lse = at::empty({n, H}, q.options().dtype(at::kFloat));
  if (dtype == at::kFloat)
    attend<float>(q, rows, n, k_packed.data_ptr<float>(), v_packed.data_ptr<float>(), length,
                  KVH, scale, causal, out, lse);
  else
    attend<at::BFloat16>(q, rows, n, reinterpret_cast<const uint32_t*>(k_packed.data_ptr<int32_t>()),
                         reinterpret_cast<const uint32_t*>(v_packed.data_ptr<int32_t>()), length,
                         KVH, scale, causal, out, lse);
  return {out, lse};
}

#else  // no AVX-512 BF16 on this machine: the caller keeps torch's flash kernel

bool native_flash_supported() { return false; }

std::tuple<at::Tensor, at::Tensor> flash_attention(const at::Tensor&,
                                                         const at::Tensor&,
                                                         const at::Tensor&, double, bool) {
  TORCH_CHECK(false, "the native flash kernel needs AVX-512 BF16, which this CPU lacks");
}

std::tuple<at::Tensor, at::Tensor> flash_pack(const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&) {
  TORCH_CHECK(false, "the native flash kernel needs AVX-512 BF16, which this CPU lacks");
}

std::tuple<at::Tensor, at::Tensor> flash_attention_packed(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    int64_t, double, bool) {
  TORCH_CHECK(false, "the native flash kernel needs AVX-512 BF16, which this CPU lacks");
}

#endif

TORCH_LIBRARY_FRAGMENT(flowlang, m) {
  m.def("native_flash_supported() -> bool", &native_flash_supported);
  m.def("flash_attention(Tensor q, Tensor k, Tensor v, float scale, bool causal) -> "
        "(Tensor, Tensor)");
  m.def("flash_pack(Tensor k_pool, Tensor v_pool, Tensor slots) -> (Tensor, Tensor)");
  m.def("flash_attention_packed(Tensor q, Tensor q_rows, Tensor k_packed, Tensor v_packed, "
        "int length, float scale, bool causal) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flowlang, CPU, m) {
  m.impl("flash_attention", &flash_attention);
  m.impl("flash_pack", &flash_pack);
  m.impl("flash_attention_packed", &flash_attention_packed);
}
