"""GGUF blocks for the decode rows (runtime/model/gguf_blocks.py, EngineConfig.gguf_blocks): the
default model's block rows, named and q/k-unpermuted, dequantize to exactly the converted
folder's weights; an engine decoding on them generates what the default engine does (path (a)
of csrc/quant_gemm.cpp differs only in fp32 summation order); a GPU device is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from pydantic import ValidationError

from runtime.config import EngineConfig
from runtime.model.gguf_blocks import PROJECTIONS, model_blocks, read_blocks, source_gguf
from runtime.model.loader import CheckpointError
from runtime.model.native.kernels import load_cpu_kernels, native_flash_supported
from runtime.model.registry import DEFAULT_MODEL

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Explain photosynthesis in one sentence.",
    "1, 1, 2, 3, 5, 8,",
    "My favourite programming language is",
    "To make a cup of tea, first",
    "The quick brown fox",
]
NEW_TOKENS = 24
LOGPROB_ATOL = 1e-3  # fp32 summation order over 30 layers; observed far below


@pytest.fixture(scope="module")
def gguf_path(default_model_path):
    path = source_gguf(DEFAULT_MODEL)
    # resolving the default model (the fixture) downloads its GGUF into the cache, so it is here
    assert path is not None, "the default model's GGUF file is not in the cache"
    return path


def test_blocks_dequantize_to_the_converted_weights(gguf_path, default_model_path):
    from safetensors.torch import load_file

    weights = load_file(default_model_path / "model.safetensors")
    blocks = read_blocks(gguf_path)
    assert len(blocks) == 30 * len(PROJECTIONS)  # every projection of every layer
    for name, (rows, ggml_type) in blocks.items():
        assert rows.dtype == torch.uint8
        w = dequantize(rows.numpy(), GGMLQuantizationType(ggml_type))
        assert np.array_equal(w, weights[name].numpy()), name


def generate(default_model_path, **settings):
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    sampling = SamplingParams(
        temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    config = EngineConfig(model=DEFAULT_MODEL, max_kv_tokens=4096, **settings)
    with Engine(config) as engine:
        layers = engine.runner.model.layers
        linears = [layer[k] for layer in layers for k in ("qkv", "o")]
        linears += [f for layer in layers for f in (layer["mlp"].gate_up, layer["mlp"].down)]
        on_blocks = sum(linear.quant is not None for linear in linears)
        assert on_blocks == (len(linears) if config.gguf_blocks else 0)
        return engine.generate([GenerateRequest(text=p, sampling=sampling) for p in PROMPTS])


@pytest.mark.skipif(not native_flash_supported(), reason="the native kernels are not built here")
def test_an_engine_on_blocks_generates_what_the_default_one_does(default_model_path, gguf_path):
    if not load_cpu_kernels().quant_gemm_supported():
        pytest.skip("this CPU has no AVX-512 BF16 + VNNI")
    plain = generate(default_model_path)
    on_blocks = generate(default_model_path, gguf_blocks=True)
    same = sum(a.output_ids == b.output_ids for a, b in zip(plain, on_blocks, strict=True))
    print(f"identical greedy continuations: {same}/{len(PROMPTS)}")
    assert same >= 0.9 * len(PROMPTS)
    for a, b in zip(plain, on_blocks, strict=True):
        # step 2: the first decode forward (10 rows: the block GEMM), same inputs in both
        top_a, top_b = dict(a.logprobs[1].top), dict(b.logprobs[1].top)
        for token in top_a.keys() & top_b.keys():
            assert abs(top_a[token] - top_b[token]) <= LOGPROB_ATOL


def test_gguf_blocks_on_a_gpu_is_refused():
    with pytest.raises(ValidationError, match="gguf_blocks runs on the CPU only"):
        EngineConfig(gguf_blocks=True, device="cuda")


def test_gguf_blocks_on_a_model_without_a_gguf_is_refused(tiny_model_dir):
    """A folder model has no blocks to read: the setting would change nothing, so it is an
    error naming the model, not a silent no-op."""
    with pytest.raises(CheckpointError, match="gguf_blocks needs a GGUF model"):
        model_blocks(str(tiny_model_dir))
