"""GGUF blocks for the decode rows (runtime/model/gguf_blocks.py, EngineConfig.gguf_blocks), on
both registry models (SmolLM2's Q4_1 file and Gemma 3's Q4_K_M): the block rows of every
projection and of the tied LM head's embedding, named (and q/k-unpermuted for llama), dequantize
to exactly the converted folder's weights; an engine decoding on them generates what the
default engine does (path (a) of csrc/quant_gemm.cpp differs only in fp32 summation order); a
GPU device is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from pydantic import ValidationError

from runtime.config import EngineConfig
from runtime.model.gguf_blocks import PROJECTIONS, model_blocks, read_blocks, source_gguf
from runtime.model.loader import CheckpointError, load_config
from runtime.model.native.kernels import load_cpu_kernels, native_flash_supported
from runtime.model.registry import DEFAULT_MODEL, resolve_model

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


# the registry's GGUFs: SmolLM2's Q4_1 (projections Q4_1, embedding Q8_0) and Gemma 3's Q4_K_M
# (projections Q5_0 / Q8_0 / Q4_K / Q6_K, embedding Q8_0: 262,144 x 640, the largest weight)
MODELS = [DEFAULT_MODEL, "gemma3-270m"]


def model_files(name: str):
    """The model's converted folder and its GGUF (resolving it fetches both into the cache)."""
    folder = resolve_model(name)
    path = source_gguf(name)
    assert path is not None, f"{name}'s GGUF file is not in the cache"
    return folder, path


def linears_of(model) -> list:
    layers = model.layers
    linears = [layer[k] for layer in layers for k in ("qkv", "o")]
    linears += [f for layer in layers for f in (layer["mlp"].gate_up, layer["mlp"].down)]
    return [*linears, model.lm_head]


@pytest.mark.parametrize("name", MODELS)
def test_blocks_dequantize_to_the_converted_weights(name):
    from safetensors.torch import load_file

    folder, path = model_files(name)
    weights = {}
    for shard in folder.glob("*.safetensors"):
        weights.update(load_file(shard))
    blocks = read_blocks(path)
    num_layers = load_config(folder).num_hidden_layers
    # every projection of every layer, and the token embedding the tied LM head reads
    assert len(blocks) == num_layers * len(PROJECTIONS) + 1
    assert "model.embed_tokens.weight" in blocks
    for tensor_name, (rows, ggml_type) in blocks.items():
        assert rows.dtype == torch.uint8
        w = dequantize(rows.numpy(), GGMLQuantizationType(ggml_type))
        assert np.array_equal(w, weights[tensor_name].float().numpy()), tensor_name


def generate(name: str, **settings):
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    sampling = SamplingParams(
        temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=5
    )
    config = EngineConfig(model=name, max_kv_tokens=4096, **settings)
    with Engine(config) as engine:
        linears = linears_of(engine.runner.model)
        on_blocks = sum(linear.quant is not None for linear in linears)
        assert on_blocks == (0 if config.gguf_blocks is False else len(linears))
        return engine.generate([GenerateRequest(text=p, sampling=sampling) for p in PROMPTS])


@pytest.mark.skipif(not native_flash_supported(), reason="the native kernels are not built here")
@pytest.mark.parametrize("name", MODELS)
def test_an_engine_on_blocks_generates_what_the_default_one_does(name):
    if not load_cpu_kernels().quant_gemm_supported():
        pytest.skip("this CPU has no AVX-512 BF16 + VNNI")
    model_files(name)
    plain = generate(name, gguf_blocks=False)
    on_blocks = generate(name)  # the default: a GGUF model's decode rows run on its blocks
    same = sum(a.output_ids == b.output_ids for a, b in zip(plain, on_blocks, strict=True))
    print(f"{name}: identical greedy continuations: {same}/{len(PROMPTS)}")
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
