"""A minimal static-batch generation loop over ModelRunner + sampler, for model-level tests.

The engine's scheduler is the real driver; this loop exists so the model runner and the
sampler can be tested (and compared with transformers) without it.
"""

from __future__ import annotations

import torch

from runtime.cache.allocator import SlotAllocator
from runtime.generation import GenerationState
from runtime.model.batch import ForwardBatch
from runtime.model.runner import ModelRunner
from runtime.model.sampler import sample
from runtime.protocol import SamplingParams


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    tokenizer=None,
) -> list[GenerationState]:
    """Prefill every prompt in one batch, then decode all unfinished sequences together."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    allocator = SlotAllocator(runner.pool.num_slots)
    states = [
        GenerationState(p, ids, tokenizer, runner.arch.eos_token_ids, runner.arch.vocab_size)
        for p, ids in zip(plist, prompts, strict=True)
    ]
    slots = [allocator.alloc(len(ids)) for ids in prompts]
    new_tokens = [list(ids) for ids in prompts]
    active = list(range(len(prompts)))
    while active:
        batch = ForwardBatch.build([new_tokens[i] for i in active], [slots[i] for i in active])
        logits = runner.forward(batch)
        out = sample(logits, [states[i].sampler for i in active])
        for j, i in enumerate(active):
            states[i].append(out.token_ids[j], out.logprobs[j], out.top_logprobs[j])
            new_tokens[i] = [out.token_ids[j]]
            if not states[i].finished:
                slots[i] = torch.cat([slots[i], allocator.alloc(1)])
        active = [i for i in active if not states[i].finished]
    return states
