"""The fused decode layers (csrc/decode_layers.cpp, runtime/model/fused_decode.py): a decode step
run as one native call computes what the layer-by-layer forward does, bit for bit (the same
kernels in the same order), on the default model's GGUF blocks and on panel weights, batch-1 and
batched, with and without batch invariance; models of another shape keep the layer loop."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.cache.allocator import SlotAllocator
from runtime.config import EngineConfig
from runtime.engine_build import load_model
from runtime.model.arch import ModelArch
from runtime.model.batch import ForwardBatch
from runtime.model.fused_decode import FusedDecoder, NoFusedDecoder, fused_decoder
from runtime.model.native.kernels import load_cpu_kernels, native_flash_supported
from runtime.model.registry import DEFAULT_MODEL

pytestmark = pytest.mark.skipif(
    not native_flash_supported(), reason="the native kernels are not built here"
)

NEW_TOKENS = 12


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Token ids of different lengths, away from the vocabulary's special tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(9 + 7 * i)] for i in range(count)]


def decode_logits(runner, prompt_ids: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Each forward's logits: the prompts prefilled in one batch, then greedy decodes of all
    of them together (the same batches every time: no scheduler, no timing)."""
    allocator = SlotAllocator(runner.pool.num_slots)
    slots = [allocator.alloc(len(p)) for p in prompt_ids]
    new_tokens = [list(p) for p in prompt_ids]
    out = []
    for _ in range(steps):
        logits = runner.forward(ForwardBatch.build(new_tokens, slots))
        out.append(logits)
        new_tokens = [[t] for t in logits.argmax(-1).tolist()]
        slots = [torch.cat([s, allocator.alloc(1)]) for s in slots]
    return out


CASES = [
    pytest.param(DEFAULT_MODEL, {"dtype": "bfloat16"}, id="default-model-blocks-bf16"),
    pytest.param(DEFAULT_MODEL, {"dtype": "float32"}, id="default-model-blocks-fp32"),
    pytest.param("head64", {"dtype": "bfloat16"}, id="tiny-panels-bf16"),
    pytest.param("head64", {"dtype": "float32", "batch_invariant": True}, id="tiny-invariant"),
    pytest.param(
        "head64",
        {"dtype": "bfloat16", "quantize": "q8_0", "quantize_activations": True},
        id="tiny-q8_0-int8-activations",
    ),
]


@pytest.mark.parametrize(("model", "settings"), CASES)
@pytest.mark.parametrize("batch", [1, 4])
def test_fused_decode_computes_what_the_layer_loop_does(
    model, settings, batch, head_dim_64_model_dir
):
    blocks = model == DEFAULT_MODEL or "quantize" in settings
    if blocks and not load_cpu_kernels().quant_gemm_supported():
        pytest.skip("this CPU has no AVX-512 BF16 + VNNI for the GGUF blocks")
    model = str(head_dim_64_model_dir) if model == "head64" else model
    runner = load_model(EngineConfig(model=model, max_kv_tokens=4096, **settings)).runner
    fused = runner.model.fused
    assert isinstance(fused, FusedDecoder)
    ids = prompts(batch)
    with_fused = decode_logits(runner, ids, NEW_TOKENS)
    # every decode forward; a short prefill's rows are paged decodes too, and fused where its
    # rows take the panel or blocks (batch 1: 9 rows; with int8 activations every row does)
    prefill_fused = batch == 1 or settings.get("quantize_activations", False)
    assert fused.num_steps == NEW_TOKENS - 1 + prefill_fused
    runner.model.fused = NoFusedDecoder()
    layer_by_layer = decode_logits(runner, ids, NEW_TOKENS)
    for a, b in zip(with_fused, layer_by_layer, strict=True):
        assert torch.equal(a, b)  # bit for bit: the same kernels in the same order


def test_a_shared_prefix_keeps_the_layer_loop(head_dim_64_model_dir):
    """Decodes behind a shared cached prefix attend it once (the cascade): not a step the fused
    layers take."""
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    prefix = prompts(1, seed=1)[0] * 8  # 72 tokens, beyond the cascade's 64
    sampling = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    config = EngineConfig(model=str(head_dim_64_model_dir), max_kv_tokens=4096)
    with Engine(config) as engine:
        engine.generate([GenerateRequest(input_ids=prefix, sampling=sampling)])  # cached
        fused_before = engine.runner.model.fused.num_steps
        requests = [GenerateRequest(input_ids=prefix + p, sampling=sampling) for p in prompts(4)]
        engine.generate(requests)
        assert engine.runner.attention.cascade_passes > 0
        assert engine.runner.model.fused.num_steps == fused_before


@pytest.mark.parametrize(
    ("kind", "why"),
    [("qwen2", "q/k/v biases"), ("qwen3", "q/k norms and windows"), ("gemma3", "Gemma's norms")],
)
def test_models_of_another_shape_keep_the_layer_loop(kind, why):
    from conftest import tiny_hf_model

    from runtime.model.llama import LlamaModel

    hf = tiny_hf_model(kind)
    arch = ModelArch.from_hf(hf.config)
    weights = {k: v.detach() for k, v in hf.state_dict().items()}
    model = LlamaModel(arch, weights)
    assert isinstance(model.fused, NoFusedDecoder), why


def test_a_llama_on_native_kernels_is_fused(tiny_model_dir):
    from runtime.model.llama import LlamaModel
    from runtime.model.loader import load_checkpoint

    checkpoint = load_checkpoint(tiny_model_dir)
    arch = ModelArch.from_hf(checkpoint.hf_config)
    model = LlamaModel(arch, checkpoint.weights, torch.float32)
    assert isinstance(model.fused, FusedDecoder) == load_cpu_kernels().panel_gemm_supported()
    assert isinstance(fused_decoder(arch, model.ops, model.layers), type(model.fused))
