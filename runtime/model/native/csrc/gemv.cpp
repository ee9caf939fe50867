// y = x @ w.T (+ bias) for a forward of a few tokens (x: rows <= 4, w: (out, in) row-major).
// Such a step reads every weight once and does 2 flops per weight element per row: it is bound
// by how fast the weights stream from memory. oneDNN's blocked path streams them at ~21 GB/s
// on this CPU's two cores, which read ~31 GB/s: here each thread streams its own contiguous span
// of weight rows, with x in L1.
// fp32 on FMAs; bf16 on vdpbf16ps (pairs of bf16 products summed in fp32), rounded to bf16 once
// at the end, as oneDNN does. Summation order differs from oneDNN's (~1e-6 relative in fp32).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__AVX512BF16__)
#include "avx512_math.h"
#endif

namespace {

constexpr int64_t kMaxRows = 4;  // rows of x; more are a GEMM (oneDNN)

#if defined(__AVX512BF16__)

using namespace flowlang_avx512;

// Each thread reads its span of weight rows as one sequential stream (row after row), so the
// hardware prefetcher sees one long stream; interleaving a few rows at a time restarts it at
// every row (2-3 KB) and ran at half the bandwidth. kAcc partial sums a row break the FMA
// latency chain.
constexpr int kAcc = 4;

template <int M>
void gemv_fp32(const float* x, const float* w, const float* bias, float* y, int64_t n_out,
               int64_t k) {
  at::parallel_for(0, n_out, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = w + n * k;
      __m512 acc[M][kAcc];
      for (int m = 0; m < M; ++m)
        for (int a = 0; a < kAcc; ++a) acc[m][a] = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 * kAcc <= k; i += 16 * kAcc) {
        for (int a = 0; a < kAcc; ++a) {
          const __m512 wv = _mm512_loadu_ps(row + i + 16 * a);
          for (int m = 0; m < M; ++m)
            acc[m][a] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k + i + 16 * a), wv, acc[m][a]);
        }
      }
      for (; i < k; i += 16) {
        const __mmask16 mask = tail_mask(k - i);
        const __m512 wv = _mm512_maskz_loadu_ps(mask, row + i);
        for (int m = 0; m < M; ++m)
          acc[m][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + m * k + i), wv, acc[m][0]);
      }
      for (int m = 0; m < M; ++m) {
        __m512 sum = acc[m][0];
        for (int a = 1; a < kAcc; ++a) sum = _mm512_add_ps(sum, acc[m][a]);
        y[m * n_out + n] = _mm512_reduce_add_ps(sum) + (bias ? bias[n] : 0.f);
      }
    }
  });
}

template <int M>
void gemv_bf16(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias,
               at::BFloat16* y, int64_t n_out, int64_t k) {
  at::parallel_for(0, n_out, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const at::BFloat16* row = w + n * k;
      __m512 acc[M][kAcc];
      for (int m = 0; m < M; ++m)
        for (int a = 0; a < kAcc; ++a) acc[m][a] = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 32 * kAcc <= k; i += 32 * kAcc) {  // 32 bf16 = 16 pairs a register
        for (int a = 0; a < kAcc; ++a) {
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + i + 32 * a);
          for (int m = 0; m < M; ++m)
            acc[m][a] = _mm512_dpbf16_ps(
                acc[m][a], (__m512bh)_mm512_loadu_si512(x + m * k + i + 32 * a), wv);
        }
      }
      for (; i < k; i += 32) {
        const int64_t left = k - i;
        const __mmask32 mask = left >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << left) - 1);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, row + i);
        for (int m = 0; m < M; ++m)
          acc[m][0] = _mm512_dpbf16_ps(
              acc[m][0], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * k + i), wv);
      }
      for (int m = 0; m < M; ++m) {
        __m512 sum = acc[m][0];
        for (int a = 1; a < kAcc; ++a) sum = _mm512_add_ps(sum, acc[m][a]);
        float total = _mm512_reduce_add_ps(sum);
        if (bias) total += static_cast<float>(bias[n]);
        y[m * n_out + n] = static_cast<at::BFloat16>(total);
      }
    }
  });
}

#endif  // __AVX512BF16__

bool native_gemv_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

int64_t gemv_max_rows() { return kMaxRows; }

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(native_gemv_supported(), "gemv: this CPU build has no AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "gemv: x (rows, in) and w (out, in) must be 2-D");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "gemv: x must have 1 to ", kMaxRows,
              " rows, got ", x.size(0));
  TORCH_CHECK(x.size(1) == w.size(1), "gemv: x has ", x.size(1), " features, w takes ",
              w.size(1));
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "gemv: x and w must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gemv: float32 or bfloat16 only, got ", x.scalar_type());
  TORCH_CHECK(w.is_contiguous(), "gemv: w must be contiguous");
  const at::Tensor xc = x.contiguous();
  const at::Tensor* b = bias.has_value() ? &bias.value() : nullptr;
  if (b) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == w.size(0) && b->scalar_type() == w.scalar_type()
                    && b->is_contiguous(),
                "gemv: bias must be a contiguous (out,) tensor of w's dtype");
  }
  const int64_t rows = xc.size(0), n_out = w.size(0), k = w.size(1);
  at::Tensor y = at::empty({rows, n_out}, xc.options());
#if defined(__AVX512BF16__)
  if (xc.scalar_type() == at::kFloat) {
    const float* xp = xc.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    const float* bp = b ? b->data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    switch (rows) {
      case 1: gemv_fp32<1>(xp, wp, bp, yp, n_out, k); break;
      case 2: gemv_fp32<2>(xp, wp, bp, yp, n_out, k); break;
      case 3: gemv_fp32<3>(xp, wp, bp, yp, n_out, k); break;
      default: gemv_fp32<4>(xp, wp, bp, yp, n_out, k); break;
    }
  } else {
    const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
    const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = b ? b->data_ptr<at::BFloat16>() : nullptr;
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    switch (rows) {
      case 1: gemv_bf16<1>(xp, wp, bp, yp, n_out, k); break;
      case 2: gemv_bf16<2>(xp, wp, bp, yp, n_out, k); break;
      case 3: gemv_bf16<3>(xp, wp, bp, yp, n_out, k); break;
      default: gemv_bf16<4>(xp, wp, bp, yp, n_out, k); break;
    }
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flowlang, m) {
  m.def("native_gemv_supported() -> bool", &native_gemv_supported);
  m.def("gemv_max_rows() -> int", &gemv_max_rows);
  m.def("gemv(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(flowlang, CPU, m) { m.impl("gemv", &gemv); }
