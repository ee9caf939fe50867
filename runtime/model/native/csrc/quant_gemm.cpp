// y = x @ w.T (+ bias) for decode-sized x (1 to a few dozen rows) with w kept in GGUF's block
// formats, Q8_0 (fp16 d, 32 int8 q: w = d q) and Q4_1 (fp16 d, fp16 m, 16 bytes of nibbles:
// w = d q + m, byte j holding element j low and j + 16 high), blocks of 32 along w's input dim.
// A decode reads every weight once a token, so bytes read is its cost: Q4_1 is 0.625 bytes a
// weight against bf16's 2, and the weights stay in those bytes up to the registers.
//
// Layout (quant_pack): groups of 16 output features, a zmm lane each, one after another, each
// one sequential run of units: a unit is 1 block (Q4_1, 320 bytes) or 2 blocks (Q8_0, 1,088
// bytes) of quants, then their scales, so every load is 64-byte aligned and the whole weight
// streams front to back (a thread takes a contiguous range of groups). A block's quants are
// zmm-sized runs whose 32-bit lane j is output j's next 4 GGUF bytes: Q8_0 8 runs (4 consecutive
// elements a lane, stored + 128: vpdpbusd's first operand is unsigned), Q4_1 4 runs (run t:
// elements 4t..4t+3 in the low nibbles, 16 + 4t.. in the high ones: GGUF's byte order as is).
// Scales: 16 fp16 d (Q4_1: then 16 fp16 m), widened by vcvtph2ps. Bytes are GGUF's own, so the
// weight is read at 1.0625 bytes a weight (Q8_0) or 0.625 (Q4_1), against bf16's 2. No
// horizontal sums: each lane is one output throughout. The last group is padded with zero
// outputs (d = m = 0), masked at the store.
//
// Two paths over that layout:
// (a) activations as given (quantize_x false). fp32 x (and bf16 x with Q8_0, 1-3 rows): x is
//     widened to fp32 (exactly), the weight ints to fp32 in registers, FMA'd one input element at
//     a time; each block's sum(q x) is scaled by d (Q4_1 adds m sum(x)). bf16 x: vdpbf16ps on
//     weight ints made bf16 (Q4_1: one unpack of the nibbles, group_q4_1_bf16; Q8_0: through
//     fp32, group_q8_0_bf16). Either way the result is fp32 "dequantize, then matmul" up to fp32
//     summation order (~1e-6 relative); bf16 output rounds once at the end.
// (b) activations quantized (quantize_x true), as llama.cpp's Q8_0 / Q8_1 activations: each row's
//     32-blocks get dx = max|x| / 127 and xq = round(x / dx) in int8; vpdpbusd sums 4 products
//     u8 x s8 into int32 lanes (Q8_0's + 128 comes back out as 128 sum(xq), preset in the
//     accumulator), and the block's int sum is scaled by d dx (Q4_1 adds m dx sum(xq)). The error
//     is x's rounding, at most dx / 2 an element: |y - y_exact| <= sum over blocks of
//     dx / 2 * sum |w| (the tests check that bound). On the default model's Q4_1 weights with
//     Gaussian x: ~0.5% of |y| (RMS), against 3e-7 for (a) in fp32 and 0.17% for bf16's rounding.
// Speed (examples/benchmarks/kernel_bench.py --quant: SmolLM2-135M's shapes, weights streamed
// from DRAM as in a decode, bf16 x, one Zen 4 core, µs a call against the bf16 panel GEMM over
// the dequantized weight; the ratios hold on 2 cores):
// - 1 row: memory-bound, (a) = (b): Q4_1 ~0.32x the panel's time (576 -> 3072: 56 vs 176),
//   Q8_0 ~0.55x (90-100).
// - 4 rows: (b) 1.3-1.6x faster than (a) (576 -> 3072: Q4_1 63 vs 90, Q8_0 78 vs 129).
// - 16 rows: compute-bound; (a) ~ the panel (335-348 vs 340), (b) 1.35x (Q8_0) to 1.7x (Q4_1)
//   faster than (a). So (b) is the faster path at every row count, (a) the exact one.
// One file past 500 lines: the packing and the six group kernels (two formats, two paths, bf16
// variants) share one layout, and splitting them would spread its definition over files.
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include "avx512_math.h"
#endif

namespace {

constexpr int64_t kGroup = 16;  // output features a group: one zmm of fp32 / int32 lanes
constexpr int64_t kBlock = 32;  // GGUF's block length along the input dim
constexpr int64_t kQ4_1 = 3;    // GGMLQuantizationType values
constexpr int64_t kQ8_0 = 8;

struct Format {
  int64_t raw_bytes;    // a GGUF block
  int64_t quant_bytes;  // a group's block of quants in the packed layout
  int64_t scale_bytes;  // a group's block of scales (fp16 d, then m for Q4_1)
  int64_t unit_blocks;  // blocks whose quants, then scales, fill a multiple of 64 bytes

  constexpr int64_t unit_bytes() const { return unit_blocks * (quant_bytes + scale_bytes); }
  constexpr int64_t quant_offset(int64_t b) const {
    return b / unit_blocks * unit_bytes() + b % unit_blocks * quant_bytes;
  }
  constexpr int64_t scale_offset(int64_t b) const {
    return b / unit_blocks * unit_bytes() + unit_blocks * quant_bytes +
           b % unit_blocks * scale_bytes;
  }
};

constexpr Format kQ8_0Format{34, 32 * kGroup, 2 * kGroup, 2};  // units of 1,088 bytes
constexpr Format kQ4_1Format{20, 16 * kGroup, 4 * kGroup, 1};  // units of 320 bytes

Format format_of(const char* op, int64_t type) {
  if (type == kQ8_0) return kQ8_0Format;
  if (type == kQ4_1) return kQ4_1Format;
  TORCH_CHECK(false, op, ": type ", type, " is not Q4_1 (3) or Q8_0 (8)");
}

int64_t num_groups(int64_t n_out) { return (n_out + kGroup - 1) / kGroup; }

// Whole units (Q8_0's last one half empty for an odd block count): groups start 64-aligned.
int64_t group_bytes(const Format& f, int64_t n_in) {
  return (n_in / kBlock + f.unit_blocks - 1) / f.unit_blocks * f.unit_bytes();
}

bool quant_gemm_supported() {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

// GGUF bytes (n_out rows of n_in / 32 blocks) -> groups as the header describes.
at::Tensor quant_pack(const at::Tensor& raw, int64_t type, int64_t n_out, int64_t n_in) {
  const Format f = format_of("quant_pack", type);
  TORCH_CHECK(n_out > 0 && n_in > 0 && n_in % kBlock == 0,
              "quant_pack: n_in must be a positive multiple of 32, got ", n_in);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() &&
                  raw.numel() == n_out * (n_in / kBlock) * f.raw_bytes,
              "quant_pack: raw must be the contiguous uint8 GGUF bytes of ", n_out, " x ", n_in,
              " weights (", n_out * (n_in / kBlock) * f.raw_bytes, " bytes), got ",
              raw.numel(), " of ", raw.scalar_type());
  const int64_t blocks = n_in / kBlock, per_group = group_bytes(f, n_in);
  at::Tensor packed = at::zeros({num_groups(n_out) * per_group}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, num_groups(n_out), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      uint8_t* group = dst + g * per_group;
      for (int64_t j = 0; j < kGroup && g * kGroup + j < n_out; ++j) {
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* block = src + ((g * kGroup + j) * blocks + b) * f.raw_bytes;
          uint8_t* q = group + f.quant_offset(b) + 4 * j;
          uint8_t* s = group + f.scale_offset(b) + 2 * j;
          std::memcpy(s, block, 2);  // d
          if (type == kQ4_1) std::memcpy(s + 2 * kGroup, block + 2, 2);  // m
          const uint8_t* qs = block + (type == kQ4_1 ? 4 : 2);
          const int64_t runs = type == kQ4_1 ? 4 : 8;
          for (int64_t t = 0; t < runs; ++t)
            for (int64_t i = 0; i < 4; ++i)
              q[t * 64 + i] = type == kQ4_1 ? qs[4 * t + i] : uint8_t(qs[4 * t + i] ^ 0x80);
        }
      }
    }
  });
  return packed;
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)

using namespace flowlang_avx512;

constexpr int kRowBlock = 8;  // rows of x a pass over a group
constexpr int64_t kPrefetch = 2048;  // bytes ahead of the block being read (~4-6 blocks)

// A block's bytes kPrefetch ahead, as the panel GEMM prefetches its panels' (every line of it:
// a Q4_1 block is 5 lines, a Q8_0 block 8.5).
template <const Format& F>
inline void prefetch_block(const uint8_t* group, int64_t b) {
  const char* ahead = reinterpret_cast<const char*>(group + F.quant_offset(b)) + kPrefetch;
  for (int64_t i = 0; i < F.quant_bytes + F.scale_bytes; i += 64)
    _mm_prefetch(ahead + i, _MM_HINT_T0);
}

inline __m512 load_fp16(const uint16_t* p) {  // 16 aligned fp16 scales
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(p)));
}

template <const Format& F>
inline const uint16_t* block_scales(const uint8_t* group, int64_t b) {
  return reinterpret_cast<const uint16_t*>(group + F.scale_offset(b));
}

// What the rows of x become before the kernels read them. (a): fp32 x, and for Q4_1 each block's
// sum(x). (b): int8 xq, each block's dx, and sum(xq) (Q8_0's correction) or dx sum(xq) (Q4_1's).
struct Activations {
  const float* xf = nullptr;
  const at::BFloat16* xb = nullptr;  // (a), bf16 x: x as given
  const int8_t* xq = nullptr;
  const float* dx = nullptr;
  const float* block_sum = nullptr;  // (a) sum(x), (b) Q4_1: dx sum(xq)
  const int32_t* q_sum = nullptr;    // (b) sum(xq)
  int64_t k = 0, blocks = 0;
};

inline __m512 block_x(const float* xf, const at::BFloat16* xb, int64_t i) {
  return xf ? _mm512_loadu_ps(xf + i) : load_bf16(xb + i);
}

// Row r's 32-blocks to int8 (round to nearest even), their dx, sum(xq) and dx sum(xq).
template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t blocks, int8_t* xq, float* dx, int32_t* q_sum,
                  float* block_sum) {
  const float* xf = nullptr;
  const at::BFloat16* xb = nullptr;
  if constexpr (std::is_same_v<scalar_t, float>) xf = x; else xb = x;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 lo = block_x(xf, xb, b * kBlock), hi = block_x(xf, xb, b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + 16), _mm512_cvtsepi32_epi8(qhi));
    const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    dx[b] = d;
    q_sum[b] = s;
    block_sum[b] = d * static_cast<float>(s);
  }
}

// Row r's blocks' sums (for Q4_1's m term), and the row in fp32 where xf is given.
template <typename scalar_t>
void widen_row(const scalar_t* x, int64_t blocks, float* xf, float* block_sum) {
  const float* in_f = nullptr;
  const at::BFloat16* in_b = nullptr;
  if constexpr (std::is_same_v<scalar_t, float>) in_f = x; else in_b = x;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 lo = block_x(in_f, in_b, b * kBlock), hi = block_x(in_f, in_b, b * kBlock + 16);
    if (xf) {
      _mm512_storeu_ps(xf + b * kBlock, lo);
      _mm512_storeu_ps(xf + b * kBlock + 16, hi);
    }
    block_sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
}

inline int32_t x_quad(const int8_t* p) {  // 4 int8 of x as one broadcastable lane
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Chains of partial sums, C a row (float for (a), int32 for (b)): zeroed at each block, summed
// once at its end, so a block's C independent chains hide the multiply-add latency.
template <int MB, int C>
inline void zero_chains(__m512 (*part)[C]) {
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < C; ++c) part[m][c] = _mm512_setzero_ps();
}

template <int MB, int C>
inline void zero_chains(__m512i (*part)[C]) {
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < C; ++c) part[m][c] = _mm512_setzero_si512();
}

template <int C>
inline __m512 chain_sum(const __m512* chains) {
  __m512 sum = chains[0];
  for (int c = 1; c < C; ++c) sum = _mm512_add_ps(sum, chains[c]);
  return sum;
}

template <int C>
inline __m512i chain_sum(const __m512i* chains) {
  __m512i sum = chains[0];
  for (int c = 1; c < C; ++c) sum = _mm512_add_epi32(sum, chains[c]);
  return sum;
}

// (b), Q8_0: rows [0, MB) of the activations against one group; acc gets 16 outputs a row.
template <int MB>
inline void group_q8_0_int8(const uint8_t* group, const Activations& a, __m512* acc) {
  constexpr int C = MB <= 2 ? 2 : 1;  // int chains a row: vpdpbusd's latency hides behind 2
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = group + kQ8_0Format.quant_offset(b);
    prefetch_block<kQ8_0Format>(group, b);
    __m512i ia[MB][C];
    zero_chains<MB, C>(ia);
    for (int m = 0; m < MB; ++m)  // the weights' + 128 adds 128 sum(xq): start below it
      ia[m][0] = _mm512_set1_epi32(-128 * a.q_sum[m * a.blocks + b]);
    for (int t = 0; t < 8; ++t) {
      const __m512i w = _mm512_load_si512(qb + 64 * t);
      for (int m = 0; m < MB; ++m) {
        const __m512i xv = _mm512_set1_epi32(x_quad(a.xq + m * a.k + b * kBlock + 4 * t));
        ia[m][t % C] = _mm512_dpbusd_epi32(ia[m][t % C], w, xv);
      }
    }
    const __m512 d = load_fp16(block_scales<kQ8_0Format>(group, b));
    for (int m = 0; m < MB; ++m) {
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.dx[m * a.blocks + b]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chain_sum<C>(ia[m])), scale, acc[m]);
    }
  }
}

// (b), Q4_1: as above; a run's low nibbles meet x[4t..], its high ones x[16 + 4t..].
template <int MB>
inline void group_q4_1_int8(const uint8_t* group, const Activations& a, __m512* acc) {
  constexpr int C = MB <= 2 ? 2 : 1;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = group + kQ4_1Format.quant_offset(b);
    prefetch_block<kQ4_1Format>(group, b);
    __m512i ia[MB][C];
    zero_chains<MB, C>(ia);
    for (int t = 0; t < 4; ++t) {
      const __m512i w = _mm512_load_si512(qb + 64 * t);
      const __m512i lo = _mm512_and_si512(w, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xm = a.xq + m * a.k + b * kBlock + 4 * t;
        ia[m][0] = _mm512_dpbusd_epi32(ia[m][0], lo, _mm512_set1_epi32(x_quad(xm)));
        ia[m][C - 1] = _mm512_dpbusd_epi32(ia[m][C - 1], hi, _mm512_set1_epi32(x_quad(xm + 16)));
      }
    }
    const uint16_t* s = block_scales<kQ4_1Format>(group, b);
    const __m512 d = load_fp16(s);
    const __m512 mv = load_fp16(s + kGroup);
    for (int m = 0; m < MB; ++m) {
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.dx[m * a.blocks + b]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chain_sum<C>(ia[m])), scale, acc[m]);
      acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.block_sum[m * a.blocks + b]), acc[m]);
    }
  }
}

// Byte S of each 32-bit lane (of signed bytes) as fp32: one element of each of 16 outputs.
template <int S>
inline __m512 lane_byte(__m512i w) {
  const __m512i top = S == 3 ? w : _mm512_slli_epi32(w, 24 - 8 * S);
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(top, 24));
}

// (a): one lane-vector of weight ints (as fp32) times x[i] of every row, into C chains a row:
// an FMA's 4-cycle latency needs several independent sums when few rows share each weight.
template <int MB, int C>
inline void fma_rows(__m512 q, const float* x, int64_t k, int64_t i, int chain, __m512 (*part)[C]) {
  for (int m = 0; m < MB; ++m)
    part[m][chain % C] = _mm512_fmadd_ps(q, _mm512_set1_ps(x[m * k + i]), part[m][chain % C]);
}

template <int MB>
inline void group_q8_0_fp32(const uint8_t* group, const Activations& a, __m512* acc) {
  constexpr int C = MB <= 2 ? 4 : MB <= 4 ? 2 : 1;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = group + kQ8_0Format.quant_offset(b);
    prefetch_block<kQ8_0Format>(group, b);
    __m512 part[MB][C];
    zero_chains<MB, C>(part);
    for (int t = 0; t < 8; ++t) {
      const __m512i w = _mm512_xor_si512(_mm512_load_si512(qb + 64 * t), flip);  // signed again
      const int64_t i = b * kBlock + 4 * t;
      fma_rows<MB, C>(lane_byte<0>(w), a.xf, a.k, i, 0, part);
      fma_rows<MB, C>(lane_byte<1>(w), a.xf, a.k, i + 1, 1, part);
      fma_rows<MB, C>(lane_byte<2>(w), a.xf, a.k, i + 2, 2, part);
      fma_rows<MB, C>(lane_byte<3>(w), a.xf, a.k, i + 3, 3, part);
    }
    const __m512 d = load_fp16(block_scales<kQ8_0Format>(group, b));
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_fmadd_ps(chain_sum<C>(part[m]), d, acc[m]);
    }
  }
}

template <int MB>
inline void group_q4_1_fp32(const uint8_t* group, const Activations& a, __m512* acc) {
  constexpr int C = MB <= 2 ? 4 : MB <= 4 ? 2 : 1;
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = group + kQ4_1Format.quant_offset(b);
    prefetch_block<kQ4_1Format>(group, b);
    __m512 part[MB][C];
    zero_chains<MB, C>(part);
    for (int t = 0; t < 4; ++t) {
      const __m512i w = _mm512_load_si512(qb + 64 * t);
      const int64_t i = b * kBlock + 4 * t;
      for (int n = 0; n < 8; ++n) {  // nibble n: byte n / 2, the high half (element + 16) if odd
        const __m512i q = _mm512_and_si512(_mm512_srli_epi32(w, 4 * n), nibble);
        fma_rows<MB, C>(_mm512_cvtepi32_ps(q), a.xf, a.k, i + n / 2 + 16 * (n % 2), n, part);
      }
    }
    const uint16_t* s = block_scales<kQ4_1Format>(group, b);
    const __m512 d = load_fp16(s);
    const __m512 mv = load_fp16(s + kGroup);
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_fmadd_ps(chain_sum<C>(part[m]), d, acc[m]);
      acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.block_sum[m * a.blocks + b]), acc[m]);
    }
  }
}

// (a), bf16 x with Q8_0: vdpbf16ps on weight pairs. An int8 as fp32 has at most 8 significant
// bits, so its upper 16 bits are its bf16 exactly; a word blend pairs elements (4t, 4t+1) and
// (4t+2, 4t+3) of each output in its lane, against x's pairs broadcast: half the multiply
// instructions of the fp32 path for 4 more conversions a run (1.5x faster at 16 rows, 1.15x
// slower at 1 row, even at 4: blocks of fewer rows take the fp32 path).
template <int MB>
inline void group_q8_0_bf16(const uint8_t* group, const Activations& a, __m512* acc) {
  constexpr int C = MB <= 2 ? 2 : 1;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = group + kQ8_0Format.quant_offset(b);
    prefetch_block<kQ8_0Format>(group, b);
    __m512 part[MB][C];
    zero_chains<MB, C>(part);
    for (int t = 0; t < 8; ++t) {
      const __m512i w = _mm512_xor_si512(_mm512_load_si512(qb + 64 * t), flip);  // signed again
      const __m512i f0 = _mm512_castps_si512(lane_byte<0>(w));
      const __m512i f1 = _mm512_castps_si512(lane_byte<1>(w));
      const __m512i f2 = _mm512_castps_si512(lane_byte<2>(w));
      const __m512i f3 = _mm512_castps_si512(lane_byte<3>(w));
      constexpr __mmask32 kHigh = 0xAAAAAAAA;  // a lane's upper word: the pair's second element
      const __m512bh w01 = (__m512bh)_mm512_mask_blend_epi16(kHigh, _mm512_srli_epi32(f0, 16), f1);
      const __m512bh w23 = (__m512bh)_mm512_mask_blend_epi16(kHigh, _mm512_srli_epi32(f2, 16), f3);
      for (int m = 0; m < MB; ++m) {
        const at::BFloat16* xm = a.xb + m * a.k + b * kBlock + 4 * t;
        int32_t x01, x23;
        std::memcpy(&x01, xm, sizeof(x01));
        std::memcpy(&x23, xm + 2, sizeof(x23));
        const int c = t % C;
        part[m][c] = _mm512_dpbf16_ps(part[m][c], w01, (__m512bh)_mm512_set1_epi32(x01));
        part[m][c] = _mm512_dpbf16_ps(part[m][c], w23, (__m512bh)_mm512_set1_epi32(x23));
      }
    }
    const __m512 d = load_fp16(block_scales<kQ8_0Format>(group, b));
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_fmadd_ps(chain_sum<C>(part[m]), d, acc[m]);
    }
  }
}

// (a), bf16 x with Q4_1: vdpbf16ps on nibbles made bf16 in two instructions. A byte u < 128
// beside 0x43 is the bf16 128 + u exactly, so vpunpck{l,h}bw of the nibbles with 0x43 gives
// weight pairs (128 + q) without a conversion; 128 d sum(x) comes back out with m (m - 128 d).
// The unpack works within 128-bit lanes: the low half's 32-bit lanes hold (output 4L, elements
// 0-1), (4L, 2-3), (4L+1, 0-1), (4L+1, 2-3) of a run's 4 elements, the high half 4L+2 and
// 4L+3, so x's 4 elements broadcast as one 64-bit lane, d is spread to match (unpack{lo,hi}_ps
// of d with itself), and the pairs of lanes are summed into outputs once, at the end.
template <int MB>
inline void group_q4_1_bf16(const uint8_t* group, const Activations& a, __m512* acc) {
  constexpr int C = MB <= 2 ? 2 : 1;  // chains of each half a row
  const __m512i nibble = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x43);
  __m512 lo_acc[MB], hi_acc[MB];  // (output, element pair) lanes as above
  for (int m = 0; m < MB; ++m)
    acc[m] = lo_acc[m] = hi_acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = group + kQ4_1Format.quant_offset(b);
    prefetch_block<kQ4_1Format>(group, b);
    __m512 lo_part[MB][C], hi_part[MB][C];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < C; ++c) lo_part[m][c] = hi_part[m][c] = _mm512_setzero_ps();
    for (int t = 0; t < 4; ++t) {
      const __m512i w = _mm512_load_si512(qb + 64 * t);
      const __m512i q_lo = _mm512_and_si512(w, nibble);  // elements 4t..4t+3
      const __m512i q_hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);  // 16 + 4t..
      const __m512bh w0 = (__m512bh)_mm512_unpacklo_epi8(q_lo, high);
      const __m512bh w1 = (__m512bh)_mm512_unpackhi_epi8(q_lo, high);
      const __m512bh w2 = (__m512bh)_mm512_unpacklo_epi8(q_hi, high);
      const __m512bh w3 = (__m512bh)_mm512_unpackhi_epi8(q_hi, high);
      for (int m = 0; m < MB; ++m) {
        const at::BFloat16* xm = a.xb + m * a.k + b * kBlock + 4 * t;
        int64_t x0, x1;
        std::memcpy(&x0, xm, sizeof(x0));
        std::memcpy(&x1, xm + 16, sizeof(x1));
        const __m512bh xv0 = (__m512bh)_mm512_set1_epi64(x0);
        const __m512bh xv1 = (__m512bh)_mm512_set1_epi64(x1);
        const int c = t % C;
        lo_part[m][c] = _mm512_dpbf16_ps(lo_part[m][c], w0, xv0);
        hi_part[m][c] = _mm512_dpbf16_ps(hi_part[m][c], w1, xv0);
        lo_part[m][c] = _mm512_dpbf16_ps(lo_part[m][c], w2, xv1);
        hi_part[m][c] = _mm512_dpbf16_ps(hi_part[m][c], w3, xv1);
      }
    }
    const uint16_t* s = block_scales<kQ4_1Format>(group, b);
    const __m512 d = load_fp16(s);
    const __m512 mv = load_fp16(s + kGroup);
    const __m512 m_shifted = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), d, mv);  // m - 128 d
    const __m512 d_lo = _mm512_unpacklo_ps(d, d), d_hi = _mm512_unpackhi_ps(d, d);
    for (int m = 0; m < MB; ++m) {
      __m512 lo = lo_part[m][0], hi = hi_part[m][0];
      for (int c = 1; c < C; ++c) {
        lo = _mm512_add_ps(lo, lo_part[m][c]);
        hi = _mm512_add_ps(hi, hi_part[m][c]);
      }
      lo_acc[m] = _mm512_fmadd_ps(lo, d_lo, lo_acc[m]);
      hi_acc[m] = _mm512_fmadd_ps(hi, d_hi, hi_acc[m]);
      acc[m] = _mm512_fmadd_ps(m_shifted, _mm512_set1_ps(a.block_sum[m * a.blocks + b]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) {  // lanes (4L, 0-1), (4L, 2-3), ... -> outputs 4L..4L+3
    const __m512 even = _mm512_shuffle_ps(lo_acc[m], hi_acc[m], 0x88);
    const __m512 odd = _mm512_shuffle_ps(lo_acc[m], hi_acc[m], 0xDD);
    acc[m] = _mm512_add_ps(acc[m], _mm512_add_ps(even, odd));
  }
}

// Activations rows [m0, m0 + MB) as seen by the group kernels (pointers moved to row m0).
Activations rows_from(const Activations& a, int64_t m0) {
  Activations r = a;
  if (a.xf) r.xf = a.xf + m0 * a.k;
  if (a.xb) r.xb = a.xb + m0 * a.k;
  if (a.xq) r.xq = a.xq + m0 * a.k;
  if (a.dx) r.dx = a.dx + m0 * a.blocks;
  if (a.block_sum) r.block_sum = a.block_sum + m0 * a.blocks;
  if (a.q_sum) r.q_sum = a.q_sum + m0 * a.blocks;
  return r;
}

template <int MB>
inline void group_rows(const uint8_t* group, const Activations& a, bool q4_1, bool int8,
                       __m512* acc) {
  if (int8)
    q4_1 ? group_q4_1_int8<MB>(group, a, acc) : group_q8_0_int8<MB>(group, a, acc);
  else if (a.xb && !q4_1 && MB >= 4)  // below 4 rows its conversions cost more than it saves
    group_q8_0_bf16<MB>(group, a, acc);
  else if (a.xb && q4_1) {
    if constexpr (MB > 4) {  // 4 rows' partial and running sums already take 28 registers
      group_q4_1_bf16<4>(group, a, acc);
      group_q4_1_bf16<MB - 4>(group, rows_from(a, 4), acc + 4);
    } else {
      group_q4_1_bf16<MB>(group, a, acc);
    }
  } else
    q4_1 ? group_q4_1_fp32<MB>(group, a, acc) : group_q8_0_fp32<MB>(group, a, acc);
}

template <typename scalar_t>
inline void store_group(scalar_t* y, const scalar_t* bias, __m512 v, int64_t left) {
  const __mmask16 mask = tail_mask(left);
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
    _mm512_mask_storeu_ps(y, mask, v);
  } else {
    if (bias) v = _mm512_add_ps(v, load_bf16(bias, mask));
    store_bf16(y, v, mask);
  }
}

template <typename scalar_t>
void quant_gemm_kernel(const Activations& a, const uint8_t* packed, int64_t per_group,
                       bool q4_1, bool int8, const scalar_t* bias, scalar_t* y, int64_t rows,
                       int64_t n_out) {
  at::parallel_for(0, num_groups(n_out), 1, [&](int64_t begin, int64_t end) {
    __m512 acc[kRowBlock];
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = packed + g * per_group;
      const int64_t n0 = g * kGroup;
      for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
        const Activations r = rows_from(a, m0);
        switch (std::min<int64_t>(rows - m0, kRowBlock)) {
          case 1: group_rows<1>(group, r, q4_1, int8, acc); break;
          case 2: group_rows<2>(group, r, q4_1, int8, acc); break;
          case 3: group_rows<3>(group, r, q4_1, int8, acc); break;
          case 4: group_rows<4>(group, r, q4_1, int8, acc); break;
          case 5: group_rows<5>(group, r, q4_1, int8, acc); break;
          case 6: group_rows<6>(group, r, q4_1, int8, acc); break;
          case 7: group_rows<7>(group, r, q4_1, int8, acc); break;
          default: group_rows<8>(group, r, q4_1, int8, acc); break;
        }
        for (int64_t m = 0; m < std::min<int64_t>(rows - m0, kRowBlock); ++m)
          store_group(y + (m0 + m) * n_out + n0, bias ? bias + n0 : nullptr, acc[m], n_out - n0);
      }
    }
  });
}

// Prepares x (either path) into `scratch`-owned buffers and runs the kernel.
template <typename scalar_t>
void run_quant_gemm(const at::Tensor& x, const uint8_t* packed, int64_t per_group, bool q4_1,
                    bool int8, const scalar_t* bias, scalar_t* y, int64_t n_out) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  const scalar_t* xs = x.data_ptr<scalar_t>();
  Activations a;
  a.k = k;
  a.blocks = blocks;
  std::vector<float> block_sum(rows * blocks), xf, dx;
  std::vector<int8_t> xq;
  std::vector<int32_t> q_sum;
  if (int8) {
    xq.resize(rows * k), dx.resize(rows * blocks), q_sum.resize(rows * blocks);
    for (int64_t r = 0; r < rows; ++r)
      quantize_row(xs + r * k, blocks, xq.data() + r * k, dx.data() + r * blocks,
                   q_sum.data() + r * blocks, block_sum.data() + r * blocks);
    a.xq = xq.data(), a.dx = dx.data(), a.q_sum = q_sum.data();
  } else {
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) a.xb = xs;  // vdpbf16ps reads x as given
    const bool widened = !a.xb || !q4_1;  // Q8_0's blocks of 1-3 rows take the fp32 path
    if (widened) xf.resize(rows * k);
    for (int64_t r = 0; r < rows; ++r)
      widen_row(xs + r * k, blocks, widened ? xf.data() + r * k : nullptr,
                block_sum.data() + r * blocks);
    if (widened) a.xf = xf.data();
  }
  a.block_sum = block_sum.data();
  quant_gemm_kernel<scalar_t>(a, packed, per_group, q4_1, int8, bias, y, rows, n_out);
}

#endif  // __AVX512BF16__ && __AVX512VNNI__

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                      const c10::optional<at::Tensor>& bias, int64_t n_out, bool quantize_x) {
  TORCH_CHECK(quant_gemm_supported(), "quant_gemm: this CPU build has no AVX-512 BF16 + VNNI");
  const Format f = format_of("quant_gemm", type);
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0,
              "quant_gemm: x must be (rows, in) with in a multiple of 32, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_gemm: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t rows = x.size(0), k = x.size(1), per_group = group_bytes(f, k);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && n_out > 0 &&
                  packed.numel() == num_groups(n_out) * per_group,
              "quant_gemm: packed (", packed.numel(), " bytes) is not quant_pack's for ", n_out,
              " outputs of ", k, " features of type ", type);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "quant_gemm: packed must be 64-byte aligned (quant_pack's own tensor is)");
  const at::Tensor* b = bias.has_value() ? &bias.value() : nullptr;
  if (b) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == n_out && b->scalar_type() == x.scalar_type() &&
                    b->is_contiguous(),
                "quant_gemm: bias must be a contiguous (out,) tensor of x's dtype");
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, n_out}, xc.options());
  if (rows == 0) return y;
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const bool q4_1 = type == kQ4_1;
  if (x.scalar_type() == at::kFloat) {
    run_quant_gemm<float>(xc, p, per_group, q4_1, quantize_x, b ? b->data_ptr<float>() : nullptr,
                          y.data_ptr<float>(), n_out);
  } else {
    run_quant_gemm<at::BFloat16>(xc, p, per_group, q4_1, quantize_x,
                                 b ? b->data_ptr<at::BFloat16>() : nullptr,
                                 y.data_ptr<at::BFloat16>(), n_out);
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flowlang, m) {
  m.def("quant_gemm_supported() -> bool", &quant_gemm_supported);
  m.def("quant_pack(Tensor raw, int type, int n_out, int n_in) -> Tensor");
  m.def("quant_gemm(Tensor x, Tensor packed, int type, Tensor? bias, int n_out, "
        "bool quantize_x=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(flowlang, CPU, m) {
  m.impl("quant_pack", &quant_pack);
  m.impl("quant_gemm", &quant_gemm);
}
