// Paged decode attention on CPU: one query token per sequence, K/V read in place from the
// slot-indexed pool (no gather copy). Parallel over (sequence, kv head); fp32 accumulation.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename scalar_t>
inline float to_float(scalar_t x) { return static_cast<float>(x); }

// Slots are scattered after eviction churn: fetch rows a few steps ahead of use.
constexpr int64_t kPrefetch = 6;

template <typename scalar_t>
inline void prefetch_row(const scalar_t* ptr, int64_t n) {
  const char* p = reinterpret_cast<const char*>(ptr);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(scalar_t)); off += 64)
    __builtin_prefetch(p + off, 0, 1);
}

template <typename scalar_t>
void decode_kernel(
    const scalar_t* q,        // (B, H, D)
    const scalar_t* k_pool,   // (S, KVH, D)
    const scalar_t* v_pool,   // (S, KVH, D)
    const int64_t* slots,     // concatenated slot lists
    const int64_t* indptr,    // (B + 1,) offsets into slots
    scalar_t* out,            // (B, H, D)
    int64_t B, int64_t H, int64_t KVH, int64_t D, float scale, int64_t window) {
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;  // one slot's K (or V) for all kv heads: contiguous
  // One task per sequence: each K/V row is read once, whole, for every head.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), scores, rowf(row);
    for (int64_t b = begin; b < end; ++b) {
      int64_t first = indptr[b];
      const int64_t last = indptr[b + 1];
      if (window > 0) first = std::max(first, last - window);
      const int64_t len = last - first;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(q[b * H * D + i]) * scale;
      scores.resize(H * len);
      // pass 1: scores (H, len); head h uses kv head h / G
      for (int64_t j = 0; j < len; ++j) {
        if (j + kPrefetch < len) prefetch_row(k_pool + slots[first + j + kPrefetch] * row, row);
        const scalar_t* kr = k_pool + slots[first + j] * row;
        for (int64_t i = 0; i < row; ++i) rowf[i] = to_float(kr[i]);
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = qf.data() + h * D;
          const float* kh = rowf.data() + (h / G) * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[h * len + j] = s;
        }
      }
      // softmax per head
      for (int64_t h = 0; h < H; ++h) {
        float* sh = scores.data() + h * len;
        float m = -INFINITY;
        for (int64_t j = 0; j < len; ++j) m = std::max(m, sh[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < len; ++j) {
          sh[j] = std::exp(sh[j] - m);
          sum += sh[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < len; ++j) sh[j] *= inv;
      }
      // pass 2: weighted sum of V rows
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < len; ++j) {
        if (j + kPrefetch < len) prefetch_row(v_pool + slots[first + j + kPrefetch] * row, row);
        const scalar_t* vr = v_pool + slots[first + j] * row;
        for (int64_t i = 0; i < row; ++i) rowf[i] = to_float(vr[i]);
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * len + j];
          const float* vh = rowf.data() + (h / G) * D;
          float* ah = acc.data() + h * D;
          for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
        }
      }
      for (int64_t i = 0; i < H * D; ++i) out[b * H * D + i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

}  // namespace

torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_pool,
                           const torch::Tensor& v_pool, const torch::Tensor& slots,
                           const torch::Tensor& indptr, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3, "q (B,H,D) and pools (S,KVH,D) expected");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "contiguous tensors expected");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && indptr.scalar_type() == torch::kLong,
              "int64 slots and indptr expected");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pool.size(1);
  TORCH_CHECK(H % KVH == 0 && k_pool.size(2) == D, "head shapes disagree");
  TORCH_CHECK(indptr.numel() == B + 1, "indptr needs B + 1 entries");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(),
                            v_pool.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(),
                            indptr.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, KVH, D,
                            static_cast<float>(scale), window);
  });
  return out;
}

// A registered op (torch.ops.flowlang.paged_decode): visible to the profiler, no pybind.
TORCH_LIBRARY(flowlang, m) {
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor indptr, "
        "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(flowlang, CPU, m) { m.impl("paged_decode", &paged_decode); }
