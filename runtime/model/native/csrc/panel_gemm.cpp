// y = x @ w.T (+ bias) for forwards of up to a few dozen tokens (decode batches), from weights
// packed once into panels of 48 output features: a panel is (K, 48) in fp32 and (K/2, 48, 2) in
// bf16 (pairs along K, as vdpbf16ps takes them), so each panel streams from memory as one
// sequential run. A block of up to 8 rows of x keeps 8 x 48 outputs in 24 registers; each step
// over K loads 3 weight vectors and broadcasts one x value (one bf16 pair) a row: weights are
// read once per call, and re-read from L1/L2 for further 8-row blocks. At these shapes oneDNN's
// blocked path streams the weights slower (1.1-1.4x the time at 5-64 rows in fp32, 5-32 in
// bf16); above them its GEMM wins, and Linear sends the forward there.
// fp32 sums each output in K order on FMAs; bf16 sums pairs of bf16 products in fp32 and rounds
// once at the end, as oneDNN does.
#include "ops.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include "avx512_math.h"
#endif

namespace {

constexpr int64_t kPanel = 48;  // output features a panel: 3 zmm of fp32

int64_t num_panels(int64_t n_out) { return (n_out + kPanel - 1) / kPanel; }

#if defined(__AVX512BF16__)

using namespace flowlang_avx512;

constexpr int64_t kRowBlock = 8;  // rows of x a pass over a panel: 8 x 3 accumulators

// Up to 48 fp32 results of one row: bias added, rounded to the output dtype, the tail masked.
template <typename scalar_t>
inline void store_outputs(scalar_t* y, const scalar_t* bias, const __m512* acc, int64_t left) {
  for (int c = 0; c < 3 && left > 16 * c; ++c) {
    const __mmask16 mask = tail_mask(left - 16 * c);
    __m512 v = acc[c];
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + 16 * c));
      _mm512_mask_storeu_ps(y + 16 * c, mask, v);
    } else {
      if (bias) v = _mm512_add_ps(v, load_bf16(bias + 16 * c, mask));
      store_bf16(y + 16 * c, v, mask);
    }
  }
}

// Rows [0, MB) of x (row stride k) against one fp32 panel (k, 48); outputs from n0 on.
template <int MB>
inline void panel_fp32(const float* x, const float* panel, const float* bias, float* y,
                       int64_t k, int64_t n_out, int64_t n0) {
  __m512 acc[MB][3];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < 3; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const float* w = panel + i * kPanel;
    for (int c = 0; c < 3; ++c)  // 16 steps (3 KB) ahead of use
      _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kPanel + 16 * c), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16),
                 w2 = _mm512_loadu_ps(w + 32);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * k + i]);
      acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xv, w2, acc[m][2]);
    }
  }
  for (int m = 0; m < MB; ++m)
    store_outputs(y + m * n_out + n0, bias ? bias + n0 : nullptr, acc[m], n_out - n0);
}

// The same for a bf16 panel (ceil(k/2), 48, 2): x's pairs broadcast as 32-bit lanes; an odd
// k's last pair holds x's last value and a zero (the panel's padding is zero too).
template <int MB>
inline void panel_bf16(const at::BFloat16* x, const at::BFloat16* panel,
                       const at::BFloat16* bias, at::BFloat16* y, int64_t k, int64_t n_out,
                       int64_t n0) {
  __m512 acc[MB][3];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < 3; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t pairs = (k + 1) / 2;
  for (int64_t i = 0; i < pairs; ++i) {
    const at::BFloat16* w = panel + i * 2 * kPanel;
    for (int c = 0; c < 3; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(w + 32 * kPanel + 32 * c), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w),
                   w1 = (__m512bh)_mm512_loadu_si512(w + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const bool whole = 2 * i + 1 < k;
    for (int m = 0; m < MB; ++m) {
      const uint16_t* xm = reinterpret_cast<const uint16_t*>(x + m * k) + 2 * i;
      uint32_t pair = xm[0];
      if (whole) std::memcpy(&pair, xm, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], xv, w2);
    }
  }
  for (int m = 0; m < MB; ++m)
    store_outputs(y + m * n_out + n0, bias ? bias + n0 : nullptr, acc[m], n_out - n0);
}

template <int MB, typename scalar_t>
inline void panel_rows(const scalar_t* x, const scalar_t* panel, const scalar_t* bias,
                       scalar_t* y, int64_t k, int64_t n_out, int64_t n0) {
  if constexpr (std::is_same_v<scalar_t, float>)
    panel_fp32<MB>(x, panel, bias, y, k, n_out, n0);
  else
    panel_bf16<MB>(x, panel, bias, y, k, n_out, n0);
}

template <typename scalar_t>
void panel_gemm_kernel(const scalar_t* x, const scalar_t* panels, const scalar_t* bias,
                       scalar_t* y, int64_t rows, int64_t k, int64_t n_out) {
  const int64_t panel_size = std::is_same_v<scalar_t, float> ? k * kPanel : (k + 1) / 2 * 2 * kPanel;
  at::parallel_for(0, num_panels(n_out), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const scalar_t* panel = panels + p * panel_size;
      const int64_t n0 = p * kPanel;
      int64_t m = 0;
      for (; m + kRowBlock <= rows; m += kRowBlock)
        panel_rows<kRowBlock>(x + m * k, panel, bias, y + m * n_out, k, n_out, n0);
      const scalar_t* xr = x + m * k;
      scalar_t* yr = y + m * n_out;
      switch (rows - m) {
        case 1: panel_rows<1>(xr, panel, bias, yr, k, n_out, n0); break;
        case 2: panel_rows<2>(xr, panel, bias, yr, k, n_out, n0); break;
        case 3: panel_rows<3>(xr, panel, bias, yr, k, n_out, n0); break;
        case 4: panel_rows<4>(xr, panel, bias, yr, k, n_out, n0); break;
        case 5: panel_rows<5>(xr, panel, bias, yr, k, n_out, n0); break;
        case 6: panel_rows<6>(xr, panel, bias, yr, k, n_out, n0); break;
        case 7: panel_rows<7>(xr, panel, bias, yr, k, n_out, n0); break;
        default: break;
      }
    }
  });
}

#endif  // __AVX512BF16__

bool panel_gemm_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void check_dtype(const char* op, const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              op, ": ", what, " must be float32 or bfloat16, got ", t.scalar_type());
}

// w (out, in) -> its panels: fp32 (P, in, 48), bf16 (P, ceil(in/2), 48, 2), zero-padded.
at::Tensor panel_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) > 0 && w.size(1) > 0,
              "panel_pack: w must be a non-empty (out, in) matrix");
  check_dtype("panel_pack", w, "w");
  const int64_t n_out = w.size(0), k = w.size(1), P = num_panels(n_out);
  if (w.scalar_type() == at::kFloat) {
    at::Tensor padded = at::zeros({P * kPanel, k}, w.options());
    padded.narrow(0, 0, n_out).copy_(w);
    return padded.view({P, kPanel, k}).transpose(1, 2).contiguous();
  }
  const int64_t pairs = (k + 1) / 2;
  at::Tensor padded = at::zeros({P * kPanel, 2 * pairs}, w.options());
  padded.narrow(0, 0, n_out).narrow(1, 0, k).copy_(w);
  return padded.view({P, kPanel, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor panel_gemm(const at::Tensor& x, const at::Tensor& panels,
                      const c10::optional<at::Tensor>& bias, int64_t n_out) {
  TORCH_CHECK(panel_gemm_supported(), "panel_gemm: this CPU build has no AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2, "panel_gemm: x must be (rows, in), got ", x.dim(), " dims");
  check_dtype("panel_gemm", x, "x");
  TORCH_CHECK(panels.scalar_type() == x.scalar_type(), "panel_gemm: x and the panels must share a dtype");
  TORCH_CHECK(panels.is_contiguous(), "panel_gemm: the panels must be contiguous");
  const int64_t rows = x.size(0), k = x.size(1);
  const bool fp32 = x.scalar_type() == at::kFloat;
  const bool shaped = fp32 ? panels.dim() == 3 && panels.size(1) == k && panels.size(2) == kPanel
                           : panels.dim() == 4 && panels.size(1) == (k + 1) / 2 &&
                                 panels.size(2) == kPanel && panels.size(3) == 2;
  TORCH_CHECK(shaped && panels.size(0) == num_panels(n_out), "panel_gemm: panels of shape ",
              panels.sizes(), " are not panel_pack's for ", n_out, " outputs of ", k,
              " features");
  const at::Tensor* b = bias.has_value() ? &bias.value() : nullptr;
  if (b) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == n_out && b->scalar_type() == x.scalar_type() &&
                    b->is_contiguous(),
                "panel_gemm: bias must be a contiguous (out,) tensor of x's dtype");
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, n_out}, xc.options());
#if defined(__AVX512BF16__)
  if (fp32) {
    panel_gemm_kernel<float>(xc.data_ptr<float>(), panels.data_ptr<float>(),
                             b ? b->data_ptr<float>() : nullptr, y.data_ptr<float>(), rows, k,
                             n_out);
  } else {
    panel_gemm_kernel<at::BFloat16>(xc.data_ptr<at::BFloat16>(), panels.data_ptr<at::BFloat16>(),
                                    b ? b->data_ptr<at::BFloat16>() : nullptr,
                                    y.data_ptr<at::BFloat16>(), rows, k, n_out);
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flowlang, m) {
  m.def("panel_gemm_supported() -> bool", &panel_gemm_supported);
  m.def("panel_pack(Tensor w) -> Tensor");
  m.def("panel_gemm(Tensor x, Tensor panels, Tensor? bias, int n_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(flowlang, CPU, m) {
  m.impl("panel_pack", &panel_pack);
  m.impl("panel_gemm", &panel_gemm);
}
