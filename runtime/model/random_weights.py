"""Random-weight checkpoints from a config, for benchmarking without downloads.

`EngineConfig(model="random:llama-3-8b", device="cuda", dtype="bfloat16")` builds Llama-3-8B
shapes with weights drawn on the target device (nothing large ever sits in host memory).
Outputs are meaningless; use fixed lengths (ignore_eos) and token-id prompts.
"""

from __future__ import annotations

import torch

from runtime.model.arch import ModelArch
from runtime.model.loader import Checkpoint

# name: (hidden, MLP, layers, query heads, KV heads, vocab, context, RoPE theta, tied, eos)
_SHAPES = {
    "llama-3-8b": (4096, 14336, 32, 32, 8, 128256, 8192, 500000.0, False, 128009),
    # Llama-3's attention shapes (head_dim 128, 4 query heads per KV head) in 4 small layers:
    # the GPU tests run the same attention kernels as the 8B bench
    "llama-3-small": (1024, 2048, 4, 8, 2, 32000, 4096, 500000.0, False, 2),
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152, 8192, 100000.0, True, 2),
    "tiny": (64, 128, 2, 4, 2, 512, 2048, 10000.0, False, 2),
}


def _llama_config(
    hidden: int,
    mlp: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    context_tokens: int,
    rope_theta: float,
    tied: bool,
    eos: int,
) -> dict:
    """LlamaConfig's fields for one row of _SHAPES; what every preset shares is set here."""
    return dict(
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=context_tokens,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=tied,
        eos_token_id=eos,
    )


PRESETS = {name: _llama_config(*shape) for name, shape in _SHAPES.items()}


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
