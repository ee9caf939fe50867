"""Grammar masks are filled off the step (constrain/masks.py) and a constrained request samples
only once its mask is ready (scheduler/grammar_gate.py): a slow mask never holds back the
other requests of a step, deferred requests all progress, and greedy outputs do not change.

Slow masks are faked by wrapping ConstraintState.fill_mask: no assertion here reads a clock."""

from __future__ import annotations

import threading
import time

import pytest

from runtime.config import EngineConfig
from runtime.constrain.grammar import ConstraintState
from runtime.constrain.masks import MaskWorkers
from runtime.engine import Engine
from runtime.protocol import Constraint, GenerateRequest, SamplingParams
from runtime.scheduler.grammar_gate import GrammarGate
from runtime.scheduler.request import ReqKind

GREEDY = SamplingParams(max_new_tokens=10, temperature=0)
CONSTRAINTS = (
    Constraint(regex=r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."),
    Constraint(regex=r"\(\d{3}\) \d{3}-\d{4}"),
    Constraint(choices=["alpha beta gamma", "delta epsilon"]),
    Constraint(json_schema={"type": "object", "properties": {"n": {"type": "integer"}}}),
)


def engine(model_dir, **kwargs) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), max_kv_tokens=4096, **kwargs))


def constrained(i: int) -> GenerateRequest:
    """Request c{i}: the prompt and constraint of c{i % len(CONSTRAINTS)}."""
    kind = i % len(CONSTRAINTS)
    return GenerateRequest(
        rid=f"c{i}", text=f"Write thing {kind}:", sampling=GREEDY, constraint=CONSTRAINTS[kind]
    )


def plain() -> GenerateRequest:
    return GenerateRequest(
        rid="plain",
        input_ids=[1, 2, 3],
        sampling=SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
    )


@pytest.fixture(scope="module")
def alone(tiny_model_dir):
    """Each request's greedy output, run alone, and the steps the plain request takes."""
    outputs = {}
    with engine(tiny_model_dir) as eng:
        (result,) = eng.generate(plain())
        outputs["plain"] = result.output_ids
        plain_steps = eng.stats()["steps_total"]
        for i in range(len(CONSTRAINTS)):
            (result,) = eng.generate(constrained(i))
            assert result.finish_reason in ("stop", "length"), result.error
            outputs[f"c{i}"] = result.output_ids
    return outputs, plain_steps


def fills_on(monkeypatch, before_fill) -> list[str]:
    """Wrap every mask fill: `before_fill(state)` runs first; returns the names of the threads
    the fills ran on."""
    threads: list[str] = []
    original = ConstraintState.fill_mask

    def fill_mask(self) -> None:
        if not self.mask_ready:
            threads.append(threading.current_thread().name)
            before_fill(self)
        original(self)

    monkeypatch.setattr(ConstraintState, "fill_mask", fill_mask)
    return threads


def test_a_mask_that_never_comes_holds_back_no_one_else(tiny_model_dir, alone, monkeypatch):
    """The constrained request's first mask is stuck until the plain request is done: the plain
    request runs in exactly the steps it takes alone, and the other then runs to its greedy
    output. Before the mask workers, its fill ran in the step and the plain request waited."""
    outputs, plain_steps = alone
    release = threading.Event()
    threads = fills_on(monkeypatch, lambda state: release.wait(60))
    with engine(tiny_model_dir) as eng:
        handles = eng.submit_many([constrained(0), plain()])
        assert handles[1].result(timeout=60).output_ids == outputs["plain"]
        stats = eng.stats()
        assert stats["steps_total"] == plain_steps
        assert stats["grammar_admission_waits_total"] > 0
        assert stats["num_waiting"] == 1, "not admitted: its first mask is not ready"
        release.set()
        assert handles[0].result(timeout=60).output_ids == outputs["c0"]
        eng.check_integrity()
    assert threads and set(threads) == {"flowlang-masks"}, "no fill in the engine's step"


def test_deferred_requests_all_progress_to_their_greedy_outputs(
    tiny_model_dir, alone, monkeypatch, engine_steps_checked, step_counter
):
    """Every mask takes at least one more engine step to fill (while steps run), and the
    step budget is 0: constrained requests sit out steps, all the time. Each still finishes
    with its greedy output, and the plain request still takes its steps alone."""
    outputs, plain_steps = alone

    def at_least_a_step(state) -> None:
        step_counter.wait_for_next(timeout_s=0.2)  # or no step comes

    threads = fills_on(monkeypatch, at_least_a_step)
    requests = [constrained(i) for i in range(2 * len(CONSTRAINTS))]
    with engine(tiny_model_dir, grammar_step_budget_ms=0) as eng:
        handles = eng.submit_many([*requests, plain()])
        results = {h.rid: h.result(timeout=120) for h in handles}
        stats = eng.stats()
    assert results["plain"].output_ids == outputs["plain"]
    for i in range(len(requests)):
        got = results[f"c{i}"]
        assert got.finish_reason in ("stop", "length"), got.error
        assert got.output_ids == outputs[f"c{i % len(CONSTRAINTS)}"], f"request c{i}"
    assert stats["grammar_deferrals_total"] > 0
    assert stats["grammar_background_fills_total"] > 0
    assert set(threads) == {"flowlang-masks"}


def test_speculative_and_jump_forward_keep_their_outputs_with_slow_masks(
    tiny_model_dir, alone, monkeypatch
):
    """Speculative decoding (drafts verified in the step; a constrained row's masks after the
    first guess are filled there, so with no budget it guesses nothing) and jump-forward
    (forced text appended after a sampled token, the next mask filled after it): with slowed
    fills, outputs are those of plain decoding."""
    outputs, _ = alone
    fills_on(monkeypatch, lambda state: time.sleep(0.002))
    requests = [constrained(i) for i in range(len(CONSTRAINTS))]
    for budget_ms in (0, 50):
        with engine(tiny_model_dir, speculative="tree", grammar_step_budget_ms=budget_ms) as eng:
            results = eng.generate([*requests, plain()])
            assert eng.stats()["jump_forward_tokens_total"] > 0
        for i, result in enumerate(results[:-1]):
            assert result.output_ids == outputs[f"c{i}"], f"request c{i}, budget {budget_ms}"
        assert results[-1].output_ids == outputs["plain"]


# ---------------------------------------------------------------- the pieces
class FakeState:
    """A ConstraintState's part that MaskWorkers uses."""

    def __init__(self, name: str, fill_s: float | None, order: list[str], gate=None) -> None:
        self.name, self.fill_s, self.order, self.gate = name, fill_s, order, gate
        self.mask_ready = False
        self.num_moves = 0
        self.entered = threading.Event()

    def fill_mask(self) -> None:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        if self.name == "broken":
            raise RuntimeError("the matcher broke")
        self.order.append(self.name)
        self.mask_ready = True


def test_mask_workers_take_cheap_fills_first_but_never_starve_a_costly_one():
    order: list[str] = []
    gate = threading.Event()
    workers = MaskWorkers(num_threads=1)
    blocker = FakeState("blocker", None, order, gate)
    workers.submit(blocker)  # holds the only worker while the others queue
    costly = FakeState("costly", 3600.0, order)  # its last fill took an hour
    workers.submit(costly)
    cheap = [FakeState(f"cheap{i}", 0.0, order) for i in range(3)]
    for state in cheap:
        workers.submit(state)
    aged = FakeState("aged", 0.001, order)  # queued before `late`, expected to end first
    workers.submit(aged)
    time.sleep(0.01)
    late = FakeState("late", 0.0, order)
    workers.submit(late)
    workers.submit(cheap[0])  # pending already: not queued twice
    assert workers.num_pending == 7
    gate.set()
    workers.wait_quick(3600.0, time.monotonic() + 30)  # every one counts as quick here
    assert order == ["blocker", "cheap0", "cheap1", "cheap2", "aged", "late", "costly"]
    assert workers.num_pending == 0 and workers.num_fills == 7


def test_a_step_waits_for_quick_masks_only_while_a_worker_is_on_them_or_free():
    order: list[str] = []
    gate, quick_gate = threading.Event(), threading.Event()
    workers = MaskWorkers(num_threads=1)
    assert not workers.expects_quick_fill(0.05)  # nothing pending
    slow = FakeState("slow", 2.0, order, gate)
    workers.submit(slow)
    assert slow.entered.wait(30)
    assert not workers.expects_quick_fill(0.05), "busy with a slow fill: nothing quick comes"
    quick = FakeState("quick", None, order, quick_gate)
    workers.submit(quick)
    assert not workers.expects_quick_fill(0.05), "queued behind a slow fill: no use waiting"
    gate.set()
    assert quick.entered.wait(30)
    assert workers.expects_quick_fill(0.05), "the quick one is under way"
    quick_gate.set()
    workers.wait_quick(0.05, time.monotonic() + 30)
    assert order == ["slow", "quick"] and not workers.expects_quick_fill(0.05)


def test_mask_workers_cancel_a_queued_fill():
    order: list[str] = []
    gate = threading.Event()
    workers = MaskWorkers(num_threads=1)
    blocker, dropped = FakeState("blocker", None, order, gate), FakeState("dropped", 0.0, order)
    workers.submit(blocker)
    workers.submit(dropped)
    workers.cancel(dropped)
    assert not workers.is_pending(dropped)
    gate.set()
    workers.wait_quick(1.0, time.monotonic() + 30)
    assert order == ["blocker"]


def test_a_failed_fill_is_left_to_the_step_which_reports_it():
    order: list[str] = []
    workers = MaskWorkers(num_threads=1)
    broken = FakeState("broken", None, order)
    workers.submit(broken)
    workers.wait_quick(1.0, time.monotonic() + 30)
    assert workers.has_failed(broken) and not workers.is_pending(broken)
    workers.submit(broken)  # not again at the same position: the step fills it and fails
    assert not workers.is_pending(broken)
    broken.num_moves += 1  # a new position: the workers try again
    assert not workers.has_failed(broken)
    workers.submit(broken)
    workers.wait_quick(1.0, time.monotonic() + 30)
    assert workers.num_fills == 2 and workers.has_failed(broken)


class FakeReq:
    kind = ReqKind.GENERATE

    def __init__(self, fill_s: float | None) -> None:
        state = FakeState("s", fill_s, [])
        self.gen = type("Gen", (), {"constraint": state, "finished": False})()


def test_drafts_of_constrained_requests_fit_the_step_budget():
    gate = GrammarGate(step_budget_ms=50, num_threads=1)
    assert gate.max_draft_tokens(FakeReq(fill_s=None), 8) == 0  # no fill measured yet
    assert gate.max_draft_tokens(FakeReq(fill_s=0.00002), 8) == 8
    assert gate.max_draft_tokens(FakeReq(fill_s=0.02), 8) == 2
    assert gate.max_draft_tokens(FakeReq(fill_s=0.7), 8) == 0
