"""The run_batch eviction family (issue 32): a plain `program.run_batch` of multi-turn
conversations, each opening with its own private context, on a pool that holds only part of the
batch's working set (the cyclic case: more conversations than fit). One cell = a batch shape, a
pool share, a page size and a policy; program_bench.py --eviction-only run_batch prints the table.

Requests reach the engine as run_batch sends them (no pacing, no think time): every instance's
next turn is queued the moment its previous reply is back. The offline optimum is Belady on the
lru run's recorded access order (replay.py), as the issue defines it; each cell also asserts
that every policy's outputs equal the unbounded run's.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from eviction_cells import REPLY_SAMPLING, TINY_MODEL, CellResult, cell_engine, cell_result

from flowlang import assistant, gen, program, system, user
from flowlang.backends.local import LocalBackend
from programs.text import CHAT_QUESTIONS, TextBuilder, token_counter
from runtime.cache.replay import replay, working_set


@program
def document_chat(
    s, context: str, questions: tuple[str, ...], system_prompt: str = "", reply_tokens: int = 12
):
    """A conversation about one private document: the document and a first question, then
    follow-up questions, each answered by a short generated reply."""
    if system_prompt:
        s += system(system_prompt)
    for turn, question in enumerate(questions):
        s += user(f"{context}\n\n{question}" if turn == 0 else question)
        s += assistant(gen(f"answer_{turn}", max_new_tokens=reply_tokens))


@dataclass(frozen=True)
class BatchShape:
    num_convs: int
    context_tokens: int
    num_turns: int
    system_tokens: int = 0  # a system prompt every conversation shares (run_batch pins it)
    reply_tokens: int = 12
    question_tokens: int = 20

    @property
    def name(self) -> str:
        shared = f" + {self.system_tokens} shared" if self.system_tokens else ""
        return f"{self.num_convs} x {self.num_turns} turns, ctx {self.context_tokens}{shared}"


# the family: conversation counts, context lengths and turns varied, with and without a shared
# system prompt (the cell is the first)
SHAPES = (
    BatchShape(24, 900, 3),
    BatchShape(24, 900, 3, system_tokens=300),
    BatchShape(16, 1500, 4),
    BatchShape(48, 400, 3, system_tokens=200),
    BatchShape(32, 600, 5),
)
SHARES = (0.25, 0.35, 0.5, 0.6)
PAGE_SIZES = (1, 16)


def make_batch(tokenizer, shape: BatchShape, seed: int = 0) -> list[dict]:
    """run_batch arguments: one seeded conversation per instance."""
    text = TextBuilder(seed + 32, token_counter(tokenizer))
    rng = random.Random(seed)
    system_prompt = (
        "You answer questions about the document the user shares. "
        + text.paragraph(shape.system_tokens - 12)
        if shape.system_tokens
        else ""
    )
    return [
        {
            "context": text.paragraph(shape.context_tokens),
            "questions": tuple(
                text.paragraph(
                    rng.randint(shape.question_tokens // 2, shape.question_tokens),
                    templates=CHAT_QUESTIONS,
                )
                for _ in range(shape.num_turns)
            ),
            "system_prompt": system_prompt,
            "reply_tokens": shape.reply_tokens,
        }
        for _ in range(shape.num_convs)
    ]


def run_cell(
    batch: list[dict],
    tokenizer,
    capacity: int,
    policy: str,
    page_size: int = 1,
    future: list[tuple] | None = None,
    model: str = TINY_MODEL,
) -> CellResult:
    """The batch through `document_chat.run_batch` on a `capacity`-slot pool under `policy`."""
    with cell_engine(model, tokenizer, capacity, policy, future, page_size) as engine:
        start = time.perf_counter()
        states = document_chat.run_batch(
            batch, backend=LocalBackend(engine), progress=False, sampling=REPLY_SAMPLING
        )
        return cell_result(engine, states, time.perf_counter() - start)


def unbounded_run(batch: list[dict], tokenizer, model: str = TINY_MODEL) -> tuple[CellResult, int]:
    """A run with room for everything, and its working set in tokens (which sizes the pools)."""
    result = run_cell(batch, tokenizer, 400_000, "lru", model=model)
    return result, working_set(result.trace)


def offline_optimum(lru: CellResult, capacity: int) -> int:
    """Prefill computed by Belady on the lru run's access order (sequential replay)."""
    return replay(lru.trace, capacity, "oracle").computed_tokens


@dataclass(frozen=True)
class FirstEviction:
    """The engine's state when it first evicts: who holds the pool, and what it may take."""

    running: int  # requests running
    locked_tokens: int  # slots their prefixes and own KV hold (never candidates)
    evictable_tokens: int  # what eviction may choose from
    waiting_reads: int  # of those, tokens a waiting request reads


def first_eviction(
    batch: list[dict], tokenizer, capacity: int, policy: str, future: list[tuple] | None = None
) -> FirstEviction:
    """Run the batch and record the state at its first eviction (issue 32's diagnosis: which
    candidates eviction had to choose from, next to the sequential optimum that has them all)."""
    seen: list[FirstEviction] = []
    with cell_engine(TINY_MODEL, tokenizer, capacity, policy, future) as engine:
        scheduler, cache = engine.scheduler, engine.scheduler.kv.cache
        evict = cache.evict

        def recording(num_tokens: int) -> int:  # on the loop thread
            if not seen:
                running = scheduler.running
                own = sum(r.kv.capacity - r.kv.num_locked for r in running)
                seen.append(
                    FirstEviction(
                        len(running),
                        cache.protected_size + own,
                        cache.evictable_size,
                        _waiting_reads(scheduler),
                    )
                )
            return evict(num_tokens)

        cache.evict = recording
        document_chat.run_batch(
            batch, backend=LocalBackend(engine), progress=False, sampling=REPLY_SAMPLING
        )
    return seen[0]


def _waiting_reads(scheduler) -> int:
    """Unlocked cached tokens that some waiting request's match reads."""
    tokens: dict[int, int] = {}
    for req in scheduler.waiting.values():
        position = scheduler.policy.match(req)
        node, upto = position.node, position.prefix_len
        while node.parent is not None:
            if node.lock_ref == 0:
                start = node.depth - len(node.key)
                tokens[id(node)] = max(tokens.get(id(node), 0), min(upto, node.depth) - start)
            node = node.parent
    return sum(tokens.values())
