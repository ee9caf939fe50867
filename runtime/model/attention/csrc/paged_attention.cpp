// Paged attention on CPU for decodes and short extends: K/V read in place from the
// slot-indexed pool (no gather copy). Parallel over sequences; fp32 accumulation. Also
// returns each (row, head)'s log-sum-exp of scaled scores, so that a caller can merge this
// result with attention over other keys (a shared prefix attended once for many sequences).
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
void attention_kernel(
    const scalar_t* q,          // (T, H, D): the new tokens' queries, sequence after sequence
    const scalar_t* k_pool,     // (S, KVH, D)
    const scalar_t* v_pool,     // (S, KVH, D)
    const int64_t* slots,       // concatenated slot lists (cached prefix + new tokens)
    const int64_t* kv_indptr,   // (B + 1,) offsets into slots
    const int64_t* qo_indptr,   // (B + 1,) offsets into q rows
    scalar_t* out,              // (T, H, D)
    float* lse,                 // (T, H): log-sum-exp of the scaled scores
    int64_t B, int64_t H, int64_t KVH, int64_t D, float scale, int64_t window, float softcap) {
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;  // one slot's K (or V) for all kv heads: contiguous
  // One task per sequence: each K/V row is read once, whole, for every head and query row.
  // Query row r of a sequence with L keys and n queries sits at position L - n + r and
  // attends to keys [max(0, pos - window + 1), pos].
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores, rowf(row);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = qo_indptr[b + 1] - qo_indptr[b];
      const int64_t L = kv_indptr[b + 1] - kv_indptr[b];
      const int64_t* seq = slots + kv_indptr[b];
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

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> paged_attention(const torch::Tensor& q, const torch::Tensor& k_pool,
                              const torch::Tensor& v_pool, const torch::Tensor& slots,
                              const torch::Tensor& kv_indptr, const torch::Tensor& qo_indptr,
                              double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3, "q (T,H,D) and pools (S,KVH,D) expected");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "contiguous tensors expected");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && kv_indptr.scalar_type() == torch::kLong &&
                  qo_indptr.scalar_type() == torch::kLong,
              "int64 slots and indptrs expected");
  const int64_t B = kv_indptr.numel() - 1, H = q.size(1), D = q.size(2), KVH = k_pool.size(1);
  TORCH_CHECK(H % KVH == 0 && k_pool.size(2) == D, "head shapes disagree");
  TORCH_CHECK(qo_indptr.numel() == B + 1, "qo_indptr and kv_indptr disagree");
  auto out = torch::empty_like(q);
  auto lse = torch::empty({q.size(0), H}, q.options().dtype(torch::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention",
                                  [&] {
    attention_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_pool.data_ptr<scalar_t>(),
                               v_pool.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(),
                               kv_indptr.data_ptr<int64_t>(), qo_indptr.data_ptr<int64_t>(),
                               out.data_ptr<scalar_t>(), lse.data_ptr<float>(), B, H, KVH, D,
                               static_cast<float>(scale), window,
                               static_cast<float>(softcap));
  });
  return {out, lse};
}

// A registered op (torch.ops.flowlang.paged_attention): visible to the profiler, no pybind.
TORCH_LIBRARY(flowlang, m) {
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, "
        "Tensor kv_indptr, Tensor qo_indptr, float scale, int window, float softcap) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flowlang, CPU, m) { m.impl("paged_attention", &paged_attention); }
