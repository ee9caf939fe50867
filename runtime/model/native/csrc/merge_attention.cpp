// Attention over keys A and B from attention over each (cascade attention's two halves): per
// (row, head), out = (out_a · e^(lse_a - m) + out_b · e^(lse_b - m)) / (e^(lse_a - m) +
// e^(lse_b - m)), m the larger lse, in fp32, rounded once to the model dtype. One pass
// instead of torch's six elementwise ops over the batch.
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#if defined(__AVX512BF16__)
#include "avx512_math.h"
#endif

namespace {

template <typename scalar_t>
void merge_rows(const scalar_t* out_a, const float* lse_a, const scalar_t* out_b,
                const float* lse_b, scalar_t* out, int64_t rows, int64_t D) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float top = std::max(lse_a[r], lse_b[r]);
      const float wa = std::exp(lse_a[r] - top), wb = std::exp(lse_b[r] - top);
      const float inv = 1.f / (wa + wb);
      const scalar_t* a = out_a + r * D;
      const scalar_t* b = out_b + r * D;
      scalar_t* o = out + r * D;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        using namespace flowlang_avx512;
        const __m512 va = _mm512_set1_ps(wa * inv), vb = _mm512_set1_ps(wb * inv);
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 m = tail_mask(D - d);
          store_bf16(o + d, _mm512_fmadd_ps(load_bf16(a + d, m), va,
                                            _mm512_mul_ps(load_bf16(b + d, m), vb)), m);
        }
        continue;
      }
#endif
      for (int64_t d = 0; d < D; ++d)
        o[d] = static_cast<scalar_t>(static_cast<float>(a[d]) * (wa * inv) +
                                     static_cast<float>(b[d]) * (wb * inv));
    }
  });
}

at::Tensor merge_attention(const at::Tensor& out_a, const at::Tensor& lse_a,
                              const at::Tensor& out_b, const at::Tensor& lse_b) {
  TORCH_CHECK(out_a.dim() == 3 && out_a.sizes() == out_b.sizes(), "out_a/out_b (n, H, D) must match");
  TORCH_CHECK(out_a.is_contiguous() && out_b.is_contiguous() && lse_a.is_contiguous() &&
                  lse_b.is_contiguous(),
              "contiguous tensors expected");
  TORCH_CHECK(out_a.scalar_type() == out_b.scalar_type(), "out_a and out_b dtypes differ");
  TORCH_CHECK(lse_a.scalar_type() == at::kFloat && lse_b.scalar_type() == at::kFloat,
              "fp32 lse expected");
  TORCH_CHECK(lse_a.numel() == out_a.size(0) * out_a.size(1) && lse_b.numel() == lse_a.numel(),
              "lse must be (n, H)");
  auto out = at::empty_like(out_a);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_a.scalar_type(),
                                  "merge_attention", [&] {
    merge_rows<scalar_t>(out_a.data_ptr<scalar_t>(), lse_a.data_ptr<float>(),
                         out_b.data_ptr<scalar_t>(), lse_b.data_ptr<float>(),
                         out.data_ptr<scalar_t>(), out_a.size(0) * out_a.size(1), out_a.size(2));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flowlang, m) {
  m.def("merge_attention(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> Tensor");
}

TORCH_LIBRARY_IMPL(flowlang, CPU, m) { m.impl("merge_attention", &merge_attention); }
