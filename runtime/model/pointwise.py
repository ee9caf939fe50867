"""The decoder's small per-token ops: RMSNorm, residual add + RMSNorm, RoPE, gated activation.

One interface, three implementations, chosen by `pointwise_ops(device, arch, dtype)`:
- `TorchOps`, the reference on every device, with transformers' numerics: Llama-style norms in
  fp32 with the normalized activations cast back before the weight multiplies; Gemma-style
  norms (`gemma_norms`, weights held as 1 + w in fp32) multiply in fp32 and cast after; the
  gated MLP's activation is SiLU or tanh-GELU;
- `NativeCpuOps` on CPU for Llama-style norms: one native pass per norm, RoPE and SiLU-and-mul,
  same numerics;
- `FlashInferOps` on CUDA where flashinfer is installed: one fused kernel per op. In eager
  PyTorch each of these is 5-10 elementwise kernels, so a decode step of a 32-layer model is
  over a thousand launches, which even a CUDA graph pays for one by one (about 2 us each).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RopeTables:
    """cos/sin per position, built once (a captured graph reads them in place)."""

    cos: torch.Tensor  # (num_positions, rotary_dim) model dtype; both halves equal
    sin: torch.Tensor
    cos_sin: torch.Tensor | None  # (num_positions, rotary_dim) fp32: cos then sin per frequency

    @classmethod
    def build(
        cls,
        inv_freq: torch.Tensor,
        scale: float,
        num_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        with_cos_sin: bool,
    ) -> RopeTables:
        positions = torch.arange(num_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # (num_positions, rotary_dim // 2)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos_sin = None
        if with_cos_sin:
            cos_sin = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).to(device)
        return cls(
            (emb.cos() * scale).to(device=device, dtype=dtype),
            (emb.sin() * scale).to(device=device, dtype=dtype),
            cos_sin,
        )

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


class TorchOps:
    name = "torch"
    needs_cos_sin = False

    def __init__(self, gemma_norms: bool = False, hidden_act: str = "silu") -> None:
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"activation {hidden_act!r} is not supported: {sorted(ACTIVATIONS)}")
        self.gemma_norms = gemma_norms
        self._act = ACTIVATIONS[hidden_act]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.gemma_norms:
            return gemma_rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the next block's input and the new residual."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def head_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Per-head RMSNorm of q or k, (tokens, heads, head_dim): always the reference."""
        return TorchOps.rms_norm(self, x, weight, eps)

    def rope_context(self, positions: torch.Tensor, tables: RopeTables) -> Any:
        """What every layer's `rope` needs for these positions, gathered once per forward."""
        return tables.cos[positions][:, None, :], tables.sin[positions][:, None, :]

    def rope(self, q: torch.Tensor, k: torch.Tensor, context: Any) -> tuple[torch.Tensor, ...]:
        """q (tokens, heads, head_dim), k (tokens, kv_heads, head_dim), rotated."""
        cos, sin = context
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(tokens, 2 * intermediate) -> act(gate) * up, (tokens, intermediate)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self._act(gate) * up


class FlashInferOps(TorchOps):
    name = "flashinfer"
    needs_cos_sin = True

    def __init__(self) -> None:
        import flashinfer  # lazy: only on CUDA

        super().__init__()
        self._fi = flashinfer

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._fi.norm.rmsnorm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        self._fi.norm.fused_add_rmsnorm(x, residual, weight, eps)  # both in place
        return x, residual

    def rope_context(self, positions: torch.Tensor, tables: RopeTables) -> Any:
        return positions, tables.cos_sin

    def rope(self, q, k, context):
        positions, cos_sin = context
        # in place on views of the fused QKV output (the kernel takes row strides)
        self._fi.rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q.flatten(1), k.flatten(1), q.shape[-1], cos_sin, is_neox=True
        )
        return q, k

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._fi.activation.silu_and_mul(gate_up)


class NativeCpuOps(TorchOps):
    """On CPU for Llama-style models: RMSNorm, residual add + RMSNorm, RoPE and SiLU-and-mul,
    each one native pass over the batch with the reference's roundings (csrc/pointwise.cpp)."""

    name = "native-cpu"

    def __init__(self, kernels: Any, hidden_act: str) -> None:
        super().__init__(False, hidden_act)
        self.kernels = kernels
        self.native_act = hidden_act == "silu"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x.contiguous(), weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.kernels.add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)

    def rope_context(self, positions: torch.Tensor, tables: RopeTables) -> Any:
        return tables.cos[positions], tables.sin[positions]  # (tokens, rotary_dim) each

    def rope(self, q: torch.Tensor, k: torch.Tensor, context: Any) -> tuple[torch.Tensor, ...]:
        cos, sin = context
        return self.kernels.rope(q, cos, sin), self.kernels.rope(k, cos, sin)

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self.native_act:
            return super().act_mul(gate_up)
        return self.kernels.silu_and_mul(gate_up.contiguous())


def pointwise_ops(
    device: torch.device, gemma_norms: bool, hidden_act: str, dtype: torch.dtype
) -> TorchOps:
    """flashinfer's fused kernels on CUDA when installed, for Llama-style models (SiLU, plain
    norms) in fp16/bf16 (its norms take no fp32); our native norms on CPU for them (the
    reference if they cannot be built here); the torch reference otherwise (Gemma's variants)."""
    import importlib.util

    llama_style = not gemma_norms and hidden_act == "silu"
    half = dtype in (torch.float16, torch.bfloat16)
    if device.type == "cuda" and llama_style and half and importlib.util.find_spec("flashinfer"):
        return FlashInferOps()
    if device.type == "cpu" and not gemma_norms:
        from runtime.model.native.kernels import KernelBuildError, load_cpu_kernels

        try:
            return NativeCpuOps(load_cpu_kernels(), hidden_act)
        except KernelBuildError:  # the kernels said why, once
            pass
    return TorchOps(gemma_norms, hidden_act)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: `weight` holds 1 + w (fp32), multiplied before the cast back."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (num_tokens, heads, head_dim) rotated by position (rotate-half layout) on its first
    rotary_dim = cos.shape[-1] features; the rest pass through (partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat([rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    half = rotary_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
