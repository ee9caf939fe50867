"""Short steps beside a higher priority (runtime/scheduler/step_ranks.py): while a request of a
higher declared priority runs, the prompt tokens of lower-priority requests per step are capped
to a shared step's worth; with one priority everywhere the steps are as before."""

from __future__ import annotations

from test_programs import program_req, with_priority
from test_scheduler import expected_output, fake_logits, make_req, scheduler

from runtime.scheduler.request import Req
from runtime.scheduler.scheduler import Scheduler
from runtime.scheduler.shares import UNMEASURED_SHARED_TOKENS
from runtime.verify import apply_logits

CHUNK = 512


def prefill_per_step(sched: Scheduler, rid: str) -> list[int]:
    """Step until idle (invariants after every step); `rid`'s prompt tokens in each step
    that computes some."""
    per_step = []
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        per_step += [e.num_new for e in batch.entries if e.req.rid == rid and not e.is_decode]
        sched.process(batch, apply_logits(batch, fake_logits(batch), True))
        sched.check_integrity()
    return per_step


def decoding_and_long(first_priority: int, second_priority: int) -> tuple[Scheduler, Req, Req]:
    """`a` (3-token prompt, 8 tokens to decode) running, then `b` (900-token prompt) added."""
    sched = scheduler(chunked_prefill_tokens=CHUNK)
    a = with_priority(make_req("a", [5, 6, 7], max_new_tokens=8), first_priority)
    b = with_priority(make_req("b", [(3 * i) % 90 + 3 for i in range(900)], 1, arrival=1),
                      second_priority)  # fmt: skip
    sched.add(a)
    batch = sched.schedule()
    sched.process(batch, apply_logits(batch, fake_logits(batch), True))
    sched.add(b)
    return sched, a, b


def test_a_lower_prioritys_prompt_goes_in_short_steps_while_a_higher_one_decodes():
    sched, a, b = decoding_and_long(1, 0)
    per_step = prefill_per_step(sched, "b")
    assert sum(per_step) == 900
    # while a decodes (its 7 tokens left: one a step) b computes a shared step's worth a step
    # (64 before the step cost is measured: this scheduler runs no model); then the rest
    assert per_step == [UNMEASURED_SHARED_TOKENS] * 7 + [900 - 7 * UNMEASURED_SHARED_TOKENS]
    assert a.gen.output_ids == expected_output([5, 6, 7], 8)
    assert b.gen.output_ids == expected_output(b.prompt_ids, 1)


def test_one_priority_everywhere_keeps_whole_chunks():
    sched, _, _ = decoding_and_long(0, 0)
    assert prefill_per_step(sched, "b") == [CHUNK, 900 - CHUNK]


def test_a_higher_prioritys_prompt_is_not_capped_beside_lower_ones():
    """The higher priority arrives second: its prompt takes whole chunks while the lower one
    decodes, and the lower one is what waits."""
    sched, _, _ = decoding_and_long(0, 1)
    assert prefill_per_step(sched, "b") == [CHUNK, 900 - CHUNK]


def test_a_program_served_more_goes_in_short_steps_beside_a_less_served_one():
    """Blind (no priorities), ranks are service levels (quantum: an eighth of the 4,096-slot
    pool, 512 tokens; a request's prompt counts from its start). A (a 2,000-token prompt: level
    2) and B (3 tokens: level 0) start in one step; while B decodes, A's prompt goes in short
    steps, and whole chunks once B is done."""
    sched = scheduler(chunked_prefill_tokens=CHUNK)
    b = program_req("b", [5, 6, 7], "B", None, new=8)
    a = program_req("a", [(3 * i) % 90 + 3 for i in range(2_000)], "A", None, new=1)
    sched.add(b)
    sched.add(a)
    first = CHUNK - 3  # what B's prompt leaves of the first step
    gate = sched.lookahead.programs
    per_step = prefill_per_step(sched, "a")
    assert (gate.request_rank(a), gate.request_rank(b)) == ((0, 2), (0, 0))
    short = [UNMEASURED_SHARED_TOKENS] * 7  # B's 7 decodes after its first token
    assert per_step == [first, *short, CHUNK, CHUNK, 2_000 - first - sum(short) - 2 * CHUNK]
    assert b.gen.output_ids == expected_output([5, 6, 7], 8)
