"""The H100/H200 path against the hardware floor (Llama-3-8B shapes, random weights, bf16).

    python examples/benchmarks/gpu_bench.py              # on a CUDA machine
    python examples/benchmarks/gpu_bench.py --dry-run    # the floor arithmetic only (any machine)

Measured in the same run: the device's copy bandwidth and bf16 matmul rate; decode step time at
batch 1, 8, 64 against the HBM floor (weight bytes + KV bytes read per step, divided by the copy
bandwidth); prefill tokens/s and achieved TFLOP/s against the matmul rate; and W1's first turns
at bench size: prefill tokens computed vs unique. Appends a table to RESULTS.md next to it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")
CONTEXT_LEN = 1024


@dataclass(frozen=True)
class Shapes:
    """What a decode step must read: every weight once, and each sequence's KV."""

    num_params: int
    weight_bytes: int
    kv_bytes_per_token: int

    def decode_floor_s(self, batch: int, context_len: int, bandwidth_bytes_s: float) -> float:
        return (
            self.weight_bytes + batch * context_len * self.kv_bytes_per_token
        ) / bandwidth_bytes_s

    def prefill_flops(
        self, num_tokens: int, context_len: int, num_layers: int, hidden: int
    ) -> float:
        """2 x params per token for the matmuls, plus causal attention (QK^T and PV)."""
        attention = 2 * 2 * num_layers * hidden * num_tokens * context_len / 2
        return 2 * self.num_params * num_tokens + attention


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
    return Shapes(params, params * dtype_bytes, kv)


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


def decode_step_s(engine, batch: int) -> float:
    from runtime.cache.allocator import SlotAllocator
    from runtime.model.batch import ForwardBatch

    runner = engine.runner
    allocator = SlotAllocator(runner.pool.num_slots)
    slots = [allocator.alloc(CONTEXT_LEN + 1) for _ in range(batch)]
    prompt = [list(range(1000, 1000 + CONTEXT_LEN))] * batch
    runner.forward(ForwardBatch.build(prompt, [s[:CONTEXT_LEN] for s in slots]))
    step = ForwardBatch.build([[7]] * batch, slots)
    return median_cuda_seconds(lambda: runner.forward(step), repeats=20)


def prefill_s(engine, num_tokens: int) -> float:
    from runtime.cache.allocator import SlotAllocator
    from runtime.model.batch import ForwardBatch

    allocator = SlotAllocator(engine.runner.pool.num_slots)
    batch = ForwardBatch.build([list(range(num_tokens))], [allocator.alloc(num_tokens)])
    engine.runner.forward(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.runner.forward(batch)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def w1_prefill(engine) -> tuple[int, int]:
    from programs import support_agent
    from runtime.model.loader import load_tokenizer
    from runtime.model.registry import resolve_model
    from runtime.prefix import union_prefix_tokens
    from runtime.protocol import GenerateRequest, SamplingParams

    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    prompts = support_agent.first_turn_ids(tokenizer, support_agent.make_inputs(tokenizer, "bench"))
    before = engine.stats()["prefill_tokens_total"]
    engine.generate(
        [
            GenerateRequest(
                input_ids=p, sampling=SamplingParams(max_new_tokens=48, ignore_eos=True)
            )
            for p in prompts
        ]
    )
    return engine.stats()["prefill_tokens_total"] - before, union_prefix_tokens(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=4.8e12,
        help="bytes/s for --dry-run (H200 HBM3e nominal 4.8 TB/s)",
    )
    args = parser.parse_args()
    shapes = llama3_8b_shapes()
    lines = [
        f"Llama-3-8B shapes: {shapes.num_params / 1e9:.2f} B params, "
        f"{shapes.weight_bytes / 2**30:.1f} GiB bf16 weights, "
        f"{shapes.kv_bytes_per_token / 1024:.0f} KiB KV per token"
    ]
    if args.dry_run:
        lines.append(
            f"\nfloor at {args.bandwidth / 1e12:.2f} TB/s, context {CONTEXT_LEN} "
            f"(nothing measured: dry run)\n"
        )
        lines.append("| batch | floor ms |")
        lines.append("| ---: | ---: |")
        for batch in (1, 8, 64):
            floor = shapes.decode_floor_s(batch, CONTEXT_LEN, args.bandwidth)
            lines.append(f"| {batch} | {floor * 1e3:.2f} |")
        print("\n".join(lines))
        return
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    device = "cuda"
    bandwidth, rate = copy_bandwidth(device), matmul_rate(device)
    engine = Engine(
        EngineConfig(
            model="random:llama-3-8b", device=device, dtype="bfloat16", max_kv_tokens=200_000
        )
    )
    backend = engine.stats()["attention_backend"]
    lines.append(
        f"device {torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s "
        f"(read+write), bf16 matmul {rate / 1e12:.0f} TFLOP/s; attention: {backend}\n"
    )
    lines.append("| decode batch | step ms | floor ms | step / floor |")
    lines.append("| ---: | ---: | ---: | ---: |")
    for batch in (1, 8, 64):
        step = decode_step_s(engine, batch)
        floor = shapes.decode_floor_s(batch, CONTEXT_LEN, bandwidth)
        lines.append(f"| {batch} | {step * 1e3:.2f} | {floor * 1e3:.2f} | {step / floor:.2f}x |")
    p = engine.arch
    for tokens in (2048, 8192):
        seconds = prefill_s(engine, tokens)
        flops = shapes.prefill_flops(tokens, tokens, p.num_layers, p.hidden_size)
        lines.append(
            f"\nprefill {tokens} tokens: {tokens / seconds:,.0f} tok/s, "
            f"{flops / seconds / 1e12:.0f} TFLOP/s ({flops / seconds / rate:.0%} of the "
            f"measured matmul rate)"
        )
    computed, unique = w1_prefill(engine)
    lines.append(
        f"\nW1 first turns at bench size: prefill computed {computed:,} vs unique {unique:,}"
    )
    engine.close()
    text = "\n".join(lines)
    print(text)
    with RESULTS.open("a") as out:
        out.write(f"\n## gpu_bench ({time.strftime('%Y-%m-%d')})\n\n{text}\n")


if __name__ == "__main__":
    main()
