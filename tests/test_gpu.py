"""The GPU path. On CPU: backend selection, random-weight models, the bench's floor
arithmetic. On CUDA (tests marked gpu): flashinfer against the torch reference."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

from runtime.model.attention import choose_backend

ROOT = pathlib.Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def load_bench():
    spec = importlib.util.spec_from_file_location(
        "gpu_bench", ROOT / "examples/benchmarks/gpu_bench.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_auto_backend_selection():
    assert choose_backend("cuda", flashinfer_importable=True) == "flashinfer"
    assert choose_backend("cuda", flashinfer_importable=False) == "torch"  # the GPU fallback
    assert choose_backend("cpu", flashinfer_importable=True) == "cpu"


def test_floor_arithmetic_for_llama3_8b():
    shapes = load_bench().llama3_8b_shapes()
    assert 8.0e9 < shapes.num_params < 8.1e9  # Llama-3-8B: 8.03 B parameters
    assert shapes.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB
    floor = shapes.decode_floor_s(batch=1, context_len=1024, bandwidth_bytes_s=4.8e12)
    assert floor == pytest.approx((shapes.weight_bytes + 1024 * 131072) / 4.8e12)


def test_random_weight_engine_runs_on_cpu():
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    with Engine(EngineConfig(model="random:tiny", max_kv_tokens=1024)) as engine:
        (result,) = engine.generate(
            [
                GenerateRequest(
                    input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=5, ignore_eos=True)
                )
            ]
        )
        assert result.completion_tokens == 5
        assert engine.stats()["attention_backend"] in ("cpu", "torch")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", ["prefill", "extend", "decode", "mixed"])
def test_flashinfer_matches_torch_reference(case):
    from runtime.cache.allocator import SlotAllocator
    from runtime.config import EngineConfig
    from runtime.model.arch import ModelArch
    from runtime.model.batch import ForwardBatch
    from runtime.model.random_weights import random_checkpoint
    from runtime.model.runner import ModelRunner

    checkpoint = random_checkpoint("random:smollm2-135m", torch.bfloat16, "cuda")  # head_dim 64
    arch = ModelArch.from_hf(checkpoint.hf_config)
    runners = {
        name: ModelRunner(
            arch,
            checkpoint.weights,
            4096,
            EngineConfig(dtype="bfloat16", device="cuda", attention_backend=name, page_size=16),
        )
        for name in ("torch", "flashinfer")
    }
    seqs = {
        "prefill": [(0, 100)],
        "extend": [(48, 80)],
        "decode": [(63, 64), (32, 33)],
        "mixed": [(0, 40), (64, 90), (31, 32), (95, 96)],
    }[case]
    outputs = {}
    for name, runner in runners.items():
        alloc = SlotAllocator(4096, 16)
        slots = [alloc.alloc(-(-total // 16) * 16)[:total] for _, total in seqs]
        ids = [list(range(7, 7 + total)) for _, total in seqs]
        for (cached, _), s, tokens in zip(seqs, slots, ids, strict=True):
            if cached:
                runner.forward(ForwardBatch.build([tokens[:cached]], [s[:cached]]))
        batch = ForwardBatch.build(
            [t[c:] for (c, _), t in zip(seqs, ids, strict=True)],
            slots,
            all_logits=[True] * len(seqs),
        )
        outputs[name] = runner.forward(batch)
    assert (outputs["torch"] - outputs["flashinfer"]).abs().max() < 5e-2
