"""The decoder's small per-token ops: RMSNorm, residual add + RMSNorm, RoPE, SiLU-and-mul.

One interface, two implementations, chosen by `pointwise_ops(device)`:
- `TorchOps`, the reference on every device, with transformers' numerics (norms in fp32, the
  normalized activations cast back before the weight multiplies);
- `FlashInferOps` on CUDA where flashinfer is installed: one fused kernel per op. In eager
  PyTorch each of these is 5-10 elementwise kernels, so a decode step of a 32-layer model is
  over a thousand launches, which even a CUDA graph pays for one by one (about 2 us each).
"""

from __future__ import annotations

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


class TorchOps:
    name = "torch"
    needs_cos_sin = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the next block's input and the new residual."""
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def rope_context(self, positions: torch.Tensor, tables: RopeTables) -> Any:
        """What every layer's `rope` needs for these positions, gathered once per forward."""
        return tables.cos[positions][:, None, :], tables.sin[positions][:, None, :]

    def rope(self, q: torch.Tensor, k: torch.Tensor, context: Any) -> tuple[torch.Tensor, ...]:
        """q (tokens, heads, head_dim), k (tokens, kv_heads, head_dim), rotated."""
        cos, sin = context
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(tokens, 2 * intermediate) -> silu(gate) * up, (tokens, intermediate)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FlashInferOps(TorchOps):
    name = "flashinfer"
    needs_cos_sin = True

    def __init__(self) -> None:
        import flashinfer  # lazy: only on CUDA

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

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._fi.activation.silu_and_mul(gate_up)


def pointwise_ops(device: torch.device) -> TorchOps:
    """flashinfer's fused kernels on CUDA when installed, else the torch reference."""
    import importlib.util

    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        return FlashInferOps()
    return TorchOps()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (num_tokens, heads, head_dim) rotated by position (rotate-half layout) on its first
    rotary_dim = cos.shape[-1] features; the rest pass through (partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat([rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    half = rotary_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
