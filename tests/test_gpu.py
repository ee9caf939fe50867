"""The GPU path. On CPU: backend selection, random-weight models, the bench's floor
arithmetic. On CUDA (tests marked gpu, skipped without a device): flashinfer against the torch
reference, decode graphs against eager, the fused pointwise kernels, sampling on the device,
speculative decoding, Gemma 2 and 3 against transformers, the host KV tier."""

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


def agree_until_near_ties(results, reference) -> None:
    """Greedy tokens agree with the reference's until the first step where its top two
    logprobs tie within bf16 noise (contexts differ after it), and on most tokens overall."""
    compared = agreed = 0
    for got_result, want_result in zip(results, reference, strict=True):
        for got, want, logprob in zip(
            got_result.output_ids, want_result.output_ids, want_result.logprobs, strict=True
        ):
            compared += 1
            if got != want:
                (_, first), (_, second) = logprob.top[:2]
                assert first - second < 0.1, "the outputs differ at a clear choice"
                break
            agreed += 1
    assert agreed >= 0.8 * compared


def device_engine_config(**settings):
    """The engine the device tests share: a random-weight Llama-3 shape in bf16 on the GPU."""
    from runtime.config import EngineConfig

    return EngineConfig(
        model="random:llama-3-small",
        device="cuda",
        dtype="bfloat16",
        max_kv_tokens=8192,
        page_size=16,
        **settings,
    )


def test_auto_backend_selection():
    assert choose_backend("cuda", flashinfer_importable=True) == "flashinfer"
    assert choose_backend("cuda", flashinfer_importable=False) == "torch"  # the GPU fallback
    assert choose_backend("cpu", flashinfer_importable=True) == "cpu"


def test_floor_arithmetic_for_llama3_8b():
    shapes = load_bench().llama3_8b_shapes()
    assert 8.0e9 < shapes.num_params < 8.1e9  # Llama-3-8B: 8.03 B parameters
    assert shapes.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert shapes.vocab_params == 128256 * 4096
    floor = shapes.decode_floor_s(batch=1, context_len=1024, bandwidth_bytes_s=4.8e12)
    read = shapes.weight_bytes - 2 * shapes.vocab_params + 1024 * 131072  # all but the embedding
    assert floor == pytest.approx(read / 4.8e12)
    # 8B: ~16 GFLOP per token in the layers; the head once; attention grows with the context
    flops = shapes.prefill_flops(1, 1, num_layers=32, hidden=4096)
    assert flops == pytest.approx(2 * shapes.layer_params + 2 * shapes.vocab_params + 2 * 32 * 4096)


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


SEQS = {  # (cached tokens, total tokens) per sequence
    "prefill": [(0, 100)],
    "extend": [(48, 80)],
    "decode": [(63, 64), (32, 33)],
    "mixed": [(0, 40), (64, 90), (31, 32), (95, 96)],
}


def _runner(backend: str, page_size: int, checkpoint, **settings):
    from runtime.config import EngineConfig
    from runtime.model.arch import ModelArch
    from runtime.model.runner import ModelRunner

    config = EngineConfig(
        dtype="bfloat16", device="cuda", attention_backend=backend, page_size=page_size, **settings
    )
    return ModelRunner(ModelArch.from_hf(checkpoint.hf_config), checkpoint.weights, 4096, config)


def _run_case(runner, seqs, page_size: int):
    """Prefill each sequence's cached part, then one batch of every sequence's new tokens;
    its logits for every new token. Pages are allocated in reverse so that no sequence's
    pages are in order (the page table, not adjacency, must carry them)."""
    from runtime.cache.allocator import SlotAllocator
    from runtime.model.batch import ForwardBatch

    alloc = SlotAllocator(4096, page_size)
    slots = []
    for _, total in seqs:
        pages = alloc.alloc(-(-total // page_size) * page_size).view(-1, page_size)
        slots.append(pages.flip(0).reshape(-1)[:total])
    ids = [[7 + (13 * j) % 997 for j in range(total)] for _, total in seqs]
    for (cached, _), s, tokens in zip(seqs, slots, ids, strict=True):
        if cached:
            runner.forward(ForwardBatch.build([tokens[:cached]], [s[:cached]]))
    batch = ForwardBatch.build(
        [t[c:] for (c, _), t in zip(seqs, ids, strict=True)],
        slots,
        all_logits=[True] * len(seqs),
    )
    return runner.forward(batch)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(SEQS))
def test_flashinfer_matches_torch_reference(case, page_size):
    from runtime.model.random_weights import random_checkpoint

    checkpoint = random_checkpoint("random:llama-3-small", torch.bfloat16, "cuda")
    outputs = {
        name: _run_case(
            _runner(name, page_size, checkpoint, disable_cuda_graph=True), SEQS[case], page_size
        )
        for name in ("torch", "flashinfer")
    }
    torch_logits, fi_logits = outputs["torch"], outputs["flashinfer"]
    assert fi_logits.shape == torch_logits.shape and fi_logits.isfinite().all()
    scale = torch_logits.abs().max().item()
    assert (torch_logits - fi_logits).abs().max().item() < 3e-2 * max(1.0, scale)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_graph_logits_match_eager(page_size):
    """Teacher-forced decode steps at batch sizes that pad (3 -> 4, 6 -> 8) and one above the
    largest captured size (eager): graph logits equal eager flashinfer's within bf16 noise, and
    the greedy choice agrees wherever eager's top two are not within that noise."""
    from runtime.cache.allocator import SlotAllocator
    from runtime.model.batch import ForwardBatch
    from runtime.model.random_weights import random_checkpoint

    checkpoint = random_checkpoint("random:llama-3-small", torch.bfloat16, "cuda")
    graphs = _runner("flashinfer", page_size, checkpoint, cuda_graph_max_batch_size=8)
    eager = _runner("flashinfer", page_size, checkpoint, disable_cuda_graph=True)
    assert graphs.decode_graphs is not None and eager.decode_graphs is None
    gen = torch.Generator().manual_seed(0)
    for num_seqs in (1, 3, 6, 11):
        alloc = SlotAllocator(4096, page_size)
        lengths = torch.randint(20, 300, (num_seqs,), generator=gen).tolist()
        steps = 12
        slots = [alloc.alloc(-(-(n + steps) // page_size) * page_size) for n in lengths]
        prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in lengths]
        tokens = torch.randint(3, 32000, (num_seqs,), generator=gen).tolist()
        for runner in (graphs, eager):
            cached = [s[:n] for s, n in zip(slots, lengths, strict=True)]
            runner.forward(ForwardBatch.build(prompts, cached))
        replays = graphs.num_graph_replays
        for step in range(steps):
            upto = [s[: n + step + 1] for s, n in zip(slots, lengths, strict=True)]
            batch = ForwardBatch.build([[t] for t in tokens], upto)
            got, want = graphs.forward(batch), eager.forward(batch)
            noise = 3e-2 * max(1.0, want.abs().max().item())
            assert (got - want).abs().max().item() < noise
            top2 = want.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * noise
            assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
            tokens = want.argmax(-1).tolist()
        expected = 0 if num_seqs > 8 else steps
        assert graphs.num_graph_replays - replays == expected


@pytest.mark.gpu
@needs_cuda
def test_engine_decodes_token_for_token_with_graphs():
    """The whole engine, graphs on vs off, greedy: as requests finish the batch shrinks through
    eager (7 > 4) and padded graph sizes. Tokens agree until the first step where eager's
    top two logprobs tie within bf16 noise (after which contexts differ)."""
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    def requests():
        return [
            GenerateRequest(
                input_ids=[5 + (i * 31 + j * 7) % 30000 for j in range(40 + 23 * i)],
                sampling=SamplingParams(
                    max_new_tokens=6 + 5 * i, ignore_eos=True, logprobs=True, top_logprobs=2
                ),
            )
            for i in range(7)
        ]

    results = {}
    for graphs_on in (True, False):
        config = device_engine_config(disable_cuda_graph=not graphs_on, cuda_graph_max_batch_size=4)
        with Engine(config) as engine:
            results[graphs_on] = engine.generate(requests())
            replays = engine.stats()["cuda_graph_replays_total"]
            assert engine.stats()["attention_backend"] == "flashinfer"
            assert (replays > 0) if graphs_on else (replays == 0)
    agree_until_near_ties(results[True], results[False])


@pytest.mark.gpu
@needs_cuda
def test_speculative_decoding_on_the_device():
    """Drafts verified by flashinfer's extend kernels (graphs serve the plain decodes): greedy
    tokens agree with speculation off until a near-tie in bf16 noise, and guesses are taken."""
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    loop = [5 + (j * 7) % 40 for j in range(40)]
    reqs = [
        GenerateRequest(
            input_ids=loop * (2 + i) + loop[: 10 + i],
            sampling=SamplingParams(
                max_new_tokens=48, ignore_eos=True, logprobs=True, top_logprobs=2
            ),
        )
        for i in range(4)
    ]
    results, stats = {}, {}
    for mode in ("off", "tree"):
        config = device_engine_config(speculative=mode)
        with Engine(config) as engine:
            results[mode] = engine.generate(reqs)
            stats[mode] = engine.stats()
    assert stats["tree"]["spec_accepted_tokens_total"] > 0
    agree_until_near_ties(results["tree"], results["off"])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_fused_pointwise_ops_match_the_reference(rotary_fraction):
    """flashinfer's norm / add+norm / RoPE / SiLU-and-mul kernels against the torch reference,
    on the shapes the model gives them (q and k as strided views of the fused QKV output)."""
    from runtime.model.pointwise import FlashInferOps, RopeTables, TorchOps

    gen = torch.Generator(device="cuda").manual_seed(0)
    fused, ref = FlashInferOps(), TorchOps()
    tokens, hidden, heads, kv_heads, head_dim = 37, 1024, 8, 2, 128

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    def close(a, b, tol=2e-2):
        assert (a.float() - b.float()).abs().max().item() < tol * max(1.0, b.abs().max().item())

    x, residual, weight = randn(tokens, hidden), randn(tokens, hidden), 1 + 0.1 * randn(hidden)
    close(fused.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
    want_x, want_res = ref.add_rms_norm(x, residual, weight, 1e-5)
    got_x, got_res = fused.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    close(got_x, want_x)
    close(got_res, want_res)
    gate_up = randn(tokens, 2 * 2048)
    close(fused.act_mul(gate_up), ref.act_mul(gate_up))

    rotary_dim = int(head_dim * rotary_fraction)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    tables = RopeTables.build(inv_freq, 1.0, 4096, torch.bfloat16, torch.device("cuda"), True)
    positions = torch.randint(0, 4096, (tokens,), generator=gen, device="cuda")
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    want_q, want_k = ref.rope(q.clone(), k.clone(), ref.rope_context(positions, tables))
    got_q, got_k = fused.rope(q, k, fused.rope_context(positions, tables))
    close(got_q, want_q)
    close(got_k, want_k)
    assert got_q.data_ptr() == qkv.data_ptr()  # rotated in place, in the QKV output


@pytest.mark.gpu
@needs_cuda
def test_sampling_on_the_device():
    """Rows that need nothing host-only are sampled where the logits are: the distribution
    after top-k is right, a seed reproduces, greedy rows are argmax; a row that asks for
    logprobs sends the batch to the host sampler, which still answers."""
    from runtime.generation import GenerationState
    from runtime.model.sampler import sample
    from runtime.protocol import SamplingParams

    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0, 0.0, 0.0])
    logits = torch.log(probs.clamp_min(1e-30)).cuda()

    def state(**params):
        params.setdefault("max_new_tokens", 10**6)
        return GenerationState(SamplingParams(**params), [7], None, (), probs.numel())

    row = state(seed=0, top_k=3)
    draws = sample(logits.expand(8000, -1), [row.sampler] * 8000).token_ids
    freqs = torch.bincount(torch.tensor(draws), minlength=8).float() / 8000
    expected = torch.tensor([0.4, 0.3, 0.15, 0, 0, 0, 0, 0]) / 0.85
    assert (freqs - expected).abs().max() < 0.03
    runs = [sample(logits.expand(5, -1), [state(seed=11).sampler] * 5).token_ids for _ in range(2)]
    assert runs[0] == runs[1]
    mixed = [state(temperature=0), state(seed=3, logprobs=True)]
    out = sample(logits.expand(2, -1), [s.sampler for s in mixed])
    assert out.token_ids[0] == 0 and out.logprobs[1] is not None


GREEDY_WITH_TOP2 = dict(temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)


def check_gemma_against_transformers(kind: str, device: str, folder) -> None:
    """A tiny `kind` model (alternating windows of 24 past which the prompts run, soft-caps,
    Gemma's norms and GELU; Gemma 3's two RoPE bases) on `device` against transformers'
    forward on the same device: fp32 prefill logits within 1e-3, and through the whole engine
    (which picks the torch reference for attention and Gemma's pointwise ops) 16 greedy tokens
    identical to transformers' generate; in bf16 the tokens agree with fp32's until a near tie."""
    from conftest import tiny_hf_model

    from runtime.cache.allocator import SlotAllocator
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.model.arch import ModelArch
    from runtime.model.batch import ForwardBatch
    from runtime.model.runner import ModelRunner
    from runtime.protocol import GenerateRequest, SamplingParams

    hf = tiny_hf_model(kind, initializer_range=0.1)
    hf.save_pretrained(folder)
    hf = hf.to(device)
    hf.generation_config.eos_token_id = None  # as ignore_eos: never stop, never mask eos

    ids = [(11 * j) % 500 + 5 for j in range(57)]
    config = EngineConfig(device=device, attention_backend="torch")
    runner = ModelRunner(ModelArch.from_hf(hf.config), hf.state_dict(), 2048, config)
    got = runner.forward(
        ForwardBatch.build([ids], [SlotAllocator(2048).alloc(57)], all_logits=[True])
    )
    with torch.no_grad():
        want = hf(torch.tensor([ids], device=device)).logits[0].float()
    assert got.device.type == device and got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-3

    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((9, 30, 44))]
    with torch.no_grad():
        expected = [
            hf.generate(torch.tensor([p], device=device), max_new_tokens=16, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    sampling = SamplingParams(max_new_tokens=16, **GREEDY_WITH_TOP2)
    results = {}
    for dtype in ("float32", "bfloat16"):
        engine_config = EngineConfig(
            model=str(folder), device=device, dtype=dtype, max_kv_tokens=4096
        )
        with Engine(engine_config) as engine:
            assert engine.stats()["attention_backend"] == ("torch" if device == "cuda" else "cpu")
            results[dtype] = engine.generate(
                [GenerateRequest(input_ids=p, sampling=sampling) for p in prompts]
            )
    assert [r.output_ids for r in results["float32"]] == expected
    agree_until_near_ties(results["bfloat16"], results["float32"])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_on_the_device_matches_transformers(kind, tmp_path):
    check_gemma_against_transformers(kind, "cuda", tmp_path)


@pytest.mark.gpu
@needs_cuda
def test_host_kv_tier_on_the_device():
    """KV flushed from the device pool moves to host memory and is loaded back instead of
    computed (bf16, flashinfer, decode graphs): the answer equals the device cache hit's (the
    loaded KV is the computed KV, so the same kernels give the same tokens and logprobs), agrees
    with the first computation's until a near tie, and the host counters say what was loaded."""
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    ids = [(13 * j) % 30000 + 5 for j in range(200)]
    sampling = SamplingParams(max_new_tokens=24, **GREEDY_WITH_TOP2)
    config = device_engine_config(host_kv_gb=0.05)
    with Engine(config) as engine:
        answers = []
        for flush in (False, False, True):  # computed, a device cache hit, loaded from host
            if flush:
                engine.flush_cache()  # everything leaves the device pool for host memory
            [result] = engine.generate([GenerateRequest(input_ids=ids, sampling=sampling)])
            assert result.finish_reason == "length", result.error
            answers.append(result)
        engine.check_integrity()
        stats = engine.stats()
    first, hit, loaded = answers
    assert stats["attention_backend"] == "flashinfer" and stats["cuda_graph_replays_total"] > 0
    assert hit.cached_tokens == 192 and hit.loaded_tokens == 0
    assert loaded.loaded_tokens == 192 and stats["kv_loaded_host_tokens_total"] == 192
    assert stats["kv_demoted_tokens_total"] > 0 and stats["kv_loaded_disk_tokens_total"] == 0
    assert loaded.output_ids == hit.output_ids
    pairs = zip(loaded.logprobs, hit.logprobs, strict=True)
    assert max(abs(a.logprob - b.logprob) for a, b in pairs) < 1e-3
    agree_until_near_ties([loaded], [first])
