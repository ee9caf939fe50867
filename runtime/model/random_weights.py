"""Random-weight checkpoints from a config, for benchmarking without downloads.

`EngineConfig(model="random:llama-3-8b", device="cuda", dtype="bfloat16")` builds Llama-3-8B
shapes with weights drawn on the target device (nothing large ever sits in host memory).
Outputs are meaningless; use fixed lengths (ignore_eos) and token-id prompts.
"""

from __future__ import annotations

import torch

from runtime.model.arch import ModelArch
from runtime.model.loader import Checkpoint

PRESETS = {
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
        eos_token_id=128009,
    ),
    # Llama-3's attention shapes (head_dim 128, 4 query heads per KV head) in 4 small layers:
    # the GPU tests run the same attention kernels as the 8B bench
    "llama-3-small": dict(
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
        eos_token_id=2,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        eos_token_id=2,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        eos_token_id=2,
    ),
}


def random_checkpoint(spec: str, dtype: torch.dtype, device: str, seed: int = 0) -> Checkpoint:
    """A Checkpoint for "random:<preset>" with N(0, 0.02) weights (norms at 1)."""
    from transformers import LlamaConfig

    name = spec.removeprefix("random:")
    if name not in PRESETS:
        raise ValueError(f"unknown random model {name!r}; presets: {sorted(PRESETS)}")
    config = LlamaConfig(**PRESETS[name])
    arch = ModelArch.from_hf(config)
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * 0.02

    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    ones = torch.ones(h, device=device, dtype=dtype)
    weights = {"model.embed_tokens.weight": normal(arch.vocab_size, h), "model.norm.weight": ones}
    if not arch.tie_word_embeddings:
        weights["lm_head.weight"] = normal(arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "input_layernorm.weight": ones,
                p + "post_attention_layernorm.weight": ones,
                p + "self_attn.q_proj.weight": normal(q, h),
                p + "self_attn.k_proj.weight": normal(kv, h),
                p + "self_attn.v_proj.weight": normal(kv, h),
                p + "self_attn.o_proj.weight": normal(h, q),
                p + "mlp.gate_proj.weight": normal(arch.intermediate_size, h),
                p + "mlp.up_proj.weight": normal(arch.intermediate_size, h),
                p + "mlp.down_proj.weight": normal(h, arch.intermediate_size),
            }
        )
    return Checkpoint(path=None, hf_config=config, weights=weights)
