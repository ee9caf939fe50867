"""Llama-shaped decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/3, Phi-3) over a ragged ForwardBatch.

Our own forward: RMSNorm, RoPE at explicit positions, GQA attention through a pluggable backend,
gated SiLU MLP or top-k experts (runtime/model/moe.py). Q/K/V and gate/up projections are fused
into one matmul each (Phi-3 checkpoints arrive fused; the others are concatenated at load).
Per-family pieces are switches on ModelArch: q/k bias (Qwen2), per-head q/k RMSNorm (Qwen3),
partial rotary (Phi-3.5/4-mini), experts (Mixtral, Qwen3-MoE). Numerics follow transformers'
implementation (norms in fp32, cos/sin from fp32 frequencies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.arch import ModelArch
from runtime.model.attention.base import AttentionBackend
from runtime.model.batch import ForwardBatch
from runtime.model.fused_decode import fused_decoder
from runtime.model.gguf_blocks import Blocks, head_blocks, linear_blocks
from runtime.model.linear import Linear, packed_gemm_available
from runtime.model.moe import load_feed_forward
from runtime.model.pointwise import RopeTables, pointwise_ops


class MissingWeightError(KeyError):
    """The checkpoint lacks a tensor the architecture needs."""


class LlamaModel:
    """Weights as plain tensors; `forward` returns fp32 logits for `batch.logit_rows`."""

    def __init__(
        self,
        arch: ModelArch,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        blocks: dict[str, Blocks] | None = None,
    ) -> None:
        """`blocks`: GGUF block bytes by checkpoint name (gguf_blocks.py) for the Linears whose
        decode rows run on them; none: every Linear keeps the panel GEMM."""
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)

        def get(name: str, dtype: torch.dtype = dtype) -> torch.Tensor:
            try:
                tensor = weights[name]
            except KeyError:
                raise MissingWeightError(f"checkpoint has no tensor {name!r}") from None
            return tensor.to(device=self.device, dtype=dtype).contiguous()

        def norm(name: str) -> torch.Tensor:
            """A norm's weight as stored, or Gemma's 1 + w kept in fp32."""
            return 1 + get(name, torch.float32) if arch.gemma_norms else get(name)

        pack = packed_gemm_available(self.device)
        # norms, RoPE, gated activation: flashinfer's fused kernels on CUDA for Llama-style models
        self.ops = pointwise_ops(self.device, arch.gemma_norms, arch.hidden_act, dtype)
        self.embed = get("model.embed_tokens.weight")  # (vocab, hidden)
        lm_head = self.embed if arch.tie_word_embeddings else get("lm_head.weight")
        head = head_blocks(blocks or {}, arch.tie_word_embeddings)
        self.lm_head = Linear(lm_head, None, pack, logits=True, blocks=head)
        self.final_norm = norm("model.norm.weight")
        # Gemma: embeddings times sqrt(hidden) rounded to the model dtype, as transformers does
        self._embed_scale = torch.tensor(arch.embed_scale, dtype=dtype, device=self.device)
        # a query scale other than head_dim ** -0.5 applied to q, so backends keep theirs
        self._q_factor = arch.query_scale * arch.head_dim**0.5 if arch.query_scale else None
        self.layers = [
            self._load_layer(i, weights, get, norm, pack, blocks or {})
            for i in range(arch.num_layers)
        ]
        # a decode step's layers in one native call where the model is of its shape
        self.fused = fused_decoder(arch, self.ops, self.layers)
        # (inverse frequencies, scale) per RoPE parameter set; None keys the only one
        self._rope_params = {t: arch.rope_inv_freq(t) for t in set(arch.rope_layer_types)}
        self._rope: dict[str | None, RopeTables] = {}
        self.ensure_rope(min(arch.max_context_len, 4096))

    def _load_layer(self, i: int, weights, get, norm, pack: bool, blocks: dict) -> dict:
        arch = self.arch

        def fused(prefix: str, fused_name: str, parts: tuple[str, ...]) -> torch.Tensor:
            """One fused tensor: stored as such (Phi-3), or the parts concatenated on dim 0."""
            if prefix + fused_name in weights:
                return get(prefix + fused_name)
            return torch.cat([get(prefix + part) for part in parts])

        p = f"model.layers.{i}."
        attn = p + "self_attn."
        qkv_names = tuple(f"{x}_proj.weight" for x in "qkv")
        qkv_blocks = linear_blocks(blocks, [attn + name for name in qkv_names])
        o_name = attn + "o_proj.weight"
        qkv_bias = None
        if arch.qkv_bias:
            qkv_bias = fused(attn, "qkv_proj.bias", tuple(f"{x}_proj.bias" for x in "qkv"))
        layer = {
            "input_norm": norm(p + "input_layernorm.weight"),
            # (num_heads*head_dim + 2*num_kv_heads*head_dim, hidden)
            "qkv": Linear(
                fused(attn, "qkv_proj.weight", qkv_names), qkv_bias, pack, blocks=qkv_blocks
            ),
            "o": Linear(get(o_name), None, pack, blocks=linear_blocks(blocks, [o_name])),
            "mlp": load_feed_forward(arch, i, get, set(weights), pack, self.ops.act_mul, blocks),
        }
        if arch.gemma_norms:  # sandwich: each block's output is normalized before its add
            layer["attn_out_norm"] = norm(p + "post_attention_layernorm.weight")
            layer["post_norm"] = norm(p + "pre_feedforward_layernorm.weight")
            layer["mlp_out_norm"] = norm(p + "post_feedforward_layernorm.weight")
        else:
            layer["post_norm"] = norm(p + "post_attention_layernorm.weight")
        if arch.qk_norm:
            layer["q_norm"] = norm(attn + "q_norm.weight")  # (head_dim,)
            layer["k_norm"] = norm(attn + "k_norm.weight")
        return layer

    def linears(self) -> list[Linear]:
        """The Linears: each layer's attention and dense MLP projections, and the LM head."""
        linears = [self.lm_head]
        for layer in self.layers:
            linears += [v for v in layer.values() if isinstance(v, Linear)]
            mlp = [getattr(layer["mlp"], name, None) for name in ("gate_up", "down")]
            linears += [f for f in mlp if isinstance(f, Linear)]
        return linears

    def block_formats(self) -> dict[str, int]:
        """Checkpoint tensors whose decode rows run on their GGUF blocks (gguf_blocks), counted
        by block type (a fused Linear's parts each count)."""
        from gguf import GGMLQuantizationType

        counts: dict[str, int] = {}
        for linear in self.linears():
            for kind in linear.block_types:
                name = GGMLQuantizationType(kind).name
                counts[name] = counts.get(name, 0) + 1
        return counts

    @property
    def num_params(self) -> int:
        """Parameters, counting tied embeddings once."""
        count = self.embed.numel() + self.final_norm.numel()
        if not self.arch.tie_word_embeddings:
            count += self.lm_head.num_params
        for layer in self.layers:
            count += sum(
                w.numel() if isinstance(w, torch.Tensor) else w.num_params for w in layer.values()
            )
        return count

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Logits (num_logit_rows, vocab) in fp32. `attn.plan(batch)` must have run."""
        self.ensure_rope(int(batch.positions.max()) + 1)  # a host tensor: no device sync
        rows = batch.logit_rows
        return self.forward_tokens(
            batch.input_ids.to(self.device),
            batch.positions.to(self.device),
            rows.to(self.device) if rows.numel() else None,
            attn,
        )

    def forward_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logit_rows: torch.Tensor | None,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """The forward on device tensors, with no host synchronization, so that a CUDA graph
        can capture it; the RoPE tables must already cover `positions` (`ensure_rope`)."""
        arch, ops, eps = self.arch, self.ops, self.arch.rms_norm_eps
        ropes = {t: ops.rope_context(positions, tables) for t, tables in self._rope.items()}
        residual = F.embedding(input_ids, self.embed)  # (num_tokens, hidden)
        if arch.embed_scale != 1.0:
            residual = residual * self._embed_scale
        step = attn.fused_decode_step()
        if self.fused.takes(step, residual.shape[0]):
            x, residual = self.fused.run(residual, ropes[arch.rope_layer_types[0]], step)
        else:
            x, residual = self._layers(residual, ropes, attn)
        if logit_rows is None:
            return torch.empty(0, arch.vocab_size)
        last = residual[logit_rows] + x[logit_rows]  # (num_logit_rows, hidden)
        logits = self.lm_head(ops.rms_norm(last, self.final_norm, eps)).float()
        if arch.final_softcap:
            logits = torch.tanh(logits / arch.final_softcap) * arch.final_softcap
        return logits

    def _layers(
        self, residual: torch.Tensor, ropes: dict, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) after the last layer, one op at a time; its residual add is left to
        the caller."""
        arch, ops, eps = self.arch, self.ops, self.arch.rms_norm_eps
        q_size = arch.num_heads * arch.head_dim
        kv_size = arch.num_kv_heads * arch.head_dim
        x = ops.rms_norm(residual, self.layers[0]["input_norm"], eps)
        for i, layer in enumerate(self.layers):
            if i:  # the residual add fused into the norm of the next block
                x, residual = ops.add_rms_norm(x, residual, layer["input_norm"], eps)
            qkv = layer["qkv"](x)  # (num_tokens, q + 2 kv)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(-1, arch.num_heads, arch.head_dim)  # (num_tokens, num_heads, head_dim)
            k = k.view(-1, arch.num_kv_heads, arch.head_dim)
            v = v.view(-1, arch.num_kv_heads, arch.head_dim)
            if arch.qk_norm:
                q = ops.head_norm(q, layer["q_norm"], eps)
                k = ops.head_norm(k, layer["k_norm"], eps)
            if self._q_factor is not None:
                q = q * self._q_factor
            q, k = ops.rope(q, k, ropes[arch.rope_layer_types[i]])
            x = layer["o"](attn.forward(i, q, k, v))
            if "attn_out_norm" in layer:
                x = ops.rms_norm(x, layer["attn_out_norm"], eps)
            x, residual = ops.add_rms_norm(x, residual, layer["post_norm"], eps)
            x = layer["mlp"](x)
            if "mlp_out_norm" in layer:
                x = ops.rms_norm(x, layer["mlp_out_norm"], eps)
        return x, residual

    def ensure_rope(self, num_positions: int) -> dict[str | None, RopeTables]:
        """RoPE tables covering positions 0..num_positions-1, grown by doubling as in
        transformers. A captured graph reads the tables it was captured with; if they are
        regrown later, the graph's holder keeps the old ones alive (same rows for its positions).
        """
        have = next(iter(self._rope.values())).num_positions if self._rope else 0
        if num_positions > have:
            self._rope = {
                kind: RopeTables.build(
                    inv_freq,
                    scale,
                    max(num_positions, 2 * have),
                    self.dtype,
                    self.device,
                    with_cos_sin=self.ops.needs_cos_sin,
                )
                for kind, (inv_freq, scale) in self._rope_params.items()
            }
        return self._rope
