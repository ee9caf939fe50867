"""What the engine needs to know of a model's architecture, read once from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.prefix import kv_bytes_per_token

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE variants whose frequencies do not depend on the current sequence length
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one this engine implements."""


@dataclass(frozen=True)
class ModelArch:
    """Shapes and numerics of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2)."""

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
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    eos_token_ids: tuple[int, ...]
    hf_config: Any  # the transformers config it came from (RoPE parameters live there)

    @classmethod
    def from_hf(cls, config: Any) -> ModelArch:
        """Read a transformers `PretrainedConfig`; unsupported architectures fail clearly."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported; supported: {STATIC_ROPE_TYPES}"
            )
        num_layers = config.num_hidden_layers
        num_heads = config.num_attention_heads
        eos = getattr(config, "eos_token_id", None)
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (eos,)
        return cls(
            model_type=model_type,
            num_layers=num_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            max_context_len=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            sliding_windows=_sliding_windows(config, num_layers),
            eos_token_ids=eos_ids,
            hf_config=config,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x element size."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, str(dtype))

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies (head_dim // 2,) and cos/sin scale, as transformers makes them."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(self.hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(self.hf_config, "rope_theta", 10000.0))
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim
            return 1.0 / (base**exponents), 1.0
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](self.hf_config, torch.device("cpu"))
        return inv_freq.float(), float(scale)


def _sliding_windows(config: Any, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return (None,) * num_layers
    if layer_types is None:  # Mistral: every layer slides
        return (window,) * num_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
