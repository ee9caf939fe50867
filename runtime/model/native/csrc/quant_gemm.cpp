// y = x @ w.T (+ bias) for decode-sized x (1 to a few dozen rows) with w kept in GGUF's block
// formats, blocks of 32 along w's input dim: Q8_0 (fp16 d, 32 int8 q: w = d q) and Q4_1 (fp16
// d, fp16 m, 16 bytes of nibbles: w = d q + m, byte j holding element j low and j + 16 high),
// and four more packed into their two layouts (below): Q4_0 (fp16 d, nibbles as Q4_1's:
// w = d (q - 8)), Q5_0 (fp16 d, 4 bytes qh of 5th bits, nibbles: w = d (q - 16)), Q4_K
// (super-blocks of 256: fp16 d and dmin, 6-bit scale and min of each 32: w = d sc q - dmin m)
// and Q6_K (super-blocks of 256: 6-bit q, an int8 scale a 16: w = d sc (q - 32)); the K types
// need n_in a multiple of 256. A decode reads every weight once a token, so bytes read is its
// cost: Q4_1 is 0.625 bytes a weight against bf16's 2, and the weights stay in those bytes up to
// the registers.
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
// outputs (d = m = 0), masked at the store. The other types, exactly (same weights):
// - Q4_0: Q4_1's layout with m = -8 d in fp16 (exact, a power-of-two multiple): 0.625 bytes.
// - Q5_0: Q8_0's layout, int8 q - 16: 1.0625 bytes a weight against GGUF's 0.6875 (a first
//   version: a 5-bit layout would read less).
// - Q4_K: Q4_1's runs (each 32 of a super-block repacked into them) with fp32 d sc and
//   -dmin m (d sc is exact in fp32, not in fp16): units of 384 bytes, 0.75 bytes a weight
//   against GGUF's 0.5625.
// - Q6_K: Q8_0's runs, int8 q - 32 (+ 128), then two fp32 scales a block (d sc of elements
//   0-15, runs 0-3, and of 16-31, runs 4-7): units of 640 bytes, 1.25 bytes a weight against
//   GGUF's 0.82. The kernels sum each half's runs apart and scale them apart.
// So the kernels see four layouts: int8 or nibble quants, fp16 or fp32 scales (Format).
//
// Two paths over that layout:
// (a) activations as given (quantize_x false). fp32 x (and bf16 x, int8 layouts, 1-3 rows): x is
//     widened to fp32 (exactly), the weight ints to fp32 in registers, FMA'd one input element at
//     a time; each block's sum(q x) is scaled by d (Q4_1 adds m sum(x)). bf16 x: vdpbf16ps on
//     weight ints made bf16 (Q4_1: one unpack of the nibbles, group_q4_1_bf16; Q8_0: through
//     fp32, group_q8_0_bf16). Either way the result is fp32 "dequantize, then matmul" up to fp32
//     summation order (~1e-6 relative); bf16 output rounds once at the end.
// (b) activations quantized (quantize_x true), as llama.cpp's Q8_0 / Q8_1 activations: each row's
//     32-blocks get dx = max|x| / 127 and xq = round(x / dx) in int8; vpdpbusd sums 4 products
//     u8 x s8 into int32 lanes (Q8_0's + 128 comes back out as 128 sum(xq), preset in the
//     accumulator; Q6_K's as 128 sum(xq) of each 16-half), and the block's int sum is scaled by
//     d dx (Q4_1 adds m dx sum(xq)). The error is x's rounding, at most dx / 2 an element:
//     |y - y_exact| <= sum over blocks of dx / 2 * sum |w| (the tests check that bound). On the
//     default model's Q4_1 weights with Gaussian x: ~0.5% of |y| (RMS), against 3e-7 for (a) in
//     fp32 and 0.17% for bf16's rounding.
// Rows a pass over a group: up to 8, whose chains (and, for bf16 x over the int8 layouts, whose
// path) depend on how many share it; or, with rows_alike, at most 2, where the kernels of 1 and
// 2 rows do the same work per row, so that each row's sums are what it gets alone (what a
// batch-invariant or speculating engine needs: a verified draft sums as the decode it replaces).
// Speed (examples/benchmarks/kernel_bench.py --quant: SmolLM2-135M's shapes, weights streamed
// from DRAM as in a decode, bf16 x, one Zen 4 core, µs a call against the bf16 panel GEMM over
// the dequantized weight; the ratios hold on 2 cores):
// - 1 row: memory-bound, (a) = (b): Q4_1 ~0.32x the panel's time (576 -> 3072: 56 vs 176),
//   Q8_0 ~0.55x (90-100).
// - 4 rows: (b) 1.3-1.6x faster than (a) (576 -> 3072: Q4_1 63 vs 90, Q8_0 78 vs 129).
// - 16 rows: compute-bound; (a) ~ the panel (335-348 vs 340), (b) 1.35x (Q8_0) to 1.7x (Q4_1)
//   faster than (a). So (b) is the faster path at every row count, (a) the exact one.
//   The other types at 1536 -> 576 (2 cores, bf16 x, 1 / 4 / 16 rows, (a) and (b)): Q4_0 and
//   Q4_K as Q4_1 (20-22 / 31-35 / 81-97 µs), Q5_0 as Q8_0 (29-36 / 36-41 / 94-100), Q6_K
//   (a) 42 / 48 / 101, (b) 32 / 46 / 107, against the panel's 47 / 48 / 83.
// One file past 500 lines: the packing (six GGUF types into four layouts) and the six group
// kernels (two quant widths, two paths, bf16 variants; templates over the layout) share one
// layout definition, and splitting them would spread it over files.
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include "avx512_math.h"
#endif

namespace {

constexpr int64_t kGroup = 16;  // output features a group: one zmm of fp32 / int32 lanes
constexpr int64_t kBlock = 32;  // GGUF's block length along the input dim (K types: sub-block)
constexpr int64_t kQ4_0 = 2;    // GGMLQuantizationType values
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ5_0 = 6;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kQ4_K = 12;
constexpr int64_t kQ6_K = 14;

// A packed layout: what the group kernels read. Its block is always 32 input features.
struct Format {
  int64_t quant_bytes;  // a group's block of quants in the packed layout
  int64_t scale_bytes;  // a group's block of scales
  int64_t unit_blocks;  // blocks whose quants, then scales, fill a multiple of 64 bytes
  bool nibbles;         // quants: 4-bit (Q4_1's runs) or int8 + 128 (Q8_0's)
  bool fp32_scales;     // scales: fp16 (GGUF's own bits) or fp32
  int halves;           // int8 layouts: scales a block (2: one per 16 elements)

  constexpr int64_t unit_bytes() const { return unit_blocks * (quant_bytes + scale_bytes); }
  constexpr int64_t quant_offset(int64_t b) const {
    return b / unit_blocks * unit_bytes() + b % unit_blocks * quant_bytes;
  }
  constexpr int64_t scale_offset(int64_t b) const {
    return b / unit_blocks * unit_bytes() + unit_blocks * quant_bytes +
           b % unit_blocks * scale_bytes;
  }
};

// Q8_0, Q5_0: 16 fp16 d a block, units of 1,088 bytes. Q4_1, Q4_0: 16 fp16 d then 16 fp16 m,
// 320 bytes. Q4_K: 16 fp32 d then 16 fp32 m, 384 bytes. Q6_K: 2 x 16 fp32 d, 640 bytes.
constexpr Format kQ8_0Format{32 * kGroup, 2 * kGroup, 2, false, false, 1};
constexpr Format kQ4_1Format{16 * kGroup, 4 * kGroup, 1, true, false, 1};
constexpr Format kQ4_KFormat{16 * kGroup, 8 * kGroup, 1, true, true, 1};
constexpr Format kQ6_KFormat{32 * kGroup, 8 * kGroup, 1, false, true, 2};

// A GGUF type: its block (raw_bytes for raw_elems weights) and the layout it is packed into.
struct QuantType {
  int64_t raw_bytes, raw_elems;
  const Format* layout;
};

QuantType type_of(const char* op, int64_t type) {
  switch (type) {
    case kQ4_0: return {18, kBlock, &kQ4_1Format};
    case kQ4_1: return {20, kBlock, &kQ4_1Format};
    case kQ5_0: return {22, kBlock, &kQ8_0Format};
    case kQ8_0: return {34, kBlock, &kQ8_0Format};
    case kQ4_K: return {144, 256, &kQ4_KFormat};
    case kQ6_K: return {210, 256, &kQ6_KFormat};
    default: break;
  }
  TORCH_CHECK(false, op, ": type ", type, " is not one of Q4_0 (2), Q4_1 (3), Q5_0 (6), ",
              "Q8_0 (8), Q4_K (12), Q6_K (14)");
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

// One 32-block of GGUF weights as a layout stores it: w = d q + m (Q6_K: d[0] for elements
// 0-15, d[1] for 16-31).
struct SubBlock {
  int8_t q[kBlock];            // int8 layouts: q itself; nibble layouts: 0..15
  uint16_t d16 = 0, m16 = 0;   // fp16 layouts: GGUF's bits
  float d[2] = {0.f, 0.f}, m = 0.f;  // fp32 layouts
};

inline uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float fp16_at(const uint8_t* p) {
  return static_cast<float>(c10::Half(u16_at(p), c10::Half::from_bits()));
}

// GGUF's nibble order for a 32-block: element e < 16 in byte e's low half, 16 + e in its high.
inline void unpack_nibbles(const uint8_t* qs, int8_t* q) {
  for (int e = 0; e < 16; ++e) {
    q[e] = static_cast<int8_t>(qs[e] & 0x0F);
    q[e + 16] = static_cast<int8_t>(qs[e] >> 4);
  }
}

// Q4_K's 6-bit scale and min of sub-block s (gguf-py's Q4_K.get_scale_min).
inline void k_scale_min(const uint8_t* sc, int s, int& scale, int& min) {
  if (s < 4) {
    scale = sc[s] & 63;
    min = sc[s + 4] & 63;
  } else {
    scale = (sc[s + 4] & 0x0F) | ((sc[s - 4] >> 6) << 4);
    min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
  }
}

// Sub-block s (0 for the 32-blocks, 0-7 for the K types' 256) of one GGUF block.
SubBlock decode(int64_t type, const uint8_t* raw, int s) {
  SubBlock out;
  if (type == kQ8_0 || type == kQ4_1 || type == kQ4_0 || type == kQ5_0) out.d16 = u16_at(raw);
  if (type == kQ8_0) {
    std::memcpy(out.q, raw + 2, kBlock);
  } else if (type == kQ4_1) {
    out.m16 = u16_at(raw + 2);
    unpack_nibbles(raw + 4, out.q);
  } else if (type == kQ4_0) {  // m = -8 d: exact in fp16 (a power-of-two multiple)
    const float m = -8.f * fp16_at(raw);
    TORCH_CHECK(std::abs(m) <= 65504.f, "quant_pack: a Q4_0 block's d (", fp16_at(raw),
                ") is too large: -8 d is past fp16's range");
    out.m16 = c10::Half(m).x;
    unpack_nibbles(raw + 2, out.q);
  } else if (type == kQ5_0) {
    uint32_t qh;
    std::memcpy(&qh, raw + 2, sizeof(qh));
    unpack_nibbles(raw + 6, out.q);
    for (int e = 0; e < kBlock; ++e)
      out.q[e] = static_cast<int8_t>((out.q[e] | static_cast<int>((qh >> e) & 1) << 4) - 16);
  } else if (type == kQ4_K) {  // w = d sc q - dmin m, a 32-byte chunk's low nibbles, then high
    int scale, min;
    k_scale_min(raw + 4, s, scale, min);
    out.d[0] = fp16_at(raw) * scale;  // exact in fp32 (11 + 6 bits), as gguf-py's
    out.m = -(fp16_at(raw + 2) * min);
    const uint8_t* qs = raw + 16 + 32 * (s / 2);
    for (int e = 0; e < kBlock; ++e) out.q[e] = static_cast<int8_t>((qs[e] >> (4 * (s % 2))) & 15);
  } else {  // Q6_K: ql[128], qh[64], int8 scales[16], fp16 d; w = d scales[e / 16] (q - 32)
    const float d = fp16_at(raw + 208);
    for (int h = 0; h < 2; ++h) out.d[h] = d * static_cast<int8_t>(raw[192 + 2 * s + h]);
    for (int e = 0; e < kBlock; ++e) {
      const int r = (32 * s + e) % 128, half = (32 * s + e) / 128;  // 128-element halves
      const int lo = (raw[64 * half + r % 64] >> (4 * (r / 64))) & 15;
      const int hi = (raw[128 + 32 * half + r % 32] >> (2 * (r / 32))) & 3;
      out.q[e] = static_cast<int8_t>((lo | hi << 4) - 32);
    }
  }
  return out;
}

// Output j's block b of a group, as the header describes.
void write_block(const Format& f, const SubBlock& sb, uint8_t* group, int64_t b, int64_t j) {
  uint8_t* q = group + f.quant_offset(b) + 4 * j;
  for (int t = 0; t < (f.nibbles ? 4 : 8); ++t)
    for (int i = 0; i < 4; ++i)
      q[t * 64 + i] = f.nibbles ? uint8_t(sb.q[4 * t + i] | sb.q[16 + 4 * t + i] << 4)
                                : uint8_t(sb.q[4 * t + i] ^ 0x80);
  uint8_t* s = group + f.scale_offset(b);
  if (!f.fp32_scales) {
    std::memcpy(s + 2 * j, &sb.d16, 2);
    if (f.nibbles) std::memcpy(s + 2 * kGroup + 2 * j, &sb.m16, 2);
  } else {
    std::memcpy(s + 4 * j, &sb.d[0], 4);
    std::memcpy(s + 4 * kGroup + 4 * j, f.nibbles ? &sb.m : &sb.d[1], 4);
  }
}

// GGUF bytes (n_out rows of n_in / raw_elems blocks) -> groups as the header describes.
at::Tensor quant_pack(const at::Tensor& raw, int64_t type, int64_t n_out, int64_t n_in) {
  const QuantType qt = type_of("quant_pack", type);
  const Format& f = *qt.layout;
  TORCH_CHECK(n_out > 0 && n_in > 0 && n_in % qt.raw_elems == 0, "quant_pack: n_in must be a ",
              "positive multiple of ", qt.raw_elems, " for type ", type, ", got ", n_in);
  const int64_t raw_blocks = n_in / qt.raw_elems, row_bytes = raw_blocks * qt.raw_bytes;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() &&
                  raw.numel() == n_out * row_bytes,
              "quant_pack: raw must be the contiguous uint8 GGUF bytes of ", n_out, " x ", n_in,
              " weights (", n_out * row_bytes, " bytes), got ", raw.numel(), " of ",
              raw.scalar_type());
  const int64_t subs = qt.raw_elems / kBlock, per_group = group_bytes(f, n_in);
  at::Tensor packed = at::zeros({num_groups(n_out) * per_group}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, num_groups(n_out), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t j = 0; j < kGroup && g * kGroup + j < n_out; ++j) {
        const uint8_t* row = src + (g * kGroup + j) * row_bytes;
        for (int64_t rb = 0; rb < raw_blocks; ++rb)
          for (int s = 0; s < subs; ++s)
            write_block(f, decode(type, row + rb * qt.raw_bytes, s), dst + g * per_group,
                        rb * subs + s, j);
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

// Block b's scales as fp32 lanes: d (Q6_K: of half h), or with h = 1 a nibble layout's m.
template <const Format& F>
inline __m512 block_scale(const uint8_t* group, int64_t b, int h = 0) {
  const uint8_t* s = group + F.scale_offset(b);
  if constexpr (F.fp32_scales) {
    return _mm512_load_ps(reinterpret_cast<const float*>(s) + kGroup * h);
  } else {
    return load_fp16(reinterpret_cast<const uint16_t*>(s) + kGroup * h);
  }
}

// What the rows of x become before the kernels read them. (a): fp32 x, and for Q4_1 each block's
// sum(x). (b): int8 xq, each block's dx, and sum(xq) (Q8_0's correction; Q6_K's: of each half)
// or dx sum(xq) (Q4_1's).
struct Activations {
  const float* xf = nullptr;
  const at::BFloat16* xb = nullptr;  // (a), bf16 x: x as given
  const int8_t* xq = nullptr;
  const float* dx = nullptr;
  const float* block_sum = nullptr;  // (a) sum(x), (b) Q4_1: dx sum(xq)
  const int32_t* q_sum = nullptr;    // (b) sum(xq)
  const int32_t* half_sum = nullptr;  // (b) Q6_K: sum(xq) of elements 0-15, 16-31 (2 a block)
  int64_t k = 0, blocks = 0;
};

inline __m512 block_x(const float* xf, const at::BFloat16* xb, int64_t i) {
  return xf ? _mm512_loadu_ps(xf + i) : load_bf16(xb + i);
}

// Row r's 32-blocks to int8 (round to nearest even), their dx, sum(xq) and dx sum(xq) (and
// where half_sum is given, each half's sum(xq)).
template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t blocks, int8_t* xq, float* dx, int32_t* q_sum,
                  float* block_sum, int32_t* half_sum) {
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
    if (half_sum) {
      half_sum[2 * b] = _mm512_reduce_add_epi32(qlo);
      half_sum[2 * b + 1] = s - half_sum[2 * b];
    }
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

// (b), int8 layouts (Q8_0, Q5_0; Q6_K a half-block at a time, runs 0-3 then 4-7, each with its
// own scale and + 128 correction): rows [0, MB) of the activations against one group; acc gets
// 16 outputs a row.
template <int MB, const Format& F>
inline void group_q8_0_int8(const uint8_t* group, const Activations& a, __m512* acc) {
  constexpr int C = MB <= 2 ? 2 : 1;  // int chains a row: vpdpbusd's latency hides behind 2
  constexpr int H = F.halves, T = 8 / H;  // scales a block, runs a scale
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = group + F.quant_offset(b);
    prefetch_block<F>(group, b);
    for (int h = 0; h < H; ++h) {
      __m512i ia[MB][C];
      zero_chains<MB, C>(ia);
      for (int m = 0; m < MB; ++m) {  // the weights' + 128 adds 128 sum(xq): start below it
        const int64_t mb = m * a.blocks + b;
        ia[m][0] = _mm512_set1_epi32(-128 * (H == 1 ? a.q_sum[mb] : a.half_sum[2 * mb + h]));
      }
      for (int t = h * T; t < (h + 1) * T; ++t) {
        const __m512i w = _mm512_load_si512(qb + 64 * t);
        for (int m = 0; m < MB; ++m) {
          const __m512i xv = _mm512_set1_epi32(x_quad(a.xq + m * a.k + b * kBlock + 4 * t));
          ia[m][t % C] = _mm512_dpbusd_epi32(ia[m][t % C], w, xv);
        }
      }
      const __m512 d = block_scale<F>(group, b, h);
      for (int m = 0; m < MB; ++m) {
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.dx[m * a.blocks + b]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chain_sum<C>(ia[m])), scale, acc[m]);
      }
    }
  }
}

// (b), Q4_1: as above; a run's low nibbles meet x[4t..], its high ones x[16 + 4t..].
template <int MB, const Format& F>
inline void group_q4_1_int8(const uint8_t* group, const Activations& a, __m512* acc) {
  constexpr int C = MB <= 2 ? 2 : 1;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = group + F.quant_offset(b);
    prefetch_block<F>(group, b);
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
    const __m512 d = block_scale<F>(group, b);
    const __m512 mv = block_scale<F>(group, b, 1);
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

// (a), fp32 x with an int8 layout (a Q6_K block in halves, as group_q8_0_int8).
template <int MB, const Format& F>
inline void group_q8_0_fp32(const uint8_t* group, const Activations& a, __m512* acc) {
  constexpr int C = MB <= 2 ? 4 : MB <= 4 ? 2 : 1;
  constexpr int H = F.halves, T = 8 / H;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = group + F.quant_offset(b);
    prefetch_block<F>(group, b);
    for (int h = 0; h < H; ++h) {
      __m512 part[MB][C];
      zero_chains<MB, C>(part);
      for (int t = h * T; t < (h + 1) * T; ++t) {
        const __m512i w = _mm512_xor_si512(_mm512_load_si512(qb + 64 * t), flip);  // signed
        const int64_t i = b * kBlock + 4 * t;
        fma_rows<MB, C>(lane_byte<0>(w), a.xf, a.k, i, 0, part);
        fma_rows<MB, C>(lane_byte<1>(w), a.xf, a.k, i + 1, 1, part);
        fma_rows<MB, C>(lane_byte<2>(w), a.xf, a.k, i + 2, 2, part);
        fma_rows<MB, C>(lane_byte<3>(w), a.xf, a.k, i + 3, 3, part);
      }
      const __m512 d = block_scale<F>(group, b, h);
      for (int m = 0; m < MB; ++m) {
        acc[m] = _mm512_fmadd_ps(chain_sum<C>(part[m]), d, acc[m]);
      }
    }
  }
}

template <int MB, const Format& F>
inline void group_q4_1_fp32(const uint8_t* group, const Activations& a, __m512* acc) {
  constexpr int C = MB <= 2 ? 4 : MB <= 4 ? 2 : 1;
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = group + F.quant_offset(b);
    prefetch_block<F>(group, b);
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
    const __m512 d = block_scale<F>(group, b);
    const __m512 mv = block_scale<F>(group, b, 1);
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
// A run's int8 weights (signed) as bf16 pairs: elements (4t, 4t+1) and (4t+2, 4t+3) a lane.
inline void bf16_pairs(__m512i w, __m512bh& w01, __m512bh& w23) {
  const __m512i f0 = _mm512_castps_si512(lane_byte<0>(w));
  const __m512i f1 = _mm512_castps_si512(lane_byte<1>(w));
  const __m512i f2 = _mm512_castps_si512(lane_byte<2>(w));
  const __m512i f3 = _mm512_castps_si512(lane_byte<3>(w));
  constexpr __mmask32 kHigh = 0xAAAAAAAA;  // a lane's upper word: the pair's second element
  w01 = (__m512bh)_mm512_mask_blend_epi16(kHigh, _mm512_srli_epi32(f0, 16), f1);
  w23 = (__m512bh)_mm512_mask_blend_epi16(kHigh, _mm512_srli_epi32(f2, 16), f3);
}

template <int MB, const Format& F>
inline void group_q8_0_bf16(const uint8_t* group, const Activations& a, __m512* acc) {
  constexpr int C = MB <= 2 ? 2 : 1;
  constexpr int H = F.halves, T = 8 / H;  // a Q6_K block in halves, as group_q8_0_int8
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = group + F.quant_offset(b);
    prefetch_block<F>(group, b);
    for (int h = 0; h < H; ++h) {
      __m512 part[MB][C];
      zero_chains<MB, C>(part);
      for (int t = h * T; t < (h + 1) * T; ++t) {
        __m512bh w01, w23;
        bf16_pairs(_mm512_xor_si512(_mm512_load_si512(qb + 64 * t), flip), w01, w23);
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
      const __m512 d = block_scale<F>(group, b, h);
      for (int m = 0; m < MB; ++m) {
        acc[m] = _mm512_fmadd_ps(chain_sum<C>(part[m]), d, acc[m]);
      }
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
template <int MB, const Format& F>
inline void group_q4_1_bf16(const uint8_t* group, const Activations& a, __m512* acc) {
  constexpr int C = MB <= 2 ? 2 : 1;  // chains of each half a row
  const __m512i nibble = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x43);
  __m512 lo_acc[MB], hi_acc[MB];  // (output, element pair) lanes as above
  for (int m = 0; m < MB; ++m)
    acc[m] = lo_acc[m] = hi_acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* qb = group + F.quant_offset(b);
    prefetch_block<F>(group, b);
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
    const __m512 d = block_scale<F>(group, b);
    const __m512 mv = block_scale<F>(group, b, 1);
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
  if (a.half_sum) r.half_sum = a.half_sum + 2 * m0 * a.blocks;
  return r;
}

template <int MB, const Format& F>
inline void group_rows(const uint8_t* group, const Activations& a, bool int8, __m512* acc) {
  if constexpr (F.nibbles) {
    if (int8) {
      group_q4_1_int8<MB, F>(group, a, acc);
    } else if (a.xb) {
      if constexpr (MB > 4) {  // 4 rows' partial and running sums already take 28 registers
        group_q4_1_bf16<4, F>(group, a, acc);
        group_q4_1_bf16<MB - 4, F>(group, rows_from(a, 4), acc + 4);
      } else {
        group_q4_1_bf16<MB, F>(group, a, acc);
      }
    } else {
      group_q4_1_fp32<MB, F>(group, a, acc);
    }
  } else {
    if (int8)
      group_q8_0_int8<MB, F>(group, a, acc);
    else if (a.xb && MB >= 4)  // below 4 rows its conversions cost more than it saves
      group_q8_0_bf16<MB, F>(group, a, acc);
    else
      group_q8_0_fp32<MB, F>(group, a, acc);
  }
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

// Rows a pass over a group: kRowBlock, or kAlikeRows where every row must be summed as it would
// be alone (rows_alike): the group kernels of 1 and 2 rows do the same work per row (the same
// chains, the same path), those of more rows fewer chains or another path.
constexpr int64_t kAlikeRows = 2;

template <typename scalar_t, const Format& F>
void quant_gemm_kernel(const Activations& a, const uint8_t* packed, int64_t per_group, bool int8,
                       bool rows_alike, const scalar_t* bias, scalar_t* y, int64_t rows,
                       int64_t n_out) {
  const int64_t pass_rows = rows_alike ? kAlikeRows : kRowBlock;
  at::parallel_for(0, num_groups(n_out), 1, [&](int64_t begin, int64_t end) {
    __m512 acc[kRowBlock];
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = packed + g * per_group;
      const int64_t n0 = g * kGroup;
      for (int64_t m0 = 0; m0 < rows; m0 += pass_rows) {
        const Activations r = rows_from(a, m0);
        const int64_t pass = std::min<int64_t>(rows - m0, pass_rows);
        switch (pass) {
          case 1: group_rows<1, F>(group, r, int8, acc); break;
          case 2: group_rows<2, F>(group, r, int8, acc); break;
          case 3: group_rows<3, F>(group, r, int8, acc); break;
          case 4: group_rows<4, F>(group, r, int8, acc); break;
          case 5: group_rows<5, F>(group, r, int8, acc); break;
          case 6: group_rows<6, F>(group, r, int8, acc); break;
          case 7: group_rows<7, F>(group, r, int8, acc); break;
          default: group_rows<8, F>(group, r, int8, acc); break;
        }
        for (int64_t m = 0; m < pass; ++m)
          store_group(y + (m0 + m) * n_out + n0, bias ? bias + n0 : nullptr, acc[m], n_out - n0);
      }
    }
  });
}

// Prepares x (either path) into `scratch`-owned buffers and runs the kernel.
template <typename scalar_t, const Format& F>
void run_quant_gemm(const at::Tensor& x, const uint8_t* packed, int64_t per_group, bool int8,
                    bool rows_alike, const scalar_t* bias, scalar_t* y, int64_t n_out) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  const scalar_t* xs = x.data_ptr<scalar_t>();
  Activations a;
  a.k = k;
  a.blocks = blocks;
  std::vector<float> block_sum(rows * blocks), xf, dx;
  std::vector<int8_t> xq;
  std::vector<int32_t> q_sum, half_sum;
  if (int8) {
    xq.resize(rows * k), dx.resize(rows * blocks), q_sum.resize(rows * blocks);
    if (F.halves == 2) half_sum.resize(2 * rows * blocks);
    for (int64_t r = 0; r < rows; ++r)
      quantize_row(xs + r * k, blocks, xq.data() + r * k, dx.data() + r * blocks,
                   q_sum.data() + r * blocks, block_sum.data() + r * blocks,
                   half_sum.empty() ? nullptr : half_sum.data() + 2 * r * blocks);
    a.xq = xq.data(), a.dx = dx.data(), a.q_sum = q_sum.data();
    if (!half_sum.empty()) a.half_sum = half_sum.data();
  } else {
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) a.xb = xs;  // vdpbf16ps reads x as given
    const bool widened = !a.xb || !F.nibbles;  // int8 layouts' 1-3 rows take the fp32 path
    if (widened) xf.resize(rows * k);
    for (int64_t r = 0; r < rows; ++r)
      widen_row(xs + r * k, blocks, widened ? xf.data() + r * k : nullptr,
                block_sum.data() + r * blocks);
    if (widened) a.xf = xf.data();
  }
  a.block_sum = block_sum.data();
  quant_gemm_kernel<scalar_t, F>(a, packed, per_group, int8, rows_alike, bias, y, rows, n_out);
}

template <const Format& F>
void run_format(const at::Tensor& x, const uint8_t* packed, int64_t per_group, bool int8,
                bool rows_alike, const at::Tensor* bias, at::Tensor& y, int64_t n_out) {
  if (x.scalar_type() == at::kFloat) {
    run_quant_gemm<float, F>(x, packed, per_group, int8, rows_alike,
                             bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), n_out);
  } else {
    run_quant_gemm<at::BFloat16, F>(x, packed, per_group, int8, rows_alike,
                                    bias ? bias->data_ptr<at::BFloat16>() : nullptr,
                                    y.data_ptr<at::BFloat16>(), n_out);
  }
}

#endif  // __AVX512BF16__ && __AVX512VNNI__

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                      const c10::optional<at::Tensor>& bias, int64_t n_out, bool quantize_x,
                      bool rows_alike) {
  TORCH_CHECK(quant_gemm_supported(), "quant_gemm: this CPU build has no AVX-512 BF16 + VNNI");
  const QuantType qt = type_of("quant_gemm", type);
  const Format& f = *qt.layout;
  TORCH_CHECK(x.dim() == 2 && x.size(1) % qt.raw_elems == 0, "quant_gemm: x must be (rows, in) ",
              "with in a multiple of ", qt.raw_elems, " for type ", type, ", got ", x.sizes());
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
  if (&f == &kQ8_0Format)
    run_format<kQ8_0Format>(xc, p, per_group, quantize_x, rows_alike, b, y, n_out);
  else if (&f == &kQ4_1Format)
    run_format<kQ4_1Format>(xc, p, per_group, quantize_x, rows_alike, b, y, n_out);
  else if (&f == &kQ4_KFormat)
    run_format<kQ4_KFormat>(xc, p, per_group, quantize_x, rows_alike, b, y, n_out);
  else
    run_format<kQ6_KFormat>(xc, p, per_group, quantize_x, rows_alike, b, y, n_out);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flowlang, m) {
  m.def("quant_gemm_supported() -> bool", &quant_gemm_supported);
  m.def("quant_pack(Tensor raw, int type, int n_out, int n_in) -> Tensor");
  m.def("quant_gemm(Tensor x, Tensor packed, int type, Tensor? bias, int n_out, "
        "bool quantize_x=False, bool rows_alike=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(flowlang, CPU, m) {
  m.impl("quant_pack", &quant_pack);
  m.impl("quant_gemm", &quant_gemm);
}
