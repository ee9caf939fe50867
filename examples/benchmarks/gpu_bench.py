"""The H100/H200 path against the hardware's own limits (Llama-3-8B shapes, random weights, bf16).

    python examples/benchmarks/gpu_bench.py --w1-ids W1.json --out RESULT.md   # on a CUDA machine
    python examples/benchmarks/gpu_bench.py --write-w1-ids W1.json   # any machine: W1's prompts
    python examples/benchmarks/gpu_bench.py --dry-run                # the floor arithmetic only

Measured in one run: the device's copy bandwidth and bf16 matmul rate; the decode step at batch
1, 8 and 64 (1024-token contexts), eager and replayed from CUDA graphs, against the HBM floor
(weight bytes + KV bytes read per step, divided by the measured copy bandwidth); prefill
TFLOP/s against the measured matmul rate; and W1's first turns at bench size (64 users, 48
greedy tokens each): prefill tokens computed vs unique, output tokens/s, eager vs graphs. W1's
prompts are SmolLM2-tokenized ids written beforehand (the GPU machine has no model hub).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CONTEXT_LEN = 1024
DECODE_BATCHES = (1, 8, 64)
PREFILL_TOKENS = (2048, 8192)
W1_NEW_TOKENS = 48


@dataclass(frozen=True)
class Shapes:
    """What a decode step must read: every weight once, and each sequence's KV."""

    num_params: int
    layer_params: int  # the decoder layers' matmul weights and norms (no embedding, no head)
    vocab_params: int  # one of embedding / LM head
    weight_bytes: int
    kv_bytes_per_token: int

    def decode_floor_s(self, batch: int, context_len: int, bandwidth_bytes_s: float) -> float:
        """Bytes one step must read: every weight but the embedding table (a decode reads
        `batch` rows of it), plus each sequence's KV."""
        weights = self.weight_bytes * (self.num_params - self.vocab_params) / self.num_params
        return (weights + batch * context_len * self.kv_bytes_per_token) / bandwidth_bytes_s

    def prefill_flops(
        self, num_tokens: int, context_len: int, num_layers: int, hidden: int
    ) -> float:
        """The layers' matmuls for every token, the LM head for the last one, and causal
        attention (QK^T and PV over half the context on average)."""
        attention = 2 * 2 * num_layers * hidden * num_tokens * context_len / 2
        return 2 * self.layer_params * num_tokens + 2 * self.vocab_params + attention


def llama3_8b_shapes(dtype_bytes: int = 2) -> Shapes:
    from runtime.model.random_weights import PRESETS

    p = PRESETS["llama-3-8b"]
    h, i, layers, v = (
        p["hidden_size"],
        p["intermediate_size"],
        p["num_hidden_layers"],
        p["vocab_size"],
    )
    heads, kv_heads = p["num_attention_heads"], p["num_key_value_heads"]
    head_dim = h // heads
    per_layer = (
        h * (heads * head_dim)
        + 2 * h * (kv_heads * head_dim)
        + (heads * head_dim) * h
        + 3 * h * i
        + 2 * h
    )
    params = layers * per_layer + 2 * v * h + h
    kv = 2 * layers * kv_heads * head_dim * dtype_bytes
    return Shapes(params, layers * per_layer, v * h, params * dtype_bytes, kv)


def median_cuda_seconds(fn, repeats: int = 10) -> float:
    """Median wall time of fn() with the device synchronized around each call."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Bytes moved per second (read + write) by a large device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_cuda_seconds(lambda: dst.copy_(src))


def matmul_rate(device: str) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192**3 / median_cuda_seconds(lambda: a @ b)


def decode_steps_s(engine, batch: int) -> tuple[float, float, float]:
    """(eager, graph, host planning of a graph step) seconds of one decode step of `batch`
    sequences at CONTEXT_LEN."""
    from runtime.cache.allocator import SlotAllocator
    from runtime.model.batch import ForwardBatch
    from runtime.model.cuda_graph import pad_decode_batch, padded_batch_size

    runner = engine.runner
    allocator = SlotAllocator(runner.pool.num_slots)
    slots = [allocator.alloc(CONTEXT_LEN + 1) for _ in range(batch)]
    prompt = [list(range(1000, 1000 + CONTEXT_LEN))] * batch
    runner.forward(ForwardBatch.build(prompt, [s[:CONTEXT_LEN] for s in slots]))
    step = ForwardBatch.build([[7]] * batch, slots)

    def eager() -> None:
        runner.attention.plan(step)
        runner.model.forward(step, runner.attention)

    graph_s = host_s = float("nan")
    graphs = runner.decode_graphs
    if graphs is not None and graphs.can_run(step):
        before = runner.num_graph_replays
        graph_s = median_cuda_seconds(lambda: runner.forward(step), repeats=30)
        assert runner.num_graph_replays > before

        def plan_only() -> None:  # what a graph step does on the host before its replay
            padded = pad_decode_batch(
                step, padded_batch_size(batch, graphs.sizes), runner.pool.scratch_slot
            )
            graphs.inputs.load(padded)
            runner.attention.plan_graph_decode(padded, graphs.inputs.out_slots[: padded.num_seqs])

        host_s = median_cuda_seconds(plan_only, repeats=30)
    return median_cuda_seconds(eager, repeats=30), graph_s, host_s


KERNEL_KINDS = (  # substrings of CUDA kernel names -> what they do
    ("GEMM", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas")),
    ("attention", ("decode", "prefill", "merge_state", "attention")),
    ("pointwise (norm, RoPE, SiLU)", ("norm", "rope", "rotary", "act_and_mul", "silu")),
    ("KV write", ("index_copy", "indexcopy", "index_put", "scatter")),
)


def kernel_breakdown(engine, batch: int, steps: int = 5, cpu: bool = False) -> dict[str, float]:
    """GPU time per decode step by kind of kernel, ms (eager steps under torch.profiler; the
    kernels are the graph's, only the gaps between launches differ)."""
    from torch.profiler import ProfilerActivity, profile

    from runtime.cache.allocator import SlotAllocator
    from runtime.model.batch import ForwardBatch

    runner = engine.runner
    allocator = SlotAllocator(runner.pool.num_slots)
    slots = [allocator.alloc(CONTEXT_LEN + 1) for _ in range(batch)]
    step = ForwardBatch.build([[7]] * batch, slots)
    runner.attention.plan(step)
    runner.model.forward(step, runner.attention)
    with profile(activities=[ProfilerActivity.CPU if cpu else ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.attention.plan(step)
            runner.model.forward(step, runner.attention)
        if not cpu:
            torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        us = event.self_cpu_time_total if cpu else event.self_device_time_total
        if us <= 0:
            continue
        name = event.key.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(s in name for s in keys)), "other")
        totals[kind] = totals.get(kind, 0.0) + us / 1e3 / steps
    totals["all kernels"] = sum(totals.values())
    return totals


def prefill_s(engine, num_tokens: int) -> float:
    from runtime.cache.allocator import SlotAllocator
    from runtime.model.batch import ForwardBatch

    allocator = SlotAllocator(engine.runner.pool.num_slots)
    batch = ForwardBatch.build([list(range(num_tokens))], [allocator.alloc(num_tokens)])
    return median_cuda_seconds(lambda: engine.runner.forward(batch), repeats=3)


def write_w1_ids(path: Path) -> None:
    """W1's first turns at bench size, tokenized by SmolLM2 (ids < 49152 fit Llama-3's vocab)."""
    from programs import support_agent
    from runtime.model.loader import load_tokenizer
    from runtime.model.registry import resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    prompts = support_agent.first_turn_ids(tokenizer, support_agent.make_inputs(tokenizer, "bench"))
    path.write_text(json.dumps(prompts))
    print(f"wrote {len(prompts)} prompts, {sum(map(len, prompts)):,} tokens, to {path}")


def w1_first_turns(engine, prompts: list[list[int]], temperature: float = 0.0) -> dict[str, float]:
    from runtime.prefix import union_prefix_tokens
    from runtime.protocol import GenerateRequest, SamplingParams

    before = engine.stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = engine.generate(
        [
            GenerateRequest(
                input_ids=p,
                sampling=SamplingParams(
                    max_new_tokens=W1_NEW_TOKENS,
                    ignore_eos=True,
                    temperature=temperature,
                    seed=i,
                ),
            )
            for i, p in enumerate(prompts)
        ]
    )
    wall_s = time.perf_counter() - start
    after = engine.stats()
    return {
        "computed": after["prefill_tokens_total"] - before["prefill_tokens_total"],
        "unique": union_prefix_tokens(prompts),
        "wall_s": wall_s,
        "output_tok_s": sum(r.completion_tokens for r in results) / wall_s,
        "replays": after["cuda_graph_replays_total"] - before["cuda_graph_replays_total"],
    }


def warm_jit() -> None:
    """Build flashinfer's kernels for head_dim 128 in bf16 (the JIT's first use takes minutes;
    the tests' small model and the 8B bench share them): the pointwise ops, an extend, a
    decode, a decode graph."""
    from concurrent.futures import ThreadPoolExecutor

    import flashinfer

    from runtime.cache.allocator import SlotAllocator
    from runtime.config import EngineConfig
    from runtime.model.arch import ModelArch
    from runtime.model.batch import ForwardBatch
    from runtime.model.random_weights import random_checkpoint
    from runtime.model.runner import ModelRunner

    start = time.perf_counter()
    builds = (  # the pointwise kernels' modules, compiled side by side (ninja runs outside the GIL)
        flashinfer.norm.get_norm_module,
        flashinfer.rope.get_rope_module,
        lambda: flashinfer.activation.get_act_and_mul_module("silu"),
    )
    with ThreadPoolExecutor(len(builds)) as pool:
        for future in [pool.submit(build) for build in builds]:
            future.result()
    print(f"pointwise kernels built in {time.perf_counter() - start:.0f} s", flush=True)
    checkpoint = random_checkpoint("random:llama-3-small", torch.bfloat16, "cuda")
    config = EngineConfig(
        dtype="bfloat16", device="cuda", attention_backend="flashinfer", cuda_graph_max_batch_size=2
    )
    runner = ModelRunner(ModelArch.from_hf(checkpoint.hf_config), checkpoint.weights, 256, config)
    slots = SlotAllocator(256).alloc(33)
    runner.forward(ForwardBatch.build([list(range(32))], [slots[:32]]))
    runner.forward(ForwardBatch.build([[5]], [slots]))
    torch.cuda.synchronize()
    print(f"flashinfer kernels ready in {time.perf_counter() - start:.0f} s", flush=True)


def make_engine(graphs: bool):
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    return Engine(
        EngineConfig(
            model="random:llama-3-8b",
            device="cuda",
            dtype="bfloat16",
            max_kv_tokens=240_000,
            chunked_prefill_tokens=8192,
            disable_cuda_graph=not graphs,
        )
    )


def measure(shapes: Shapes, w1_prompts: list[list[int]] | None) -> list[str]:
    device = "cuda"
    bandwidth, rate = copy_bandwidth(device), matmul_rate(device)
    start = time.perf_counter()
    engine = make_engine(graphs=True)
    build_s = time.perf_counter() - start
    backend = engine.stats()["attention_backend"]
    sizes = engine.runner.decode_graphs.sizes if engine.runner.decode_graphs else ()
    lines = [
        f"device {torch.cuda.get_device_name()}, torch {torch.__version__}: copy "
        f"{bandwidth / 1e12:.2f} TB/s (read+write), bf16 matmul {rate / 1e12:.0f} TFLOP/s; "
        f"attention: {backend}; graphs captured at {list(sizes)} "
        f"(engine built in {build_s:.1f} s)\n",
        f"decode step, {CONTEXT_LEN}-token contexts; floor = (weights but the embedding + KV) "
        "bytes / measured copy bandwidth\n",
        "| batch | eager ms | graph ms | of which host ms | floor ms | eager / floor "
        "| graph / floor |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for batch in DECODE_BATCHES:
        eager, graph, host = decode_steps_s(engine, batch)
        floor = shapes.decode_floor_s(batch, CONTEXT_LEN, bandwidth)  # HBM bytes/s, any mix
        lines.append(
            f"| {batch} | {eager * 1e3:.2f} | {graph * 1e3:.2f} | {host * 1e3:.2f} | "
            f"{floor * 1e3:.2f} | {eager / floor:.2f}x | {graph / floor:.2f}x |"
        )
    kinds = [k for k, _ in KERNEL_KINDS] + ["other", "all kernels"]
    lines += [
        "",
        "GPU time per decode step by kernel kind, ms (torch.profiler over eager steps)\n",
        "| batch | " + " | ".join(kinds) + " |",
        "| ---: |" + " ---: |" * len(kinds),
    ]
    for batch in (1, 64):
        totals = kernel_breakdown(engine, batch)
        lines.append(f"| {batch} | " + " | ".join(f"{totals.get(k, 0):.2f}" for k in kinds) + " |")
    arch = engine.arch
    lines += ["", "| prefill tokens | tok/s | TFLOP/s | of matmul rate |"]
    lines.append("| ---: | ---: | ---: | ---: |")
    for tokens in PREFILL_TOKENS:
        seconds = prefill_s(engine, tokens)
        flops = shapes.prefill_flops(tokens, tokens, arch.num_layers, arch.hidden_size)
        lines.append(
            f"| {tokens} | {tokens / seconds:,.0f} | {flops / seconds / 1e12:.0f} | "
            f"{flops / seconds / rate:.0%} |"
        )
    if w1_prompts is not None:
        runs = {"graphs, greedy": w1_first_turns(engine, w1_prompts)}
        engine.flush_cache()
        runs["graphs, temperature 1"] = w1_first_turns(engine, w1_prompts, temperature=1.0)
        engine.close()
        del engine
        torch.cuda.empty_cache()
        with make_engine(graphs=False) as eager_engine:
            runs["eager, greedy"] = w1_first_turns(eager_engine, w1_prompts)
        lines += [
            "",
            f"W1 first turns at bench size ({len(w1_prompts)} users, {W1_NEW_TOKENS} greedy "
            "tokens each), chunked prefill 8192\n",
            "| decode | prefill computed | unique | wall s | output tok/s | graph replays |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, r in runs.items():
            lines.append(
                f"| {name} | {r['computed']:,} | {r['unique']:,} | {r['wall_s']:.2f} | "
                f"{r['output_tok_s']:,.0f} | {r['replays']:,} |"
            )
    else:
        engine.close()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--w1-ids", type=Path, help="W1 prompts written by --write-w1-ids")
    parser.add_argument("--write-w1-ids", type=Path, help="write W1's prompts here and exit")
    parser.add_argument("--warm-jit", action="store_true", help="build flashinfer's kernels")
    parser.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=4.8e12,
        help="bytes/s for --dry-run (H200 HBM3e nominal 4.8 TB/s)",
    )
    args = parser.parse_args()
    if args.write_w1_ids:
        write_w1_ids(args.write_w1_ids)
        return
    if args.warm_jit:
        warm_jit()
        return
    shapes = llama3_8b_shapes()
    lines = [
        f"Llama-3-8B shapes: {shapes.num_params / 1e9:.2f} B params, "
        f"{shapes.weight_bytes / 2**30:.1f} GiB bf16 weights, "
        f"{shapes.kv_bytes_per_token / 1024:.0f} KiB KV per token\n"
    ]
    if args.dry_run:
        lines += [
            f"floor at {args.bandwidth / 1e12:.2f} TB/s, context {CONTEXT_LEN} "
            "(nothing measured: dry run)\n",
            "| batch | floor ms |",
            "| ---: | ---: |",
        ]
        for batch in DECODE_BATCHES:
            floor = shapes.decode_floor_s(batch, CONTEXT_LEN, args.bandwidth)
            lines.append(f"| {batch} | {floor * 1e3:.2f} |")
        if args.w1_ids:
            prompts = json.loads(args.w1_ids.read_text())
            lines.append(f"\nW1 prompts: {len(prompts)}, {sum(map(len, prompts)):,} tokens")
    else:
        prompts = json.loads(args.w1_ids.read_text()) if args.w1_ids else None
        lines += measure(shapes, prompts)
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
