"""Dense layers with weights pre-packed for the CPU's GEMMs when those are available.

On CPU, oneDNN with weights reordered once into its blocked layout runs prefill-sized GEMMs near
this CPU's peak and 2-3x faster than `F.linear` (MKL) at decode shapes; results differ only in
summation order (~1e-6 relative in fp32). Decode batches (up to PANEL_MAX_ROWS tokens) instead
go through the native panel GEMM (csrc/panel_gemm.cpp), which streams weights packed in
48-feature panels: 1.1-1.4x oneDNN's speed at 5-64 rows in fp32 and 5-32 in bf16, and 1.3-1.9x
at 1-4 rows. Such a Linear keeps both copies. Elsewhere, `F.linear`.

A forward that verifies drafts (every sequence at most MAX_DECODE_ROWS new tokens, some more
than one) takes the panel GEMM up to DECODE_PANEL_MAX_ROWS rows in either dtype
(`decode_shaped`): a row's sums then run in the order its plain decode's do, so a verified draft
rounds as the decodes it replaces (in bf16 oneDNN's order moves a few elements in 10^4-10^5).
Plain decode batches keep PANEL_MAX_ROWS, where each GEMM was measured fastest.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from runtime.model.native.kernels import MAX_DECODE_ROWS


def packed_gemm_available(device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


# Forwards of at most this many tokens go through the panel GEMM: above them oneDNN's is as
# fast or faster (examples/benchmarks/RESULTS.md, "the panel GEMM").
PANEL_MAX_ROWS = {torch.float32: 64, torch.bfloat16: 32}
# a verifying forward: sequences of at most MAX_DECODE_ROWS new tokens, at most this many rows
# in all (16 speculating requests); in bf16 the panel can be ~8% slower than oneDNN there
DECODE_PANEL_MAX_ROWS = 256
_decode_panel_rows: ContextVar[int] = ContextVar("decode_panel_rows", default=0)


@contextmanager
def decode_shaped(extend_lens: tuple[int, ...]) -> Iterator[None]:
    """Within it, a forward of these per-sequence new-token counts: when every one is at most
    MAX_DECODE_ROWS and some are more than 1 (drafts verified, jump-forward), the panel GEMM
    takes up to DECODE_PANEL_MAX_ROWS rows."""
    decodes = bool(extend_lens) and 1 < max(extend_lens) <= MAX_DECODE_ROWS
    token = _decode_panel_rows.set(DECODE_PANEL_MAX_ROWS if decodes else 0)
    try:
        yield
    finally:
        _decode_panel_rows.reset(token)


def native_panel_gemm(weight: torch.Tensor) -> Any | None:
    """The native kernels' ops where their panel GEMM runs this weight here, else None (the
    kernels' build failure is reported once, by the norms that need them too)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    from runtime.model.native.kernels import KernelBuildError, load_cpu_kernels

    try:
        ops = load_cpu_kernels()
    except KernelBuildError:
        return None
    return ops if ops.panel_gemm_supported() else None


class Linear:
    """y = x @ weight.T + bias for x (num_tokens, in_features)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = pack
        self._native = native_panel_gemm(weight) if pack else None
        self._panel_rows = PANEL_MAX_ROWS[weight.dtype] if self._native is not None else 0
        self.panels = self._native.panel_pack(weight) if self._native is not None else None
        # batch-size hint 8: a typical decode batch; any number of rows works
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 8) if pack else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self._native is not None and 0 < rows <= max(self._panel_rows, _decode_panel_rows.get()):
            return self._native.panel_gemm(x, self.panels, self.bias, self.out_features)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def num_params(self) -> int:
        return self.out_features * self.in_features + (
            0 if self.bias is None else self.out_features
        )
