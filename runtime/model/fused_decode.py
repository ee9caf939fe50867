"""A decode step's decoder layers in one native call (csrc/decode_layers.cpp).

At batch 1 a token of a small model is mostly dispatch: SmolLM2-135M's 30 layers make ~360
op calls from Python, ~2.5 us each through torch.ops plus the Python between them, ~40% of a
160 tok/s step (py-spy). The native op runs the same kernels in the same order through the
dispatcher's unboxed path, so a forward through it is the layer-by-layer forward bit for bit
(tests/test_fused_decode.py); llama.py takes it whenever the attention backend reports a step
of plain paged decodes (`fused_decode_step`) and every projection would run its rows on the
panel or block GEMM anyway.

Where the model is not of that shape (Gemma's norms, q/k norms or biases, experts, windows,
soft-caps, several RoPE tables, no native kernels), `fused_decoder` gives `NoFusedDecoder`,
which never takes a step.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime.model.arch import ModelArch
from runtime.model.linear import Linear
from runtime.model.moe import GatedMLP
from runtime.model.pointwise import NativeCpuOps

PROJECTIONS = ("qkv", "o", "gate_up", "down")


class NoFusedDecoder:
    """The model runs layer by layer."""

    num_steps = 0

    def takes(self, step: Any, rows: int) -> bool:
        return False


class FusedDecoder:
    """The layers' norms and projections, flattened once as decode_layers takes them."""

    def __init__(self, kernels: Any, arch: ModelArch, layers: list[dict], linears: list[Linear]):
        self._kernels = kernels
        self._arch = arch
        self._norms = [layer[name] for layer in layers for name in ("input_norm", "post_norm")]
        self._linears = linears  # qkv, o, gate_up, down of each layer in turn
        gemms = [linear.native_gemm() for linear in linears]
        self._weights = [g[0] for g in gemms]
        self._types = [g[1] for g in gemms]
        self._n_out = [g[2] for g in gemms]
        self.num_steps = 0  # forwards it ran

    def takes(self, step: Any, rows: int) -> bool:
        """A step of plain paged decodes whose rows every projection runs on its panel or
        blocks (they share a dtype, so the first one answers for all)."""
        return step is not None and self._linears[0].takes_panel(rows)

    def run(self, residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], step: Any):
        """(x, residual) after the last layer, as llama.py's layer loop leaves them."""
        arch = self._arch
        decodes = step.decodes
        x, residual = self._kernels.decode_layers(
            residual,
            self._norms,
            self._weights,
            self._types,
            self._n_out,
            [int(linear.block_rows_alike) for linear in self._linears],
            [int(linear.block_quantize_x) for linear in self._linears],
            step.pool.k,
            step.pool.v,
            step.out_slots,
            decodes.slots,
            decodes.indptr,
            decodes.qo_indptr,
            *rope,
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
            arch.rms_norm_eps,
            arch.head_dim**-0.5,
            step.kv_chunk,
        )
        step.pool.count_writes(step.out_slots, arch.num_layers)
        self.num_steps += 1
        return x, residual


def fused_decoder(arch: ModelArch, ops: Any, layers: list[dict]) -> FusedDecoder | NoFusedDecoder:
    """The fused decoder where this model's layers are all of the shape it runs."""
    plain = (
        isinstance(ops, NativeCpuOps)
        and ops.native_act
        and not (arch.gemma_norms or arch.qk_norm or arch.qkv_bias or arch.query_scale)
        and not arch.attn_softcap
        and len(set(arch.rope_layer_types)) == 1
        and all(w is None for w in arch.sliding_windows)
        and all(isinstance(layer["mlp"], GatedMLP) for layer in layers)
    )
    if not plain:
        return NoFusedDecoder()
    linears = [
        layer[name] if name in ("qkv", "o") else getattr(layer["mlp"], name)
        for layer in layers
        for name in PROJECTIONS
    ]
    if any(linear.native_gemm() is None for linear in linears):
        return NoFusedDecoder()
    return FusedDecoder(ops.kernels, arch, layers, linears)
