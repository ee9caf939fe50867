// A decode step's decoder layers in one op (torch.ops.flowlang.decode_layers), for Llama-style
// models whose projections all take the block or panel GEMM (runtime/model/fused_decode.py).
//
// Why: at batch 1 a token of SmolLM2-135M's 30 layers makes ~360 op calls from Python, each
// ~2.5 us through torch.ops plus the Python between them: py-spy put ~40% of a 160 tok/s step
// outside the kernels. Here each layer calls the very same kernels, in the same order, through
// the dispatcher's unboxed path (well under a microsecond each), so the outputs are the Python
// path's bit for bit and no kernel is written twice.
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/index_copy.h>

namespace {

using OptTensor = c10::optional<at::Tensor>;
using Pair = std::tuple<at::Tensor, at::Tensor>;

using T = const at::Tensor&;

// A registered op's unboxed handle, found by name (the handle type is final: held, not derived).
template <typename Signature>
struct Op {
  c10::TypedOperatorHandle<Signature> handle;
  explicit Op(const char* name)
      : handle(c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>()) {}
  template <typename... Args>
  decltype(auto) call(Args&&... args) const {
    return handle.call(std::forward<Args>(args)...);
  }
};

// The kernels, looked up once (the first call: every file's ops are registered by then).
struct Kernels {
  Op<at::Tensor(T, T, int64_t, const OptTensor&, int64_t, bool, bool)> quant_gemm{
      "flowlang::quant_gemm"};
  Op<at::Tensor(T, T, const OptTensor&, int64_t)> panel_gemm{"flowlang::panel_gemm"};
  Op<at::Tensor(T, T, double)> rms_norm{"flowlang::rms_norm"};
  Op<Pair(T, T, T, double)> add_rms_norm{"flowlang::add_rms_norm"};
  Op<at::Tensor(T, T, T)> rope{"flowlang::rope"};
  Op<at::Tensor(T)> silu_and_mul{"flowlang::silu_and_mul"};
  Op<Pair(T, T, T, T, T, T, double, int64_t, double, int64_t)> paged_attention{
      "flowlang::paged_attention"};
};

const Kernels& kernels() {
  static const Kernels k;
  return k;
}

// One projection, as runtime/model/linear.py's Linear runs its panel rows: type -1 is the
// panel GEMM on panel_pack's panels, any other a GGML block type on quant_pack's layout.
struct Projection {
  const at::Tensor& weight;
  int64_t type;
  int64_t n_out;
  bool rows_alike;
  bool quantize_x;  // activations rounded to int8 per block (quant_gemm's path (b))

  at::Tensor operator()(const at::Tensor& x) const {
    const OptTensor no_bias;
    if (type < 0) return kernels().panel_gemm.call(x, weight, no_bias, n_out);
    return kernels().quant_gemm.call(x, weight, type, no_bias, n_out, quantize_x, rows_alike);
  }
};

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  int64_t kv_chunk;
};

// One layer from its input norm's output `x`: attention, then the gated MLP. As llama.py's
// forward_tokens: the residual add is fused into the next norm, so `x` returns un-added.
at::Tensor layer(const at::Tensor& x, at::Tensor& residual, const Shape& s,
                 const Projection* proj, const at::Tensor& post_norm, const at::Tensor& k_pool,
                 const at::Tensor& v_pool, const at::Tensor& out_slots, const at::Tensor& slots,
                 const at::Tensor& kv_indptr, const at::Tensor& qo_indptr,
                 const at::Tensor& cos, const at::Tensor& sin) {
  const Kernels& K = kernels();
  const int64_t rows = x.size(0);
  const int64_t q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
  const at::Tensor qkv = proj[0](x);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, s.num_heads, s.head_dim});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, s.num_kv_heads, s.head_dim});
  const at::Tensor v =
      qkv.narrow(1, q_size + kv_size, kv_size).view({rows, s.num_kv_heads, s.head_dim});
  const at::Tensor q_rot = K.rope.call(q, cos, sin);
  const at::Tensor k_rot = K.rope.call(k, cos, sin);
  // the pool rows, as KVPool.write (its write counts are kept by the caller, once a step)
  at::Tensor(k_pool).index_copy_(0, out_slots, k_rot);
  at::Tensor(v_pool).index_copy_(0, out_slots, v);
  const at::Tensor attn = std::get<0>(K.paged_attention.call(
      q_rot, k_pool, v_pool, slots, kv_indptr, qo_indptr, s.scale, 0, 0.0, s.kv_chunk));
  at::Tensor h = proj[1](attn.reshape({rows, q_size}));
  auto [normed, added] = K.add_rms_norm.call(h, residual, post_norm, s.eps);
  residual = added;
  return proj[3](K.silu_and_mul.call(proj[2](normed)));
}

Pair decode_layers(const at::Tensor& residual_in, at::TensorList norms, at::TensorList weights,
                   at::IntArrayRef types, at::IntArrayRef n_out, at::IntArrayRef rows_alike,
                   at::IntArrayRef quantize_x, at::TensorList k_pools, at::TensorList v_pools,
                   const at::Tensor& out_slots,
                   const at::Tensor& slots, const at::Tensor& kv_indptr,
                   const at::Tensor& qo_indptr, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                   double scale, int64_t kv_chunk) {
  const int64_t num_layers = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(num_layers > 0 && v_pools.size() == k_pools.size(),
              "decode_layers: one K and one V pool per layer expected");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * num_layers,
              "decode_layers: two norms per layer (input, post-attention) expected, got ",
              norms.size(), " for ", num_layers, " layers");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * num_layers &&
                  types.size() == weights.size() && n_out.size() == weights.size() &&
                  rows_alike.size() == weights.size() && quantize_x.size() == weights.size(),
              "decode_layers: four projections per layer (qkv, o, gate_up, down), each with a "
              "type, an output count, a rows_alike and a quantize_x flag, expected");
  TORCH_CHECK(residual_in.dim() == 2 && residual_in.is_contiguous(),
              "decode_layers: the residual must be a contiguous (rows, hidden) tensor");
  const Kernels& K = kernels();
  const Shape shape{num_heads, num_kv_heads, head_dim, eps, scale, kv_chunk};
  at::Tensor residual = residual_in;
  at::Tensor x = K.rms_norm.call(residual, norms[0], eps);
  for (int64_t i = 0; i < num_layers; ++i) {
    if (i) std::tie(x, residual) = K.add_rms_norm.call(x, residual, norms[2 * i], eps);
    const auto projection = [&](int64_t j) {
      return Projection{weights[j], types[j], n_out[j], rows_alike[j] != 0, quantize_x[j] != 0};
    };
    const Projection proj[4] = {projection(4 * i), projection(4 * i + 1), projection(4 * i + 2),
                                projection(4 * i + 3)};
    x = layer(x, residual, shape, proj, norms[2 * i + 1], k_pools[i], v_pools[i], out_slots,
              slots, kv_indptr, qo_indptr, cos, sin);
  }
  return {x, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flowlang, m) {
  m.def("decode_layers(Tensor residual, Tensor[] norms, Tensor[] weights, int[] types, "
        "int[] n_out, int[] rows_alike, int[] quantize_x, Tensor(a!)[] k_pools, "
        "Tensor(b!)[] v_pools, Tensor out_slots, "
        "Tensor slots, Tensor kv_indptr, Tensor qo_indptr, Tensor cos, Tensor sin, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int kv_chunk) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flowlang, CPU, m) { m.impl("decode_layers", &decode_layers); }
