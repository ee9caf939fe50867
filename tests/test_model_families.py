"""Each newer family end to end through the engine: greedy tokens equal transformers' generate,
and the radix cache shares prefixes (prefill computed once). Logit parity per forward shape
(prefill, extends at random splits, decodes, mixed batches, both backends) is in
test_model_parity.py, whose FAMILIES list includes these."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf_model

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.model.arch import ModelArch
from runtime.protocol import GenerateRequest, SamplingParams

FAMILIES = ["qwen3", "phi3", "phi3-longrope", "mixtral", "qwen3-moe", "gemma2", "gemma3"]
GREEDY16 = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)


def saved_model(kind: str, folder) -> torch.nn.Module:
    """A tiny model of `kind` with sharp logits (init 0.1), saved as a safetensors folder."""
    hf = tiny_hf_model(kind, initializer_range=0.1)
    hf.save_pretrained(folder)
    return hf


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_sixteen_tokens_equal_transformers(kind, backend, tmp_path):
    hf = saved_model(kind, tmp_path)
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((9, 30, 44))]
    hf.generation_config.eos_token_id = None  # as ignore_eos: never stop, never mask eos
    with torch.no_grad():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :]
            for p in prompts
        ]
    config = EngineConfig(model=str(tmp_path), max_kv_tokens=4096, attention_backend=backend)
    with Engine(config) as engine:
        results = engine.generate(
            [GenerateRequest(input_ids=p, sampling=GREEDY16) for p in prompts]
        )
    assert [r.output_ids for r in results] == [e.tolist() for e in expected]


@pytest.mark.parametrize("kind", FAMILIES)
def test_radix_cache_shares_prefixes(kind, tmp_path):
    """Two requests share a 40-token prefix: the second computes only its own 25 tokens."""
    saved_model(kind, tmp_path)
    shared = [(11 * j) % 500 + 5 for j in range(40)]
    first, second = shared + list(range(100, 120)), shared + list(range(200, 225))
    one = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    with Engine(EngineConfig(model=str(tmp_path), max_kv_tokens=4096)) as engine:
        engine.generate([GenerateRequest(input_ids=first, sampling=one)])
        assert engine.stats()["prefill_tokens_total"] == len(first)
        (result,) = engine.generate([GenerateRequest(input_ids=second, sampling=one)])
        assert result.cached_tokens == len(shared)
        assert engine.stats()["prefill_tokens_total"] == len(first) + 25


def test_family_switches_are_read_from_the_config():
    qwen3 = ModelArch.from_hf(tiny_hf_model("qwen3").config)
    assert qwen3.qk_norm and not qwen3.qkv_bias
    assert qwen3.sliding_windows == (None, 24, 24)  # use_sliding_window from layer 1 on
    phi3 = ModelArch.from_hf(tiny_hf_model("phi3-longrope").config)
    inv_freq, scale = phi3.rope_inv_freq()
    assert inv_freq.numel() == phi3.head_dim // 4  # partial_rotary_factor 0.5
    assert scale > 1.0  # longrope's attention factor
    assert phi3.max_context_len == 128  # short factors only: capped at the pretraining length


def test_qk_norm_matters():
    """Scaling Qwen3's q norm weights changes the logits (the switch is really on)."""
    from runtime.cache.allocator import SlotAllocator
    from runtime.model.batch import ForwardBatch
    from runtime.model.runner import ModelRunner

    hf = tiny_hf_model("qwen3")
    arch = ModelArch.from_hf(hf.config)
    weights = hf.state_dict()
    ids = list(range(5, 35))

    def logits(w):
        runner = ModelRunner(arch, w, 64, EngineConfig(attention_backend="torch"))
        return runner.forward(ForwardBatch.build([ids], [SlotAllocator(64).alloc(30)]))

    scaled = {k: v * 3 if "q_norm" in k else v for k, v in weights.items()}
    assert (logits(weights) - logits(scaled)).abs().max() > 1e-3


@pytest.mark.parametrize("layout", ["mixtral-w123", "per-expert"])
def test_hub_expert_layouts_load_like_the_fused_one(layout):
    """Checkpoints on the hub store one tensor per expert (Mixtral w1/w3/w2 under
    block_sparse_moe, Qwen3-MoE gate/up/down_proj); they load to the same logits."""
    from runtime.cache.allocator import SlotAllocator
    from runtime.model.batch import ForwardBatch
    from runtime.model.runner import ModelRunner

    hf = tiny_hf_model("mixtral")
    arch = ModelArch.from_hf(hf.config)
    fused, split = hf.state_dict(), {}
    inter = arch.intermediate_size
    block, (gate, up, down) = (
        ("block_sparse_moe", ("w1", "w3", "w2"))
        if layout == "mixtral-w123"
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    for name, tensor in fused.items():
        prefix = name.split(".mlp.")[0] + f".{block}."
        if name.endswith("experts.gate_up_proj"):
            for e in range(arch.num_experts):
                split[f"{prefix}experts.{e}.{gate}.weight"] = tensor[e, :inter]
                split[f"{prefix}experts.{e}.{up}.weight"] = tensor[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(arch.num_experts):
                split[f"{prefix}experts.{e}.{down}.weight"] = tensor[e]
        elif name.endswith("mlp.gate.weight"):
            split[prefix + "gate.weight"] = tensor
        else:
            split[name] = tensor
    ids = list(range(5, 40))

    def logits(weights):
        runner = ModelRunner(arch, weights, 64, EngineConfig(attention_backend="torch"))
        return runner.forward(ForwardBatch.build([ids], [SlotAllocator(64).alloc(35)]))

    assert torch.equal(logits(fused), logits(split))


def test_gemma_switches_are_read_from_the_config_and_matter():
    """Each Gemma piece is on, and turning any one off breaks parity with transformers (so the
    parity tests would catch it missing)."""
    import dataclasses

    from runtime.cache.allocator import SlotAllocator
    from runtime.model.batch import ForwardBatch
    from runtime.model.runner import ModelRunner

    gemma2 = tiny_hf_model("gemma2")
    arch2 = ModelArch.from_hf(gemma2.config)
    assert arch2.gemma_norms and arch2.hidden_act == "gelu_pytorch_tanh"
    assert arch2.embed_scale == 64**0.5 and arch2.query_scale == 24**-0.5
    assert (arch2.attn_softcap, arch2.final_softcap) == (2.0, 3.0)
    assert arch2.sliding_windows == (24, None, 24, None)
    gemma3 = tiny_hf_model("gemma3")
    arch3 = ModelArch.from_hf(gemma3.config)
    assert arch3.qk_norm and arch3.attn_softcap is None and arch3.final_softcap is None
    assert arch3.rope_layer_types[2] == "full_attention"
    local, _ = arch3.rope_inv_freq("sliding_attention")
    full, full_scale = arch3.rope_inv_freq("full_attention")
    assert torch.allclose(full, 1.0 / (1e6 ** (torch.arange(0, 16, 2) / 16)) / 2.0)  # linear x2
    assert not torch.allclose(local, full) and full_scale == 1.0

    ids = [(5 * j) % 500 + 3 for j in range(40)]  # longer than the window

    def max_error(hf, arch) -> float:
        runner = ModelRunner(arch, hf.state_dict(), 256, EngineConfig(attention_backend="torch"))
        slots = SlotAllocator(256).alloc(len(ids))
        batch = ForwardBatch.build([ids], [slots], all_logits=[True])
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]
        return (runner.forward(batch) - expected).abs().max().item()

    assert max_error(gemma2, arch2) < 1e-4 and max_error(gemma3, arch3) < 1e-4
    for hf, arch, change in [
        (gemma2, arch2, dict(attn_softcap=None)),
        (gemma2, arch2, dict(final_softcap=None)),
        (gemma2, arch2, dict(query_scale=None)),
        (gemma2, arch2, dict(embed_scale=1.0)),
        (gemma2, arch2, dict(sliding_windows=(None,) * 4)),
        (gemma3, arch3, dict(rope_layer_types=("sliding_attention",) * 4)),
        (gemma3, arch3, dict(hidden_act="silu")),
    ]:
        assert max_error(hf, dataclasses.replace(arch, **change)) > 1e-3, change
