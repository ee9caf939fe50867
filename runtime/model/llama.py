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
from runtime.model.linear import Linear, packed_gemm_available
from runtime.model.moe import load_feed_forward


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
    ) -> None:
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)

        def get(name: str) -> torch.Tensor:
            try:
                tensor = weights[name]
            except KeyError:
                raise MissingWeightError(f"checkpoint has no tensor {name!r}") from None
            return tensor.to(device=self.device, dtype=dtype).contiguous()

        pack = packed_gemm_available(self.device)
        self.embed = get("model.embed_tokens.weight")  # (vocab, hidden)
        lm_head = self.embed if arch.tie_word_embeddings else get("lm_head.weight")
        self.lm_head = Linear(lm_head, None, pack)
        self.final_norm = get("model.norm.weight")
        self.layers = []

        def fused(prefix: str, fused_name: str, parts: tuple[str, ...]) -> torch.Tensor:
            """One fused tensor: stored as such (Phi-3), or the parts concatenated on dim 0."""
            if prefix + fused_name in weights:
                return get(prefix + fused_name)
            return torch.cat([get(prefix + part) for part in parts])

        names = set(weights)
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            qkv_names = tuple(f"{x}_proj.weight" for x in "qkv")
            qkv_bias = None
            if arch.qkv_bias:
                qkv_bias = fused(attn, "qkv_proj.bias", tuple(f"{x}_proj.bias" for x in "qkv"))
            layer = {
                "input_norm": get(p + "input_layernorm.weight"),
                "post_norm": get(p + "post_attention_layernorm.weight"),
                # (num_heads*head_dim + 2*num_kv_heads*head_dim, hidden)
                "qkv": Linear(fused(attn, "qkv_proj.weight", qkv_names), qkv_bias, pack),
                "o": Linear(get(attn + "o_proj.weight"), None, pack),
                "mlp": load_feed_forward(arch, i, get, names, pack),  # dense or experts
            }
            if arch.qk_norm:
                layer["q_norm"] = get(attn + "q_norm.weight")  # (head_dim,)
                layer["k_norm"] = get(attn + "k_norm.weight")
            self.layers.append(layer)
        self._inv_freq, self._rope_scale = arch.rope_inv_freq()
        self._cos = self._sin = torch.empty(0, 2 * self._inv_freq.numel())
        self._ensure_rope(min(arch.max_context_len, 4096))

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
        arch = self.arch
        input_ids = batch.input_ids.to(self.device)
        positions = batch.positions.to(self.device)
        self._ensure_rope(int(positions.max()) + 1)
        cos = self._cos[positions][:, None, :]  # (num_tokens, 1, rotary_dim)
        sin = self._sin[positions][:, None, :]
        q_size = arch.num_heads * arch.head_dim
        kv_size = arch.num_kv_heads * arch.head_dim
        hidden = F.embedding(input_ids, self.embed)  # (num_tokens, hidden)
        for i, layer in enumerate(self.layers):
            x = _rms_norm(hidden, layer["input_norm"], arch.rms_norm_eps)
            qkv = layer["qkv"](x)  # (num_tokens, q + 2 kv)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(-1, arch.num_heads, arch.head_dim)  # (num_tokens, num_heads, head_dim)
            k = k.view(-1, arch.num_kv_heads, arch.head_dim)
            v = v.view(-1, arch.num_kv_heads, arch.head_dim)
            if arch.qk_norm:
                q = _rms_norm(q, layer["q_norm"], arch.rms_norm_eps)
                k = _rms_norm(k, layer["k_norm"], arch.rms_norm_eps)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            hidden = hidden + layer["o"](attn.forward(i, q, k, v))
            x = _rms_norm(hidden, layer["post_norm"], arch.rms_norm_eps)
            hidden = hidden + layer["mlp"](x)
        if batch.logit_rows.numel() == 0:
            return torch.empty(0, self.arch.vocab_size)
        last = _rms_norm(
            hidden[batch.logit_rows.to(self.device)], self.final_norm, arch.rms_norm_eps
        )
        return self.lm_head(last).float()

    def _ensure_rope(self, num_positions: int) -> None:
        """cos/sin tables (num_positions, rotary_dim), grown by doubling, as in transformers."""
        if num_positions <= self._cos.shape[0]:
            return
        size = max(num_positions, 2 * self._cos.shape[0])
        positions = torch.arange(size, dtype=torch.float)
        freqs = positions[:, None] * self._inv_freq[None, :]  # (size, head_dim // 2)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos = (emb.cos() * self._rope_scale).to(device=self.device, dtype=self.dtype)
        self._sin = (emb.sin() * self._rope_scale).to(device=self.device, dtype=self.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (num_tokens, heads, head_dim) rotated by position (rotate-half layout) on its first
    rotary_dim = cos.shape[-1] features; the rest pass through (partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat([_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    half = rotary_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
