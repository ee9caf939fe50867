"""Programs as the unit of admission (runtime/scheduler/programs.py), on the scheduler alone
with fake logits: a paused program's KV is kept while a new program waits, waiting is priced
against recomputing, entry order is least attained service with starvation bounded, and the
gate's bookkeeping holds under any sequence of programs, pauses, returns and aborts."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.generation import GenerationState
from runtime.protocol import GraphHints, SamplingParams
from runtime.scheduler.branches import MAX_BRANCHES
from runtime.scheduler.program_service import ProgramRecord
from runtime.scheduler.programs import STARVATION_S, NoPrograms, ProgramGate
from runtime.scheduler.request import Req, ReqKind
from runtime.scheduler.scheduler import Scheduler
from runtime.verify import apply_logits
from tests.test_scheduler import VOCAB, fake_logits, scheduler

POOL = 200


def program_req(
    rid: str, ids: list[int], program: str, after_s: float | None, new: int = 4, branch=None
):
    """A request of `program` (on `branch`); `after_s`: it pauses on a tool and is back that
    much later (None: the program's last request)."""
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    hints = GraphHints(program_id=program, branch_id=branch, continuation=after_s is not None,
                       next_turn_after_s=after_s)  # fmt: skip
    return Req(rid, ids, GenerationState(params, ids, None, (), VOCAB), ReqKind.GENERATE,
               None, hints, 0)  # fmt: skip


def step(sched: Scheduler) -> bool:
    batch = sched.schedule()
    if batch is not None:
        sched.process(batch, apply_logits(batch, fake_logits(batch), True))
    sched.check_integrity()
    return batch is not None


def run(sched: Scheduler, max_steps: int = 2_000) -> None:
    for _ in range(max_steps):
        if not sched.has_work():
            return
        assert step(sched), "work left but nothing schedulable"
    raise AssertionError("did not finish")


def with_clock(sched: Scheduler) -> list[float]:
    """The scheduler's clock as a list of one value the test moves."""
    now = [0.0]
    sched.lookahead.clock = lambda: now[0]
    return now


def priced(sched: Scheduler, per_token_s: float) -> None:
    """Teach the step-time fit that a computed token costs `per_token_s`."""
    for tokens in (1, 50, 100, 200) * 3:
        sched.step_time.observe(tokens, 0.01 + per_token_s * tokens)


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * i) % (VOCAB - 3) + 3 for i in range(n)]


def learned_to_grow_little(sched: Scheduler) -> None:
    """A program Z of 8 tokens waits on a tool, and its return (10 tokens more) ends it: the
    gate learns that a program grows by 18 tokens after its first request (4 decoded, 10
    computed, 4 decoded)."""
    z = program_req("z1", ids(9, 8), "Z", after_s=0.5)
    sched.add(z)
    run(sched)
    sched.add(program_req("z2", z.all_ids[:-1] + ids(8, 10), "Z", after_s=None))
    run(sched)
    assert list(sched.lookahead.programs.growth.seen) == [18]


def paused_a_then_new_b(per_token_s: float, b_served_tokens: int = 0, **settings):
    """Program A (120 tokens) pauses on a tool due back in 5 s; then program B (150 new
    tokens, which the pool holds only by evicting A's) arrives, having computed
    `b_served_tokens` in an earlier request. Returns the scheduler, A's finished request and B."""
    sched = scheduler(POOL, eviction_policy="graph", **settings)
    now = with_clock(sched)
    priced(sched, per_token_s)
    if b_served_tokens:
        sched.add(program_req("b0", ids(4, b_served_tokens), "B", after_s=None))
        run(sched)
    a = program_req("a1", ids(1, 120), "A", after_s=5.0)
    sched.add(a)
    run(sched)
    now[0] = 1.0
    b = program_req("b1", ids(2, 150), "B", after_s=None)
    sched.add(b)
    return sched, a, b


def a_returns(sched: Scheduler, a: Req) -> Req:
    back = program_req("a2", a.all_ids[:-1] + ids(3, 10), "A", after_s=None)
    sched.add(back)
    return back


def b_waits_however_long_and_a_keeps_its_path(sched: Scheduler, a: Req, b: Req) -> None:
    """B has waited 1,000 s and still waits, displacing no one; A's return finds its whole
    path, and B runs once A is done."""
    b.usage.submitted_s -= 1_000.0
    for _ in range(3):
        step(sched)
    assert b.rid in sched.waiting and sched.lookahead.programs.displaced == 0
    back = a_returns(sched, a)
    run(sched)
    assert back.usage.cached_tokens == len(a.all_ids) - 1 and b.gen.finished
    assert sched.lookahead.programs.returns_recomputed_tokens == 0  # nothing computed again


def test_a_new_program_waits_while_a_paused_programs_kv_is_dear_to_recompute():
    sched, a, b = paused_a_then_new_b(
        per_token_s=0.1
    )  # evicting 76 kept tokens: 7.6 s > the 4 s wait
    for _ in range(5):
        step(sched)
    assert b.rid in sched.waiting and sched.counters["program_entries_deferred"] > 0
    back = a_returns(sched, a)
    run(sched)
    assert back.usage.cached_tokens == len(a.all_ids) - 1  # A's whole path was kept
    assert b.gen.finished and sched.counters["programs_entered"] >= 2


def test_without_the_gate_the_new_program_evicts_the_paused_one():
    sched, a, b = paused_a_then_new_b(per_token_s=0.05, program_admission=False)
    assert isinstance(sched.lookahead.programs, NoPrograms)
    step(sched)
    assert b.rid not in sched.waiting  # admitted at once
    back = a_returns(sched, a)
    run(sched)
    assert back.usage.cached_tokens < len(a.all_ids) - 1


def test_where_recompute_is_cheap_waiting_is_not_worth_it():
    sched, a, b = paused_a_then_new_b(per_token_s=1e-5)  # 76 tokens: ~1 ms < the 4 s wait
    step(sched)
    assert b.rid not in sched.waiting
    assert (
        sched.counters["programs_entered_priced"] == 1
        and not sched.counters["program_entries_deferred"]
    )


def test_while_others_run_on_a_busy_engine_a_program_that_does_not_fit_waits():
    """A (paused, kept) and C (running) are in; B does not fit beside A's kept path. However
    cheap a recomputed token is against a step's fixed cost (the tiny model's 1e-5 s, the
    default model's 0.1 s), B does not join C's steps while the engine never idles: A keeps
    its path. (Letting B share the running steps' fixed cost evicted kept paths as B grew:
    RESULTS.md, "The joining price removed".)"""
    for per_token_s in (1e-5, 0.1):
        sched = scheduler(POOL, eviction_policy="graph")
        now = with_clock(sched)
        sched.idle.clock = sched.lookahead.clock  # the engine idles only on the test's clock
        priced(sched, per_token_s)  # steps cost 0.01 s + per_token_s a token
        a = program_req("a1", ids(1, 120), "A", after_s=5.0)
        sched.add(a)
        run(sched)
        now[0] = 1.0
        c = program_req("c1", ids(6, 10), "C", after_s=None, new=40)
        sched.add(c)
        step(sched)
        assert c in sched.running
        b = program_req("b1", ids(2, 110), "B", after_s=None, new=20)
        sched.add(b)
        step(sched)
        assert b.rid in sched.waiting, per_token_s
        assert sched.counters["programs_entered_priced"] == 0
        assert sched.counters["program_entries_deferred"] == 1
        assert sched.lookahead.programs.is_in(a)  # A keeps its path


def test_a_waiting_program_enters_once_the_engine_idled_as_long_as_its_recompute_takes():
    """A (paused, kept, back in 50 s) and C (running) are in; B does not fit beside A's kept
    path (recomputing what it evicts costs 0.1 s a token): B waits. If the engine sits idle
    between C's steps (1 s each: C's client is slow), B enters once those idle seconds reach
    that recompute (ski rental), not before; if the engine is never idle, B waits until C is
    done."""
    entered_after_idle_s = {}
    for idle_gap_s in (1.0, 0.0):
        sched = scheduler(POOL, eviction_policy="graph")
        now = with_clock(sched)
        sched.idle.clock = sched.lookahead.clock  # the engine idles on the test's clock
        priced(sched, 0.1)
        sched.add(program_req("a1", ids(1, 120), "A", after_s=50.0))
        run(sched)
        c = program_req("c1", ids(6, 10), "C", after_s=None, new=60)
        sched.add(c)
        step(sched)
        b = program_req("b1", ids(2, 110), "B", after_s=None, new=20)
        sched.add(b)
        while b.rid in sched.waiting and c in sched.running:
            now[0] += idle_gap_s
            step(sched)
        entered_after_idle_s[idle_gap_s] = sched.idle.total_s()
        assert sched.counters["program_entries_deferred"] > 0
        priced_entry = sched.counters["programs_entered_priced"] == 1
        assert priced_entry is (idle_gap_s > 0) and (c in sched.running) is (idle_gap_s > 0)
    # the price: 0.1 s for each kept token B evicts, at least A's tokens beyond the free room
    assert 5.0 < entered_after_idle_s[1.0] < 30.0
    assert entered_after_idle_s[0.0] == 0.0


def test_a_program_of_less_service_displaces_a_paused_one_once_it_has_waited_its_recompute():
    """PLAS, priced by ski rental: B (no service yet) does not fit beside paused A's kept path
    (A computed 120 tokens: a lower service level). B waits while its wait is below what
    recomputing A's path costs (0.1 s a token); once it has waited that long, A is displaced:
    its path is not kept, B enters, and A's return recomputes what B evicted."""
    sched, a, b = paused_a_then_new_b(per_token_s=0.1)
    gate = sched.lookahead.programs
    step(sched)
    assert b.rid in sched.waiting and gate.displaced == 0
    b.usage.submitted_s -= 0.1 * 110  # below the ~124 tokens only A's path holds
    step(sched)
    assert b.rid in sched.waiting and gate.displaced == 0
    b.usage.submitted_s -= 0.1 * 20
    step(sched)
    assert b.rid not in sched.waiting and gate.displaced == 1 and not gate.paused
    back = a_returns(sched, a)
    assert not gate.is_in(back)  # A enters again, in order
    run(sched)
    assert back.usage.cached_tokens < len(a.all_ids) - 1 and b.gen.finished
    # what A computes again of the path it paused at is counted, and only that
    paused_depth = len(a.all_ids) - 1
    assert gate.returns_recomputed_tokens == paused_depth - back.usage.cached_tokens > 0


def test_a_program_of_the_same_service_level_displaces_none():
    """B computed 100 tokens before (the level of A's 120): however long it waits, A's kept
    path stays; B enters when A is back and done."""
    sched, a, b = paused_a_then_new_b(per_token_s=0.1, b_served_tokens=100)
    b_waits_however_long_and_a_keeps_its_path(sched, a, b)


def test_the_growth_learned_is_what_programs_computed_and_decoded_after_their_first_request():
    """A computes 120 tokens, decodes 4, pauses on a tool; back, it computes 10 more and
    decodes 4 and ends: it grew by 18. B then ends after one request that waited on nothing:
    its growth was never unknown, and is not learned from. A program that has grown 5 is then
    expected to grow by 13 more (of those seen, A grew more, by 13); one that has grown 20,
    past every one seen, by as much again."""
    sched, a, b = paused_a_then_new_b(per_token_s=0.1)
    gate = sched.lookahead.programs
    assert not gate.growth.seen  # no program's work has ended
    a_returns(sched, a)
    while b.rid in sched.waiting:
        step(sched)
    assert list(gate.growth.seen) == [18]
    run(sched)
    assert b.gen.finished and list(gate.growth.seen) == [18]
    assert sched.stats()["program_growth_tokens"] == gate.growth.mean_tokens() == 18
    record = ProgramRecord(0.0)
    record.computed(100, unknown=True)
    record.decoded(5)
    assert record.growth_due(gate.growth.seen) == 13
    record.computed(15)
    assert record.growth_due(gate.growth.seen) == 20
    record.growth_unknown = False  # (a program that waited on nothing: none is due)
    assert record.growth_due(gate.growth.seen) == 0


GROWTH_POOL = 500  # (a service quantum of 62 tokens: a 60-token program is at level 0)


@pytest.mark.parametrize("a_tokens, learned, enters", [(60, False, False), (60, True, True),
                                                       (100, False, True)])  # fmt: skip
def test_an_entrant_leaves_room_for_the_growth_still_due_to_the_programs_it_does_not_outrank(
    a_tokens: int, learned: bool, enters: bool
):
    """A (60 tokens) pauses on a tool and is kept; B (200 tokens, which will wait on a tool
    too) fits beside A's kept path. Before any program's work ended, A is expected to grow by
    as much as its first request computed (60, of which its 4 decoded tokens are grown
    already) and B by its prompt: B does not fit beside that too, and waits (recomputing the
    tokens it lacks, 12 s, costs more than waiting the 4 s for A). Once the gate has learned
    that programs grow by 18 tokens, B enters at once.
    A of 100 tokens is a service level below B (which has computed nothing): B outranks it,
    is served before A's growth, and enters at once."""
    sched = scheduler(GROWTH_POOL, eviction_policy="graph")
    now = with_clock(sched)
    sched.idle.clock = sched.lookahead.clock  # the engine idles only on the test's clock
    priced(sched, 0.5)
    if learned:
        learned_to_grow_little(sched)
    a = program_req("a1", ids(1, a_tokens), "A", after_s=5.0)
    sched.add(a)
    run(sched)
    now[0] = 1.0
    b = program_req("b1", ids(2, 200), "B", after_s=5.0)
    sched.add(b)
    step(sched)
    assert (b.rid not in sched.waiting) is enters
    assert sched.counters["program_entries_deferred"] == int(not enters)
    assert sched.counters["programs_entered_priced"] == 0
    gate = sched.lookahead.programs
    assert gate.displaced == 0 and gate.is_in(a)  # A keeps its path either way
    back = a_returns(sched, a)
    run(sched)
    assert back.usage.cached_tokens == len(a.all_ids) - 1 and b.gen.finished


def test_a_newcomer_lacking_room_only_for_the_growth_due_displaces_none():
    """C (50 tokens, B's service level) and A (100 tokens, a level below B's) pause and are
    kept; B (200 tokens, to wait on a tool) fits beside their kept paths, but not beside C's
    growth still due and its own (before any program's work ended: as much as their first
    requests). B outranks A, and displacing A would make that room; but room for growth that
    has not come is no reason to evict A's path: however long B waits, A and C keep theirs."""
    sched = scheduler(GROWTH_POOL, eviction_policy="graph")
    now = with_clock(sched)
    sched.idle.clock = sched.lookahead.clock  # the engine idles only on the test's clock
    priced(sched, 0.5)  # recomputing what B lacks costs more than waiting for A or C
    c = program_req("c1", ids(5, 50), "C", after_s=4.0)
    a = program_req("a1", ids(1, 100), "A", after_s=5.0)
    for req in (c, a):
        sched.add(req)
        run(sched)
    now[0] = 1.0
    b = program_req("b1", ids(2, 200), "B", after_s=5.0)
    sched.add(b)
    gate = sched.lookahead.programs
    b.usage.submitted_s -= 1_000.0
    for _ in range(3):
        step(sched)
    assert b.rid in sched.waiting and gate.displaced == 0
    assert gate.is_in(a) and gate.is_in(c)
    assert sched.counters["program_entries_deferred"] == 3


def test_growth_is_reserved_only_for_programs_that_wait_on_what_no_one_knows_ahead():
    """A (60 tokens) is in, its next request due right away (a chat's queued turn: it says
    what it has queued, GraphHints.future_tokens, and graph eviction keeps what that turn will
    read); B (200 tokens, likewise) then fits beside A's path, and enters: no growth is
    reserved for either. When both wait on their tools, what comes back is known to no one:
    A is expected to grow by the 60 its first request computed, and B by its prompt, and B
    does not fit. That holds whether the tools' latency is declared (GraphHints.
    next_turn_after_s: B enters priced, since with nothing running recomputing the tokens it
    lacks costs less than waiting 5 s for A) or not (GraphHints.waits_on_tools alone: a tool
    with no latency_s; no return of such tools seen yet, A is expected back at once, and B
    waits for it). Only unknown growth is learned from."""
    waits = ({}, {"next_turn_after_s": 5.0}, {"waits_on_tools": True})
    for wait in waits:
        sched = scheduler(GROWTH_POOL, eviction_policy="graph")
        now = with_clock(sched)
        sched.idle.clock = sched.lookahead.clock
        priced(sched, 0.1)
        first = {"continuation": True, "future_tokens": 8, **wait}
        a = program_req("a1", ids(1, 60), "A", after_s=None)
        a.hints = a.hints.model_copy(update=first)
        sched.add(a)
        run(sched)
        now[0] = 1.0
        b = program_req("b1", ids(2, 200), "B", after_s=None)
        b.hints = b.hints.model_copy(update=first)
        sched.add(b)
        step(sched)
        gate = sched.lookahead.programs
        unknown = bool(wait)
        assert gate.programs[(None, "A")].growth_unknown is unknown
        assert sched.counters["programs_entered"] == 1 + (not unknown), wait  # A, then B?
        assert sched.counters["programs_entered_priced"] == ("next_turn_after_s" in wait)
        gate.growth.ended(gate.programs[(None, "A")])
        assert list(gate.growth.seen) == ([4] if unknown else [])


def test_waits_on_tools_needs_a_continuation():
    """A request that says its next turn waits on its tools says the program goes on: without
    `continuation` the hints are refused by name, not taken as half of it."""
    with pytest.raises(ValueError, match="waits_on_tools needs continuation"):
        GraphHints(program_id="A", waits_on_tools=True)
    assert GraphHints(program_id="A", continuation=True, waits_on_tools=True).waits_on_tools


def test_a_program_held_by_a_later_check_has_not_entered(monkeypatch):
    """Program A passes the gate but a later check (graph eviction keeping room for work
    ahead) holds it for five passes: it has not entered, so nothing is counted and the learned
    headroom does not decay; once it starts it has entered, once. Counted at the gate, each
    held pass decayed the headroom, and two held programs took it to nothing (RESULTS.md)."""
    from runtime.scheduler.admission import ADMIT, SKIP, AdmissionPass

    held = [True]
    monkeypatch.setattr(AdmissionPass, "not_deferred", lambda self, req: SKIP if held[0] else ADMIT)
    sched = scheduler(POOL, eviction_policy="graph")
    gate = sched.lookahead.programs
    gate.headroom_tokens = 100.0
    a = program_req("a1", ids(1, 50), "A", after_s=5.0)
    sched.add(a)
    for _ in range(5):
        step(sched)
    assert a.rid in sched.waiting and gate.headroom_tokens == 100.0
    assert sched.counters["programs_entered"] + sched.counters["programs_entered_priced"] == 0
    held[0] = False
    step(sched)
    assert a.rid not in sched.waiting and gate.headroom_tokens == pytest.approx(90.0)
    assert sched.counters["programs_entered"] == 1


def test_a_late_program_is_not_waited_for():
    sched, a, b = paused_a_then_new_b(per_token_s=0.1)
    sched.lookahead.clock = lambda: 5.0 + 2.0  # A is 2 s past its declared return
    step(sched)
    assert b.rid not in sched.waiting


def test_least_attained_service_enters_first_and_starvation_is_bounded():
    gate_order = []
    for starve in (False, True):
        sched = scheduler(POOL, eviction_policy="graph")
        gate = sched.lookahead.programs
        assert isinstance(gate, ProgramGate)
        old = program_req("o1", ids(4, 60), "old", after_s=None)
        sched.add(old)
        run(sched)  # "old" has computed 60 tokens: attained service
        again = program_req("o2", ids(5, 30), "old", after_s=None)
        fresh = program_req("f1", ids(6, 30), "fresh", after_s=None)
        sched.add(again)
        sched.add(fresh)
        if starve:
            again.usage.submitted_s -= STARVATION_S
        gate_order.append([r.rid for r in gate.entry_order(sched.waiting.values(), 0.0)])
    assert gate_order == [["f1", "o2"], ["o2", "f1"]]


def test_a_forked_programs_service_is_its_longest_path_not_the_sum():
    """ATLAS: "wide" computed 3 branches of 40 tokens on a 20-token trunk (140 in all, 60
    along its longest path); "long" computed 100 in a row. Summed, "wide" would enter after
    "long"; along the critical path it enters first."""
    sched = scheduler(POOL, eviction_policy="graph")
    gate = sched.lookahead.programs
    trunk = program_req("w0", ids(7, 20), "wide", after_s=None)
    sched.add(trunk)
    run(sched)
    for i in range(3):  # the branches extend the trunk: each computes its own 40
        branch = ids(7, 20) + ids(10 + i, 40)
        sched.add(program_req(f"w{i + 1}", branch, "wide", None, branch=f"0.{i}"))
    run(sched)
    sched.add(program_req("l0", ids(8, 100), "long", after_s=None))
    run(sched)
    records = {key[1]: record for key, record in gate.programs.items()}
    assert records["wide"].critical_tokens == 60 and records["long"].critical_tokens == 100
    nexts = [program_req("w9", ids(9, 8), "wide", None), program_req("l9", ids(9, 8), "long", None)]
    for req in reversed(nexts):
        sched.add(req)
    assert [r.rid for r in gate.entry_order(sched.waiting.values(), 0.0)] == ["w9", "l9"]


def test_requests_without_a_program_never_wait_at_the_gate():
    sched, a, _ = paused_a_then_new_b(per_token_s=0.1)
    plain = program_req("p1", ids(7, 150), "x", after_s=None)
    plain.hints = GraphHints()
    sched.add(plain)
    step(sched)
    assert plain.rid not in sched.waiting


class ProgramMachine(RuleBasedStateMachine):
    """Programs of a few turns each, on their trunks or forked branches, pausing for declared
    times, under a small graph-evicted pool; random arrivals, requests naming no program, steps,
    clock jumps and aborts. Invariants after every rule: the scheduler's and the gate's
    (check_integrity), and no program waits at the gate while nothing runs and nothing is
    paused (the gate never holds an idle engine forever)."""

    def __init__(self) -> None:
        super().__init__()
        self.sched = scheduler(POOL, eviction_policy="graph")
        self.now = 0.0
        self.sched.lookahead.clock = lambda: self.now
        priced(self.sched, 0.05)
        self.history: dict[tuple, list[int]] = {}  # (program, branch) -> its last prompt
        self.count = 0

    @rule(program=st.sampled_from("ABCDE"), new=st.integers(10, 70),
          after_s=st.sampled_from([None, 0.0, 0.5, 3.0]),
          priority=st.sampled_from([0, 0, 1]),
          branch=st.sampled_from([None, None, "0.0", "0.1"]))  # fmt: skip
    def arrive(self, program, new, after_s, priority, branch):
        """A turn of `program` on `branch` (forked branches extend the trunk's history: a
        program of several branches is in while any of them runs or keeps its path)."""
        busy = [r for r in (*self.sched.waiting.values(), *self.sched.running)
                if (r.hints.program_id, r.hints.branch_id) == (program, branch)]  # fmt: skip
        if busy:
            return  # a branch's turns come one after another
        self.count += 1
        before = self.history.get((program, branch)) or self.history.get((program, None), [])
        prompt = before + ids(self.count, new)
        req = program_req(f"{program}{self.count}", prompt[-150:], program, after_s, branch=branch)
        with_priority(req, priority)  # (ranks before service: displacing, headroom)
        self.history[program, branch] = req.prompt_ids
        self.sched.add(req)

    @rule(num=st.integers(1, 6))
    def steps(self, num):
        for _ in range(num):
            step(self.sched)

    @rule(new=st.integers(60, 150))
    def plain(self, new):
        """A request naming no program: it never waits at the gate, and evicts kept paths
        when the pool needs their room (their branches come back to lost paths)."""
        self.count += 1
        req = program_req(f"plain{self.count}", ids(self.count, new), "-", after_s=None)
        req.hints = GraphHints()
        self.sched.add(req)
        step(self.sched)

    @rule(seconds=st.sampled_from([0.2, 1.0, 4.0, 40.0]))
    def clock(self, seconds):
        self.now += seconds

    @rule(new=st.integers(40, 120))
    def newcomer_waited_long(self, new):
        """A program never seen, that has waited past any recompute: it displaces the paused
        programs of more service that it needs room from."""
        self.count += 1
        name = f"N{self.count}"
        req = program_req(name, ids(self.count, new), name, after_s=None)
        req.usage.submitted_s -= 100.0
        self.sched.add(req)
        step(self.sched)

    @rule(seconds=st.sampled_from([1.0, 10.0, 100.0]))
    def wait_long(self, seconds):
        """The waiting requests have waited this much longer (displacing, starvation)."""
        for req in self.sched.waiting.values():
            req.usage.submitted_s -= seconds
        step(self.sched)

    @rule(tokens=st.sampled_from([0.0, 40.0, 150.0]))
    def outgrown(self, tokens):
        """The gate learned this headroom (the programs in outgrew the pool): a newcomer
        waits for it unless it outranks every program in."""
        self.sched.lookahead.programs.headroom_tokens = tokens
        step(self.sched)

    @precondition(lambda self: self.sched.waiting or self.sched.running)
    @rule(data=st.data())
    def abort(self, data):
        reqs = sorted([*self.sched.waiting, *(r.rid for r in self.sched.running)])
        self.sched.abort(data.draw(st.sampled_from(reqs)))

    @invariant()
    def consistent(self):
        self.sched.check_integrity()

    @invariant()
    def an_idle_engine_lets_a_program_in(self):
        sched = self.sched
        if sched.waiting and not sched.running and not sched.lookahead.programs.paused:
            step(sched)
            assert sched.running or len(sched.waiting) == 0 or sched.counters["errors"]


TestProgramMachine = ProgramMachine.TestCase
TestProgramMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_a_ttl_pin_keeps_a_tool_waiting_path_until_it_is_back_or_expires():
    for back_after_s, kept in ((2.0, True), (20.0, False)):
        sched = scheduler(POOL, eviction_policy="lru", tool_pin_ttl_s=10.0)
        now = with_clock(sched)
        a = program_req("a1", ids(1, 120), "A", after_s=5.0)
        sched.add(a)
        run(sched)
        assert sched.lookahead.ttl_pins.num_pinned == 1
        assert sched.kv.cache.protected_size >= 120
        now[0] = back_after_s
        other = program_req("b1", ids(2, 150), "B", after_s=None)
        sched.add(other)
        step(sched)
        # while the pin lasts it holds the pool: with nothing running, a request that does not
        # fit beside it fails as busy (retry later)
        assert (other.error_kind == "busy") == kept, other.error
        back = a_returns(sched, a)
        run(sched)
        assert (back.usage.cached_tokens == len(a.all_ids) - 1) == kept
        assert sched.lookahead.ttl_pins.num_pinned == 0 and sched.kv.cache.protected_size == 0


def test_the_wait_is_priced_by_the_gaps_seen_not_the_declared_return():
    """A program declares 5 s for its tools (the slowest it is offered) but is back in 0.5 s:
    once seen, a new program waits for it (0.5 s idle beats recomputing 76 tokens at 20 ms),
    where on the declared 5 s it would have entered."""
    for learned in (False, True):
        sched = scheduler(POOL, eviction_policy="graph")
        now = with_clock(sched)
        priced(sched, 0.02)
        prompt = ids(1, 100)
        for turn in range(3 if learned else 1):
            a = program_req(f"a{turn}", prompt, "A", after_s=5.0)
            sched.add(a)
            run(sched)
            prompt = a.all_ids[:-1] + ids(10 + turn, 6)
            now[0] += 0.5  # the tools' real gap
        now[0] -= 0.4  # B arrives 0.1 s into A's last gap
        b = program_req("b1", ids(2, 150), "B", after_s=None)
        sched.add(b)
        step(sched)
        assert (b.rid in sched.waiting) == learned


def test_returns_of_tools_with_no_declared_latency_are_learned_apart():
    """Program A's gen offers tools that declare no latency (GraphHints.waits_on_tools, no
    next_turn_after_s); its calls take 5 s. Until one has come back A is expected back at
    once, and program B, arriving 0.1 s into A's gap, waits for it; once two returns were
    seen, A is expected 5 s after it pauses, and B enters priced (4.9 s of waiting cost more
    than recomputing what it lacks at 1 ms a token). The same gap seen for requests that
    continue right away is not learned from: C's queued turns, back at once, leave the tools'
    5 s as it is."""
    for learned in (False, True):
        sched = scheduler(POOL, eviction_policy="graph")
        now = with_clock(sched)
        priced(sched, 0.001)
        c = program_req("c0", ids(5, 20), "C", after_s=None)
        c.hints = c.hints.model_copy(update={"continuation": True})
        sched.add(c)
        run(sched)
        sched.add(program_req("c1", c.all_ids[:-1] + ids(6, 4), "C", after_s=None))
        run(sched)
        prompt = ids(1, 100)
        for turn in range(3 if learned else 1):
            a = program_req(f"a{turn}", prompt, "A", after_s=None)
            a.hints = a.hints.model_copy(update={"continuation": True, "waits_on_tools": True})
            sched.add(a)
            run(sched)
            prompt = a.all_ids[:-1] + ids(10 + turn, 6)
            now[0] += 5.0  # the tools' real gap
        now[0] -= 4.9  # B arrives 0.1 s into A's last gap
        sched.add(b := program_req("b1", ids(2, 150), "B", after_s=None))
        step(sched)
        gate = sched.lookahead.programs
        assert gate.gap_s.get((0.0, True)) == (5.0 if learned else None)
        assert gate.gap_s[(0.0, False)] == 0.0  # C's turn, back at once
        assert (b.rid in sched.waiting) is not learned


def with_priority(req: Req, priority: int) -> Req:
    req.hints = req.hints.model_copy(update={"priority": priority})
    return req


def test_a_program_outranking_every_program_in_does_not_wait_for_their_headroom():
    """A (120 tokens computed: service level 2 of a 200-slot pool) is paused and kept, and the
    gate has learned a headroom of 100 tokens for the programs in to grow into. B (30 tokens)
    fits beside A's kept path but not beside the headroom too. With no service yet B outranks A
    (PLAS): it enters at once, displacing nothing. Having computed 100 tokens before (A's
    level), it does not: it waits for A."""
    for b_served_tokens, enters in ((0, True), (100, False)):
        sched = scheduler(POOL, eviction_policy="graph")
        now = with_clock(sched)
        priced(sched, 0.1)  # recomputing a token costs more than A's 4 s wait
        gate = sched.lookahead.programs
        if b_served_tokens:
            sched.add(program_req("b0", ids(4, b_served_tokens), "B", after_s=None))
            run(sched)
        sched.add(program_req("a1", ids(1, 120), "A", after_s=5.0))
        run(sched)
        gate.headroom_tokens = 100.0  # as if the programs in had outgrown the pool
        now[0] = 1.0
        b = program_req("b1", ids(2, 30), "B", after_s=None)
        sched.add(b)
        step(sched)
        assert (b.rid not in sched.waiting) is enters, b_served_tokens
        assert gate.displaced == 0 and len(gate.paused) == 1  # A's path is still kept
        assert sched.counters["program_entries_deferred"] == int(not enters)


def test_priority_ranks_before_service_in_displacing():
    """B has the service level of paused A (as in the test above, where it displaces none),
    but a higher priority: once it has waited A's recompute, A is displaced. A program of
    higher priority than the newcomer keeps its path however less served the newcomer is."""
    sched, a, b = paused_a_then_new_b(per_token_s=0.1, b_served_tokens=100)
    with_priority(b, 1).usage.submitted_s -= 1_000.0
    step(sched)
    assert b.rid not in sched.waiting and sched.lookahead.programs.displaced == 1
    sched = scheduler(POOL, eviction_policy="graph")
    with_clock(sched)
    priced(sched, 0.1)
    a = with_priority(program_req("a1", ids(1, 120), "A", after_s=5.0), 1)
    sched.add(a)
    run(sched)
    b = program_req("b1", ids(2, 150), "B", after_s=None)  # no service at all
    sched.add(b)
    b_waits_however_long_and_a_keeps_its_path(sched, a, b)


def test_a_client_naming_a_new_program_per_request_keeps_the_gate_bounded():
    sched = scheduler(POOL, eviction_policy="graph")
    gate = sched.lookahead.programs
    for n in range(MAX_BRANCHES + 50):
        gate.arrived(program_req(f"r{n}", [3, 4], f"p{n}", after_s=None), 0.0)
    assert len(gate.programs) == MAX_BRANCHES and (None, "p0") not in gate.programs


def test_a_program_larger_than_the_pool_fails_at_once_and_holds_no_entry():
    sched, a, b = paused_a_then_new_b(per_token_s=0.1)  # B waits for A (as above)
    huge = program_req("h1", ids(8, POOL + 10), "H", after_s=None)
    huge.hints = GraphHints(program_id="H", priority=100)  # first in entry order
    sched.add(huge)
    step(sched)
    assert huge.gen.finished and "raise max_kv_tokens" in huge.error
    assert b.rid in sched.waiting  # B still waits for A's return, not for the huge one
    back = a_returns(sched, a)
    run(sched)
    assert back.usage.cached_tokens == len(a.all_ids) - 1 and b.gen.finished


def test_programs_of_different_owners_tied_in_service_are_displaced_without_comparing_keys():
    """Two paused programs of the same level and size, of two owners (keys (None, "A") and
    ("t", "A")), and a newcomer that needs their room: ranking them must not compare the keys."""
    sched = scheduler(POOL, eviction_policy="graph")
    with_clock(sched)
    priced(sched, 0.1)  # their recompute costs more than waiting the 2 s for their return
    for namespace, seed in ((None, 1), ("t", 2)):
        paused = program_req(f"a{seed}", ids(seed, 60), "A", after_s=2.0)
        paused.namespace = namespace
        sched.add(paused)
        run(sched)
    b = program_req("b1", ids(3, 150), "B", after_s=None)
    sched.add(b)
    b.usage.submitted_s -= 1_000.0
    step(sched)
    assert b.rid not in sched.waiting and sched.lookahead.programs.displaced >= 1
