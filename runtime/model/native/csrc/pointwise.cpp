// The decoder's per-token ops in one pass each, with transformers' numerics (every
// intermediate the reference rounds to the model dtype is rounded here too):
// - RMSNorm and residual add + RMSNorm (Llama-style): the row summed in fp32, the normalized
//   values rounded before the weight multiplies (that product rounded again);
// - SiLU(gate) * up: SiLU in fp32, rounded, then the product rounded;
// - RoPE, rotate-half layout: x*cos and rotate_half(x)*sin rounded, then their sum.
// In eager torch each is 3-8 elementwise ops over the whole batch, each a pass through memory
// and a fresh allocation.
#include "ops.h"

#include <cmath>
#include <cstdint>

#if defined(__AVX512BF16__)
#include "avx512_math.h"
#endif

namespace {

template <typename scalar_t>
void norm_rows(const scalar_t* x, const scalar_t* residual, scalar_t* new_residual,
               const scalar_t* weight, scalar_t* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * hidden;
      scalar_t* sum_row = new_residual ? new_residual + r * hidden : nullptr;
      float squares = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        float v = static_cast<float>(xr[i]);
        if (residual) {  // the residual stream is kept in the model dtype
          const scalar_t summed = static_cast<scalar_t>(v + static_cast<float>(residual[r * hidden + i]));
          sum_row[i] = summed;
          v = static_cast<float>(summed);
        }
        squares += v * v;
      }
      const float inv_rms = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      const scalar_t* src = residual ? sum_row : xr;
      scalar_t* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(src[i]) * inv_rms);
        o[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(normed));
      }
    }
  });
}

#if defined(__AVX512BF16__)

using namespace flowlang_avx512;

// bf16 rows 16 lanes at a time: c10's scalar conversions do not vectorize.
template <>
void norm_rows<at::BFloat16>(const at::BFloat16* x, const at::BFloat16* residual,
                             at::BFloat16* new_residual, const at::BFloat16* weight,
                             at::BFloat16* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* xr = x + r * hidden;
      at::BFloat16* sum_row = new_residual ? new_residual + r * hidden : nullptr;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = tail_mask(hidden - i);
        __m512 v = load_bf16(xr + i, m);
        if (residual) {
          v = round_bf16(_mm512_add_ps(v, load_bf16(residual + r * hidden + i, m)));
          store_bf16(sum_row + i, v, m);
        }
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const float total = _mm512_reduce_add_ps(squares);
      const __m512 inv_rms =
          _mm512_set1_ps(1.f / std::sqrt(total / static_cast<float>(hidden) + eps));
      const at::BFloat16* src = residual ? sum_row : xr;
      for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = tail_mask(hidden - i);
        const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(src + i, m), inv_rms));
        store_bf16(out + r * hidden + i, _mm512_mul_ps(load_bf16(weight + i, m), normed), m);
      }
    }
  });
}
#endif

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x (tokens, hidden) contiguous expected");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight (hidden,) expected");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x dtypes differ");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, nullptr, weight.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  auto out = at::empty_like(x);
  auto summed = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                        summed.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return {out, summed};
}

template <typename scalar_t>
inline scalar_t round_to(float x) { return static_cast<scalar_t>(x); }

template <typename scalar_t>
void silu_mul_rows(const scalar_t* gate_up, scalar_t* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gate_up + r * 2 * inter;
      const scalar_t* u = g + inter;
      scalar_t* o = out + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float x = static_cast<float>(g[i]);
        // sigmoid from e^-|x|: under -ffast-math e^-x overflowing to inf gives NaN
        const float e = std::exp(-std::fabs(x));
        const scalar_t act = round_to<scalar_t>(x * (x >= 0.f ? 1.f : e) / (1.f + e));
        o[i] = round_to<scalar_t>(static_cast<float>(act) * static_cast<float>(u[i]));
      }
    }
  });
}

// x (tokens, heads, head_dim) with row stride `stride` -> out contiguous; cos/sin (tokens,
// rotary_dim); features past rotary_dim pass through.
template <typename scalar_t>
void rope_rows(const scalar_t* x, int64_t stride, const scalar_t* cos, const scalar_t* sin,
               scalar_t* out, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rotary) {
  const int64_t half = rotary / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* c = cos + t * rotary;
      const scalar_t* s = sin + t * rotary;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* xh = x + t * stride + h * head_dim;
        scalar_t* oh = out + (t * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(xh[i]), x2 = static_cast<float>(xh[i + half]);
          const float a = static_cast<float>(round_to<scalar_t>(x1 * static_cast<float>(c[i])));
          const float b = static_cast<float>(round_to<scalar_t>(-x2 * static_cast<float>(s[i])));
          oh[i] = round_to<scalar_t>(a + b);
          const float a2 =
              static_cast<float>(round_to<scalar_t>(x2 * static_cast<float>(c[i + half])));
          const float b2 =
              static_cast<float>(round_to<scalar_t>(x1 * static_cast<float>(s[i + half])));
          oh[i + half] = round_to<scalar_t>(a2 + b2);
        }
        for (int64_t i = rotary; i < head_dim; ++i) oh[i] = xh[i];
      }
    }
  });
}

#if defined(__AVX512BF16__)
template <>
void silu_mul_rows<at::BFloat16>(const at::BFloat16* gate_up, at::BFloat16* out, int64_t rows,
                                 int64_t inter) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* g = gate_up + r * 2 * inter;
      for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 m = tail_mask(inter - i);
        const __m512 act = round_bf16(silu(load_bf16(g + i, m)));
        store_bf16(out + r * inter + i, _mm512_mul_ps(act, load_bf16(g + inter + i, m)), m);
      }
    }
  });
}

template <>
void silu_mul_rows<float>(const float* gate_up, float* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up + r * 2 * inter;
      for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 m = tail_mask(inter - i);
        const __m512 act = silu(_mm512_maskz_loadu_ps(m, g + i));
        _mm512_mask_storeu_ps(out + r * inter + i, m,
                              _mm512_mul_ps(act, _mm512_maskz_loadu_ps(m, g + inter + i)));
      }
    }
  });
}

template <>
void rope_rows<at::BFloat16>(const at::BFloat16* x, int64_t stride, const at::BFloat16* cos,
                             const at::BFloat16* sin, at::BFloat16* out, int64_t tokens,
                             int64_t heads, int64_t head_dim, int64_t rotary) {
  const int64_t half = rotary / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const at::BFloat16* c = cos + t * rotary;
      const at::BFloat16* s = sin + t * rotary;
      for (int64_t h = 0; h < heads; ++h) {
        const at::BFloat16* xh = x + t * stride + h * head_dim;
        at::BFloat16* oh = out + (t * heads + h) * head_dim;
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = tail_mask(half - i);
          const __m512 x1 = load_bf16(xh + i, m), x2 = load_bf16(xh + half + i, m);
          const __m512 a = round_bf16(_mm512_mul_ps(x1, load_bf16(c + i, m)));
          const __m512 b = round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2),
                                                    load_bf16(s + i, m)));
          store_bf16(oh + i, _mm512_add_ps(a, b), m);
          const __m512 a2 = round_bf16(_mm512_mul_ps(x2, load_bf16(c + half + i, m)));
          const __m512 b2 = round_bf16(_mm512_mul_ps(x1, load_bf16(s + half + i, m)));
          store_bf16(oh + half + i, _mm512_add_ps(a2, b2), m);
        }
        for (int64_t i = rotary; i < head_dim; ++i) oh[i] = xh[i];
      }
    }
  });
}
#endif

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up (tokens, 2 * intermediate) contiguous expected");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul",
                                  [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            gate_up.size(0), inter);
  });
  return out;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x (tokens, heads, head_dim) with contiguous heads expected");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos/sin (tokens, rotary_dim) expected");
  TORCH_CHECK(cos.size(1) % 2 == 0 && cos.size(1) <= x.size(2), "rotary_dim must be even and <= head_dim");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos/sin dtype must match x");
  auto out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), cos.data_ptr<scalar_t>(),
                        sin.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                        x.size(1), x.size(2), cos.size(1));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flowlang, m) {
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flowlang, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope", &rope);
}
