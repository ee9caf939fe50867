"""Dense layers with weights pre-packed for the CPU's GEMMs when those are available.

On CPU, oneDNN with weights reordered once into its blocked layout runs prefill-sized GEMMs near
this CPU's peak and 2-3x faster than `F.linear` (MKL) at decode shapes; results differ only in
summation order (~1e-6 relative in fp32). Decode rows instead go through the native panel GEMM
(csrc/panel_gemm.cpp), which streams weights packed in 48-feature panels: 1.1-1.4x oneDNN's
speed at 5-64 rows in fp32 and 5-32 in bf16, 1.3-1.9x at 1-4 rows, about even up to 256. Such a
Linear keeps both copies. Elsewhere, `F.linear`.

By default a forward of up to PANEL_MAX_ROWS tokens takes the panel, a larger one oneDNN; a
forward that verifies drafts (every sequence at most MAX_DECODE_ROWS new tokens, some more than
one) keeps the panel up to DECODE_PANEL_MAX_ROWS rows (`decode_shaped`), so that a verified
draft's rows sum as the plain decodes they replace.

Each GEMM computes a row's sums in an order of its own. The panel computes a row alike whatever
the other rows, and so does oneDNN in fp32 (from 2 rows up); in bf16 oneDNN's blocking, and so a
row's sums, changes with the row count (a 17-row GEMM's rows differ from the same rows in a
34-row one). So in a batch-invariant engine (`routed_rows`) the rows of sequences with at most
MAX_DECODE_ROWS new tokens always take the panel, the rows of longer extends oneDNN (in bf16 one
GEMM per extend: 1.35-4.4x the time of one GEMM for them all, RESULTS.md "batch invariance in
bf16"), and the LM head's rows always the panel: a token's sums never depend on what else is in
its batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RowRoutes:
    """A forward's token rows by GEMM: `panel` (decode-shaped sequences' rows) and `dense`
    (longer extends' rows), each a slice when the rows are one run, None when there are none;
    `extends`: each longer extend's rows."""

    num_tokens: int
    panel: slice | torch.Tensor | None
    dense: slice | torch.Tensor | None
    extends: tuple[slice, ...]

    @classmethod
    def of(cls, extend_lens: tuple[int, ...]) -> RowRoutes:
        panel, dense, start = [], [], 0
        for n in extend_lens:
            if n <= MAX_DECODE_ROWS:
                panel.extend(range(start, start + n))
            else:
                dense.append(slice(start, start + n))
            start += n
        dense_rows = [row for extend in dense for row in range(extend.start, extend.stop)]
        return cls(start, _as_index(panel), _as_index(dense_rows), tuple(dense))


def _as_index(rows: list[int]) -> slice | torch.Tensor | None:
    if not rows:
        return None
    if rows[-1] - rows[0] == len(rows) - 1:  # ascending and unique: one run
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows)


_routes: ContextVar[RowRoutes | None] = ContextVar("row_routes", default=None)


@contextmanager
def routed_rows(extend_lens: tuple[int, ...]) -> Iterator[None]:
    """Within it, a forward of a batch-invariant engine with these per-sequence new-token
    counts: its GEMMs route each row by its sequence's shape (see the module's doc)."""
    token = _routes.set(RowRoutes.of(extend_lens))
    try:
        yield
    finally:
        _routes.reset(token)


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
    """y = x @ weight.T + bias for x (num_tokens, in_features). `logits`: the LM head, whose
    rows (one per sequence, or a prompt's for its logprobs) take the panel GEMM in a
    batch-invariant forward, however many. `blocks`: the same weight as GGUF block rows, part
    by part (runtime/model/gguf_blocks.py's linear_blocks); where the CPU runs the block GEMM,
    the panel rows go through it on those bytes (activations as given: the panel's result up
    to summation order) and no panel copy is kept. With `block_quantize_x` (EngineConfig.
    quantize_activations) every row takes the blocks, each row's activations rounded to int8
    per block of 32 (llama.cpp's Q8_0/Q8_1): int8 dot products beat the dense GEMM over the
    dequantized weight at every row count measured (RESULTS.md), so prefill rows take them too."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        pack: bool,
        logits: bool = False,
        blocks: Sequence[tuple[torch.Tensor, int]] | None = None,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = pack
        self.logits = logits
        self._native = native_panel_gemm(weight) if pack else None
        self._panel_rows = PANEL_MAX_ROWS[weight.dtype] if self._native is not None else 0
        # oneDNN sums a row alike whatever the row count in fp32 only (measured: module doc)
        self._dense_rows_alike = weight.dtype == torch.float32
        self.quant: tuple[torch.Tensor, int] | None = None  # (quant_pack's layout, GGML type)
        self.block_types: tuple[int, ...] = ()  # the GGUF type of each part on blocks
        if blocks and self._native is not None and self._native.quant_gemm_supported():
            packed = [
                self._native.quant_pack(raw.reshape(-1), kind, raw.shape[0], self.in_features)
                for raw, kind in blocks
            ]  # parts of one layout, each whole groups of outputs: they join end to end
            self.quant = (torch.cat(packed) if len(packed) > 1 else packed[0], blocks[0][1])
            self.block_types = tuple(kind for _, kind in blocks)
        # every row summed as it would be alone (csrc/quant_gemm.cpp's passes of 2 rows): what
        # a batch-invariant or speculating engine needs, as the panel GEMM always does
        self.block_rows_alike = False
        self.block_quantize_x = False  # set only where there are blocks (ModelRunner)
        self.panels = None  # not built beside blocks: it would hold the weight a third time
        if self._native is not None and self.quant is None:
            self.panels = self._native.panel_pack(weight)
        # the decode rows' GEMM: on the blocks where there are some, else on the panels
        self._panel = self._block_gemm if self.quant is not None else self._panel_gemm
        # batch-size hint 8: a typical decode batch; any number of rows works
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 8) if pack else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self._native is None or rows == 0:
            return self._dense(x)
        if self.takes_panel(rows):
            return self._panel(x)
        routes = _routes.get()
        if routes is None or routes.num_tokens != rows:
            return self._dense(x)
        dense_at_once = self._dense_rows_alike or len(routes.extends) == 1
        if routes.panel is None and dense_at_once:
            return self._dense(x)
        out = x.new_empty(rows, self.out_features)
        if routes.panel is not None:
            out[routes.panel] = self._panel(x[routes.panel])
        if dense_at_once:
            out[routes.dense] = self._dense(x[routes.dense])
        else:
            for extend in routes.extends:  # each alone: its rows' sums as when alone
                out[extend] = self._dense(x[extend])
        return out

    def takes_panel(self, rows: int) -> bool:
        """Whether a call on `rows` rows (in the current routing) runs them all on the panel
        or block GEMM."""
        if self._native is None or rows == 0:
            return False
        if self.block_quantize_x:
            return True  # every row on the blocks
        routes = _routes.get()
        if routes is not None and self.logits:
            return True
        if routes is None or routes.num_tokens != rows:  # default, or an expert's rows
            return rows <= max(self._panel_rows, _decode_panel_rows.get())
        return routes.dense is None

    def native_gemm(self) -> tuple[torch.Tensor, int, int] | None:
        """What csrc/decode_layers.cpp needs to run this Linear's panel rows as `_panel` does:
        (the block layout, its GGML type) or (the panels, -1), and the output count; None
        where there is no native GEMM here or a bias (the fused layers take none)."""
        if self.bias is not None:
            return None
        if self.quant is not None:
            return self.quant[0], self.quant[1], self.out_features
        if self.panels is not None:
            return self.panels, -1, self.out_features
        return None

    def _panel_gemm(self, x: torch.Tensor) -> torch.Tensor:
        return self._native.panel_gemm(x, self.panels, self.bias, self.out_features)

    def _block_gemm(self, x: torch.Tensor) -> torch.Tensor:
        packed, ggml_type = self.quant
        return self._native.quant_gemm(
            x,
            packed,
            ggml_type,
            self.bias,
            self.out_features,
            self.block_quantize_x,
            self.block_rows_alike,
        )

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def num_params(self) -> int:
        return self.out_features * self.in_features + (
            0 if self.bias is None else self.out_features
        )
