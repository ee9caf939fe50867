"""The architectures this engine runs and the registry, as `flowlang models` prints them.

Torch-free on purpose: listing models must not pay for importing torch.
"""

from __future__ import annotations

# transformers `model_type` -> what runs on it (runtime/model/llama.py implements them all)
FAMILIES: dict[str, str] = {
    "llama": "Llama 2/3/3.1/3.2, SmolLM2 (RoPE: default, linear, llama3, yarn)",
    "mistral": "Mistral (sliding-window attention on every layer)",
    "qwen2": "Qwen2/2.5 (q/k/v bias)",
    "qwen3": "Qwen3 dense (per-head q/k RMSNorm, optional sliding-window layers)",
    "phi3": "Phi-3/3.5/4-mini (fused qkv and gate/up; default or longrope, partial rotary)",
    "mixtral": "Mixtral-style MoE (top-k router, expert MLPs; plain batched experts)",
    "qwen3_moe": "Qwen3-MoE (q/k RMSNorm, top-k experts, dense mlp_only_layers)",
    "gemma2": "Gemma 2 (sliding/global layers, attention and final logit soft-capping, GeGLU)",
    "gemma3_text": "Gemma 3 text (sliding/global layers with their own RoPE bases, q/k norms)",
}


def describe_models() -> str:
    """A readable table of supported architectures, registry names and hub usage."""
    from runtime.model.registry import MODELS, cache_dir

    width = max(map(len, FAMILIES))
    lines = ["Supported architectures (config.json model_type):"]
    lines += [f"  {name:<{width}}  {what}" for name, what in FAMILIES.items()]
    lines += ["", f"Registry names (converted once into {cache_dir() / 'models'}):"]
    name_width = max(len(name) for name in MODELS)
    lines += [f"  {e.name:<{name_width}}  {e.description}" for e in MODELS.values()]
    lines += [
        "",
        "Any other --model is a local folder (config.json + *.safetensors), a .gguf file, or a",
        "Hugging Face hub id such as Qwen/Qwen3-0.6B[@revision] (safetensors only; honours",
        "HF_HOME/HF_HUB_CACHE, HF_HUB_OFFLINE and HF_TOKEN).",
    ]
    return "\n".join(lines)
