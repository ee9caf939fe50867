"""What the engine needs to know of a model's architecture, read once from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.errors import UsageError
from runtime.model.families import FAMILIES
from runtime.prefix import kv_bytes_per_token

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# RoPE variants whose frequencies do not depend on the current sequence length; "longrope"
# (Phi-3) is static up to original_max_position_embeddings, so the context is capped there
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Families whose attention RMS-normalizes each query and key head before RoPE
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")
# Gemma's decoder: embeddings scaled by sqrt(hidden), norms of weight 1 + w applied in fp32,
# a norm after attention and after the MLP as well as before each, GeGLU (tanh GELU)
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")


class UnsupportedModelError(UsageError, ValueError):
    """The checkpoint's architecture is not one this engine implements."""


@dataclass(frozen=True)
class ModelArch:
    """Shapes and numerics of a Llama-shaped decoder (Llama, SmolLM2, Mistral, Qwen2/3, Phi-3)."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_context_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    moe_layers: tuple[bool, ...]  # per layer: top-k experts instead of the dense MLP
    num_experts: int  # 0 for dense models
    num_experts_per_tok: int
    norm_topk_prob: bool  # renormalize the top-k router weights (Mixtral always)
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    rope_layer_types: tuple[str | None, ...]  # per layer: its key in per-type RoPE parameters
    gemma_norms: bool  # Gemma: norm weights are 1 + w, multiplied in fp32; sandwich norms
    embed_scale: float  # embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    hidden_act: str  # of the gated MLP: "silu" or "gelu_pytorch_tanh"
    query_scale: float | None  # attention scale when not head_dim ** -0.5 (Gemma)
    attn_softcap: float | None  # attention scores -> softcap * tanh(scores / softcap)
    final_softcap: float | None  # the same on the output logits
    eos_token_ids: tuple[int, ...]
    hf_config: Any  # the transformers config it came from (RoPE parameters live there)

    @classmethod
    def from_hf(cls, config: Any) -> ModelArch:
        """Read a transformers `PretrainedConfig`; unsupported architectures fail clearly."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES} "
                f"(`flowlang models` describes them)"
            )
        rope = getattr(config, "rope_parameters", None) or {}
        per_type = _per_layer_type_rope(config)
        for params in per_type.values() if per_type else (rope,):
            rope_type = params.get("rope_type", "default")
            if rope_type not in STATIC_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"rope_type {rope_type!r} is not supported; supported: {STATIC_ROPE_TYPES}"
                )
        num_layers = config.num_hidden_layers
        num_heads = config.num_attention_heads
        eos = getattr(config, "eos_token_id", None)
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (eos,)
        gemma = model_type in GEMMA_MODEL_TYPES
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        scalar = getattr(config, "query_pre_attn_scalar", None)
        query_scale = None if scalar is None or scalar == head_dim else scalar**-0.5
        return cls(
            model_type=model_type,
            num_layers=num_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            max_context_len=_max_context_len(config, rope),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            moe_layers=_moe_layers(config, num_layers),
            num_experts=_num_experts(config),
            num_experts_per_tok=getattr(config, "num_experts_per_tok", 0) or 0,
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", model_type == "mixtral")),
            sliding_windows=_sliding_windows(config, num_layers),
            rope_layer_types=tuple(config.layer_types) if per_type else (None,) * num_layers,
            gemma_norms=gemma,
            embed_scale=config.hidden_size**0.5 if gemma else 1.0,
            hidden_act=getattr(config, "hidden_activation", None)
            or getattr(config, "hidden_act", "silu"),
            query_scale=query_scale,
            attn_softcap=getattr(config, "attn_logit_softcapping", None),
            final_softcap=getattr(config, "final_logit_softcapping", None),
            eos_token_ids=eos_ids,
            hf_config=config,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x element size."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, str(dtype))

    def rope_inv_freq(self, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
        """Inverse frequencies (rotary_dim // 2,) and cos/sin scale, as transformers makes them.

        rotary_dim is head_dim times `partial_rotary_factor` (Phi-3.5/4-mini rotate part of each
        head); longrope returns its short-context factors (the context is capped to match).
        `layer_type` picks the parameters of a model whose layer kinds have their own (Gemma 3:
        local and global layers rotate at different bases).
        """
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(self.hf_config, "rope_parameters", None) or {}
        if layer_type is not None:
            params = params[layer_type]
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(self.hf_config, "rope_theta", 10000.0))
            rotary_dim = int(self.head_dim * params.get("partial_rotary_factor", 1.0))
            exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim
            return 1.0 / (base**exponents), 1.0
        extra = {} if layer_type is None else {"layer_type": layer_type}
        init = ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, scale = init(self.hf_config, torch.device("cpu"), **extra)
        return inv_freq.float(), float(scale)


def _per_layer_type_rope(config: Any) -> dict[str, dict]:
    """RoPE parameters keyed by layer type (Gemma 3), or {} when one set serves every layer."""
    rope = getattr(config, "rope_parameters", None) or {}
    layer_types = getattr(config, "layer_types", None) or ()
    if layer_types and all(isinstance(rope.get(t), dict) for t in set(layer_types)):
        return {t: rope[t] for t in set(layer_types)}
    return {}


def _num_experts(config: Any) -> int:
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0) or 0


def _moe_layers(config: Any, num_layers: int) -> tuple[bool, ...]:
    """Mixtral: every layer; Qwen3-MoE: every decoder_sparse_step-th, minus mlp_only_layers."""
    if _num_experts(config) == 0:
        return (False,) * num_layers
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _max_context_len(config: Any, rope: dict) -> int:
    """max_position_embeddings, or for longrope the pretraining length its short factors fit."""
    if rope.get("rope_type") == "longrope":
        original = rope.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        return int(original or config.max_position_embeddings)
    return config.max_position_embeddings


def _sliding_windows(config: Any, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return (None,) * num_layers
    if layer_types is None:  # Mistral: every layer slides
        return (window,) * num_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
