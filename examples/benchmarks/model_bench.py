"""Model runner speed on the default model vs transformers `generate` (same weights, same dtype).

    python examples/benchmarks/model_bench.py [--dtype float32] [--batches 1 8 32] [--repeats 3]

Prefill: 512-token prompts. Decode: 32 new tokens per sequence after the prompt (EOS ignored).
Ours runs the runner + batched sampler step by step (greedy, ragged batches, no padding);
transformers runs `generate` on the same token ids. Both use this process's torch threads.
Ratios are measured side by side in one run; medians over repeats. Ends with a profile of one
decode step (where the time goes).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from runtime.cache.allocator import SlotAllocator
from runtime.generation import GenerationState
from runtime.model.batch import ForwardBatch
from runtime.model.registry import DEFAULT_MODEL, resolve_model
from runtime.model.runner import ModelRunner
from runtime.model.sampler import sample
from runtime.protocol import SamplingParams

PROMPT_LEN, NEW_TOKENS = 512, 32


def ours(runner: ModelRunner, prompts: list[list[int]]) -> tuple[float, float]:
    """Seconds for the batched prefill, median seconds per decode step."""
    allocator = SlotAllocator(runner.pool.num_slots)
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    arch = runner.arch
    states = [
        GenerationState(params, p, None, arch.eos_token_ids, arch.vocab_size) for p in prompts
    ]
    slots = [allocator.alloc(len(p)) for p in prompts]
    start = time.perf_counter()
    logits = runner.forward(ForwardBatch.build(prompts, slots))
    prefill_s = time.perf_counter() - start
    step_times = []
    while True:
        out = sample(logits, states)
        for state, token in zip(states, out.token_ids, strict=True):
            state.append(token)
        if states[0].finished:
            break
        start = time.perf_counter()
        slots = [torch.cat([s, allocator.alloc(1)]) for s in slots]
        batch = ForwardBatch.build([[s.output_ids[-1]] for s in states], slots)
        logits = runner.forward(batch)
        step_times.append(time.perf_counter() - start)
    return prefill_s, statistics.median(step_times)


def theirs(hf, prompts: list[list[int]]) -> tuple[float, float]:
    """Seconds to the first token (prefill), median seconds per further decode step.

    A stopping criterion records the time of every step inside one `generate` call.
    """
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = torch.tensor(prompts)
    with torch.inference_mode():
        start = time.perf_counter()
        hf.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([Clock()]),
        )
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return stamps[0] - start, statistics.median(steps)


def profile_decode_step(runner: ModelRunner, batch_size: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    allocator = SlotAllocator(runner.pool.num_slots)
    slots = [allocator.alloc(PROMPT_LEN + 1) for _ in range(batch_size)]
    batch = ForwardBatch.build([[5]] * batch_size, slots)
    runner.forward(batch)
    start = time.perf_counter()
    runner.forward(batch)
    wall_ms = (time.perf_counter() - start) * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.forward(batch)
    groups = {
        "matmuls (linear)": ("linear", "mm", "addmm"),
        "attention gather (index_select)": ("index_select",),
        "attention kernel (paged / sdpa)": ("paged_attention", "scaled_dot_product"),
        "KV write (index_copy)": ("index_copy",),
    }
    totals = dict.fromkeys(groups, 0.0)
    other_ops = 0.0
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3
        for group, needles in groups.items():
            if any(n in event.key for n in needles):
                totals[group] += ms
                break
        else:
            other_ops += ms
    profiled = sum(totals.values()) + other_ops
    print(
        f"\nprofile of one decode step, batch {batch_size} x {PROMPT_LEN + 1} context "
        f"({runner.dtype}), {wall_ms:.1f} ms wall unprofiled:\n"
    )
    print("| part | ms (profiled) | share |")
    print("| --- | ---: | ---: |")
    for group, ms in [*totals.items(), ("other ops (norms, rope, adds, ...)", other_ops)]:
        print(f"| {group} | {ms:.1f} | {ms / profiled:.0%} |")
    print(f"| Python and dispatch overhead (wall - ops) | {max(0.0, wall_ms - profiled):.1f} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    path = resolve_model(DEFAULT_MODEL)
    dtype = getattr(torch, args.dtype)
    num_slots = max(args.batches) * (PROMPT_LEN + NEW_TOKENS) + 64
    runner = ModelRunner.from_checkpoint(path, num_slots=num_slots, dtype=args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch_size in args.batches:
        prompts = torch.randint(100, 49000, (batch_size, PROMPT_LEN), generator=gen).tolist()
        runs_ours, runs_theirs = [], []
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both
            runs_ours.append(ours(runner, prompts))
            runs_theirs.append(theirs(hf, prompts))
        p_ours = statistics.median(r[0] for r in runs_ours)
        d_ours = statistics.median(r[1] for r in runs_ours)
        p_hf = statistics.median(r[0] for r in runs_theirs)
        d_hf = statistics.median(r[1] for r in runs_theirs)
        rows.append(
            (
                batch_size,
                batch_size * PROMPT_LEN / p_ours,
                batch_size * PROMPT_LEN / p_hf,
                batch_size / d_ours,
                batch_size / d_hf,
            )
        )
    print(
        f"\n{DEFAULT_MODEL}, {args.dtype}, {torch.get_num_threads()} threads, prompts "
        f"{PROMPT_LEN} tokens, {NEW_TOKENS} new tokens, median of {args.repeats}\n"
    )
    print(
        "| batch | prefill tok/s ours | prefill tok/s HF | ratio | decode tok/s ours "
        "| decode tok/s HF | ratio |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b, po, ph, do, dh in rows:
        print(
            f"| {b} | {po:.0f} | {ph:.0f} | {po / ph:.2f}x | {do:.0f} | {dh:.0f} | {do / dh:.2f}x |"
        )
    print(f"\nGEMM path: {runner.model.gemm}; attention backend: {runner.attention.name}")
    profile_decode_step(runner, max(args.batches))


if __name__ == "__main__":
    main()
