"""Model runner speed on the default model vs transformers `generate` (same weights, same dtype).

    python examples/benchmarks/model_bench.py [--dtype float32] [--batches 1 8 32] [--repeats 3]
    python examples/benchmarks/model_bench.py --families [--dtype float32]

`--families`: one row per supported architecture instead, each a random-weight model of about
130 M parameters built from its transformers config class (same shapes where the family
allows), batch 8, 256-token prompts, 16 new tokens.

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


def ours(
    runner: ModelRunner, prompts: list[list[int]], new_tokens: int = NEW_TOKENS
) -> tuple[float, float]:
    """Seconds for the batched prefill, median seconds per decode step."""
    allocator = SlotAllocator(runner.pool.num_slots)
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
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


def theirs(hf, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> tuple[float, float]:
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
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
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


BASE = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
# family -> (transformers config class, model class, what differs from BASE)
FAMILY_MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=128)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=64)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, eos_token_id=2)),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=1024, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1024),
    ),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=64, sliding_window=128)),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(head_dim=64, sliding_window=128, pad_token_id=0),
    ),
}


def family_rows(dtype: torch.dtype, repeats: int) -> list[str]:
    """Prefill and decode tok/s, ours vs transformers, for each family's random model."""
    import transformers

    from runtime.config import EngineConfig
    from runtime.model.arch import ModelArch

    batch, prompt_len = 8, 256
    prompts = torch.randint(100, 31000, (batch, prompt_len), generator=torch.Generator()).tolist()
    lines = [
        "| family | params | prefill tok/s ours | HF | ratio | decode tok/s ours | HF | ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for family, (config_name, model_name, extra) in FAMILY_MODELS.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_name)(**{**BASE, **extra})
        hf = getattr(transformers, model_name)(config).to(dtype).eval()
        arch = ModelArch.from_hf(config)
        runner = ModelRunner(
            arch, hf.state_dict(), 4096, EngineConfig(dtype=str(dtype).split(".")[-1])
        )
        runs = [(ours(runner, prompts, 16), theirs(hf, prompts, 16)) for _ in range(repeats)]
        p_ours = statistics.median(r[0][0] for r in runs)
        d_ours = statistics.median(r[0][1] for r in runs)
        p_hf = statistics.median(r[1][0] for r in runs)
        d_hf = statistics.median(r[1][1] for r in runs)
        params = sum(p.numel() for p in hf.parameters()) / 1e6
        lines.append(
            f"| {family} | {params:.0f} M | {batch * prompt_len / p_ours:,.0f} | "
            f"{batch * prompt_len / p_hf:,.0f} | {p_hf / p_ours:.2f}x | {batch / d_ours:,.0f} | "
            f"{batch / d_hf:,.0f} | {d_hf / d_ours:.2f}x |"
        )
        print(lines[-1], flush=True)
        del hf, runner
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--families", action="store_true", help="a row per architecture")
    args = parser.parse_args()
    if args.families:
        lines = family_rows(getattr(torch, args.dtype), args.repeats)
        print(
            f"\nrandom-weight models per family, {args.dtype}, {torch.get_num_threads()} threads, "
            f"batch 8, 256-token prompts, 16 new tokens, median of {args.repeats}\n"
        )
        print("\n".join(lines))
        return
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
    packed = "oneDNN packed weights" if runner.model.lm_head.packed else "F.linear"
    print(f"\nGEMM path: {packed}; attention backend: {runner.attention.name}")
    profile_decode_step(runner, max(args.batches))


if __name__ == "__main__":
    main()
