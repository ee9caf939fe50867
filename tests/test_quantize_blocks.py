"""Checkpoints quantized to GGUF blocks at load (EngineConfig.quantize,
runtime/model/quantize_blocks.py): each quantized weight becomes exactly its blocks'
dequantization (so prefill and decode compute with the same values), within the type's rounding
of the original; decoding on the blocks gives what the dequantized weights give; the setting is
refused where it would not apply, and a tensor that cannot be quantized is named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from pydantic import ValidationError

from runtime.config import QUANTIZE_TYPES, EngineConfig
from runtime.engine_build import load_model, weights_identity
from runtime.model.arch import ModelArch
from runtime.model.loader import CheckpointError, load_checkpoint
from runtime.model.native.kernels import load_cpu_kernels, native_flash_supported
from runtime.model.quantize_blocks import quantize_checkpoint, quantized_names

needs_block_gemm = pytest.mark.skipif(
    not native_flash_supported() or not load_cpu_kernels().quant_gemm_supported(),
    reason="this CPU has no AVX-512 BF16 + VNNI for the block GEMM",
)
# the largest rounding a block type makes, relative to its block's largest |weight|
RELATIVE_ROUNDING = {"q8_0": 1 / 127, "q5_0": 1 / 15, "q4_1": 1 / 15, "q4_0": 1 / 7}


@needs_block_gemm
@pytest.mark.parametrize("kind", QUANTIZE_TYPES)
def test_weights_become_their_blocks_dequantization(kind, head_dim_64_model_dir):
    checkpoint = load_checkpoint(head_dim_64_model_dir)
    arch = ModelArch.from_hf(checkpoint.hf_config)
    original = {k: v.clone() for k, v in checkpoint.weights.items()}
    blocks = quantize_checkpoint(
        checkpoint.weights, arch.num_layers, arch.tie_word_embeddings, kind
    )
    names = quantized_names(original, arch.num_layers, arch.tie_word_embeddings)
    assert set(blocks) == set(names)
    assert len(names) == arch.num_layers * 7 + 1  # 7 projections a layer, and the head
    for name in names:
        raw, ggml_type = blocks[name]
        exact = dequantize(raw.numpy(), GGMLQuantizationType(ggml_type))
        assert np.array_equal(checkpoint.weights[name].numpy(), exact), name
        w = original[name].float()
        scale = w.reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True)
        error = (checkpoint.weights[name] - w).reshape(scale.shape[0], -1, 32).abs()
        assert bool((error <= scale * RELATIVE_ROUNDING[kind] * 1.01 + 1e-6).all()), name
    for name in set(original) - set(names):  # norms and the like: untouched
        assert torch.equal(checkpoint.weights[name], original[name])


def greedy(runner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    from static_generate import generate

    from runtime.protocol import SamplingParams

    states = generate(runner, prompts, SamplingParams(temperature=0, max_new_tokens=steps))
    return [s.output_ids for s in states]


@needs_block_gemm
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_an_engine_on_quantized_blocks_decodes_as_its_dequantized_weights(
    kind, head_dim_64_model_dir
):
    """fp32: the block GEMM keeps the activations exact, so decoding on the blocks differs from
    the panel GEMM over their dequantization only in summation order."""
    from runtime.model.runner import ModelRunner

    config = EngineConfig(model=str(head_dim_64_model_dir), quantize=kind, max_kv_tokens=4096)
    quantized = load_model(config).runner
    linears = quantized.model.linears()
    assert all(linear.quant is not None for linear in linears)
    # the reference: the same dequantized weights, no blocks
    checkpoint = load_checkpoint(head_dim_64_model_dir)
    arch = ModelArch.from_hf(checkpoint.hf_config)
    quantize_checkpoint(checkpoint.weights, arch.num_layers, arch.tie_word_embeddings, kind)
    reference = ModelRunner(arch, checkpoint.weights, 4096, EngineConfig(max_kv_tokens=4096))
    assert all(linear.quant is None for linear in reference.model.linears())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1000, 40000, size=8 + 5 * i).tolist() for i in range(6)]
    ours, theirs = greedy(quantized, prompts, 16), greedy(reference, prompts, 16)
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    assert same >= 0.9 * len(prompts), f"{same}/{len(prompts)} identical"


def test_quantize_is_refused_where_it_cannot_apply():
    with pytest.raises(ValidationError, match="unknown quantize 'q4_k'"):
        EngineConfig(quantize="q4_k")
    with pytest.raises(ValidationError, match="quantize runs on the CPU only"):
        EngineConfig(quantize="q8_0", device="cuda")
    with pytest.raises(ValidationError, match="choose one"):
        EngineConfig(quantize="q8_0", gguf_blocks=True)


@needs_block_gemm
def test_a_tensor_that_is_not_whole_blocks_is_named():
    weights = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 48),  # 48: not whole blocks
        "model.embed_tokens.weight": torch.randn(100, 64),
    }
    with pytest.raises(CheckpointError, match=r"q_proj\.weight \(64, 48\)"):
        quantize_checkpoint(weights, 1, True, "q8_0")


def test_quantized_weights_name_their_own_kv_on_disk():
    plain = EngineConfig(model="random:tiny")
    quantized = EngineConfig(model="random:tiny", quantize="q8_0")
    assert weights_identity(plain, None) != weights_identity(quantized, None)


def first_logits(runner, prompts: list[list[int]]) -> torch.Tensor:
    from runtime.cache.allocator import SlotAllocator
    from runtime.model.batch import ForwardBatch

    allocator = SlotAllocator(runner.pool.num_slots)
    slots = [allocator.alloc(len(p)) for p in prompts]
    return runner.forward(ForwardBatch.build(prompts, slots))


@needs_block_gemm
def test_int8_activations_move_the_logits_by_their_rounding_and_take_every_row(
    head_dim_64_model_dir,
):
    """quantize_activations: every Linear on blocks rounds its activations to int8 per block
    (llama.cpp's Q8_0 activations) and takes every row, a prefill's too; the logits move by
    that rounding (~0.5% of a projection's output), not more."""
    model = str(head_dim_64_model_dir)
    exact = load_model(EngineConfig(model=model, quantize="q8_0", max_kv_tokens=4096)).runner
    config = EngineConfig(
        model=model, quantize="q8_0", quantize_activations=True, max_kv_tokens=4096
    )
    rounded = load_model(config).runner
    assert all(linear.block_quantize_x for linear in rounded.model.linears())
    assert all(linear.takes_panel(512) for linear in rounded.model.linears())  # prefill too
    assert not exact.model.linears()[1].takes_panel(512)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1000, 40000, size=40 + 9 * i).tolist() for i in range(4)]
    a, b = first_logits(exact, prompts), first_logits(rounded, prompts)
    assert not torch.equal(a, b)  # the activations were rounded
    relative = (a - b).norm() / a.norm()
    assert relative < 0.05, f"logits moved by {relative:.2%}"


def test_int8_activations_are_refused_without_blocks(tiny_model_dir):
    with pytest.raises(ValidationError, match="quantize_activations rounds the activations"):
        EngineConfig(quantize_activations=True, gguf_blocks=False)
    with pytest.raises(ValidationError, match="quantize_activations rounds the activations"):
        EngineConfig(quantize_activations=True, device="cuda")
    from runtime.errors import UsageError

    config = EngineConfig(model=str(tiny_model_dir), quantize_activations=True, max_kv_tokens=512)
    with pytest.raises(UsageError, match="quantize_activations: no weights on GGUF blocks"):
        load_model(config)


def test_int8_activations_name_their_own_kv_on_disk():
    quantized = EngineConfig(model="random:tiny", quantize="q8_0")
    rounded = EngineConfig(model="random:tiny", quantize="q8_0", quantize_activations=True)
    assert weights_identity(quantized, None) != weights_identity(rounded, None)
