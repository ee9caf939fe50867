"""Dense layers with weights pre-packed for the CPU's GEMM (oneDNN) when that is available.

On CPU, oneDNN with weights reordered once into its blocked layout runs the decode-shaped
GEMMs (few rows, large weights) 2-3x faster than `F.linear` (MKL) in fp32 and is also faster
for prefill; results differ only in summation order (~1e-6 relative). Forwards of at most a few
tokens (a lone sequence's decode) instead stream the row-major weights through the native GEMV
(csrc/gemv.cpp), ~1.5x oneDNN's speed at 1-2 rows in fp32 and ~2x at 1-3 rows in bf16 (even
in fp32 at 3-4 rows): such a Linear keeps both copies. Elsewhere, `F.linear`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def packed_gemm_available(device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def native_gemv(weight: torch.Tensor) -> Any | None:
    """The native kernels' ops where their few-row GEMV runs this weight here, else None (the
    kernels' build failure is reported once, by the norms that need them too)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    from runtime.model.native.kernels import KernelBuildError, load_cpu_kernels

    try:
        ops = load_cpu_kernels()
    except KernelBuildError:
        return None
    return ops if ops.native_gemv_supported() else None


class Linear:
    """y = x @ weight.T + bias for x (num_tokens, in_features)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = pack
        self._gemv = native_gemv(weight) if pack else None
        self._gemv_rows = self._gemv.gemv_max_rows() if self._gemv is not None else 0
        self.row_major = weight.contiguous() if self._gemv is not None else None
        # batch-size hint 8: a typical decode batch; any number of rows works
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 8) if pack else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < x.shape[0] <= self._gemv_rows:
            return self._gemv.gemv(x, self.row_major, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def num_params(self) -> int:
        return self.out_features * self.in_features + (
            0 if self.bias is None else self.out_features
        )
