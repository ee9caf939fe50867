"""Arrival orders for multi-turn program batches: the programs run as written (run_batch, so
every graph hint, pin and continuation is what production would send), and a backend decides
when each request reaches the engine.

- rounds: every user's turn t arrives together, then every user's turn t+1;
- interleaved: users arrive at random times, each user's turns in order with a random think
  time between them; simulated on a clock where one turn takes one unit, then released in
  waves of `wave_size` requests (a user appears at most once per wave).

A wave is released when all of its requests exist (their programs reached them) and goes to the
engine in one command (`Engine.submit_many`); the next wave waits until it has finished. So the
admission order, and with greedy decoding every counter, is the same in every run.

Told think times: a client that knows when it will be back (a tool call's latency, a scheduled
job) can say so in `GraphHints.next_turn_after_s`. `think_hints` computes what such clients
would declare, and the backend runs the engine's eviction clock on the simulated one.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from concurrent.futures import Future

from flowlang.backends.base import Backend, GenerationHandle, PinLease
from flowlang.backends.local import LocalBackend
from runtime.protocol import GenerateRequest, GraphHints, ScoreRequest, ScoreResult

Turn = tuple[int, int]  # (instance index, turn index)
STALL_S = 60.0  # a wave whose requests never all come (an instance failed) ends the schedule


def rounds_schedule(num_users: int, num_turns: int) -> list[list[Turn]]:
    """Every user's turn t in one wave, turn by turn."""
    return [[(user, turn) for user in range(num_users)] for turn in range(num_turns)]


def interleaved_arrivals(
    num_users: int, num_turns: int, wave_size: int, seed: int = 0, think_jitter: float = 0.5
) -> dict[Turn, float]:
    """When each turn arrives on the simulated clock (one turn takes one unit): users arrive at
    random over about one cycle and think 1 +- `think_jitter` cycles between turns (a cycle
    is `num_users / wave_size` turn durations)."""
    rng = random.Random(seed)
    cycle = num_users / wave_size
    arrivals: dict[Turn, float] = {}
    for user in range(num_users):
        time = rng.uniform(0, cycle)
        for turn in range(num_turns):
            arrivals[(user, turn)] = time
            time += 1 + (1 + rng.uniform(-think_jitter, think_jitter)) * cycle
    return arrivals


def interleaved_schedule(
    num_users: int, num_turns: int, wave_size: int, seed: int = 0, think_jitter: float = 0.5
) -> list[list[Turn]]:
    """Interleaved arrivals cut into waves of distinct users. With no jitter a user's return
    order is its pause order; with jitter only a recording (or the user) knows it."""
    return waves_of(
        interleaved_arrivals(num_users, num_turns, wave_size, seed, think_jitter), wave_size
    )


def waves_of(arrivals: dict[Turn, float], wave_size: int) -> list[list[Turn]]:
    """The arrivals in time order, cut into waves of at most `wave_size` distinct users."""
    waves: list[list[Turn]] = [[]]
    for (user, turn), _ in sorted(arrivals.items(), key=lambda item: (item[1], item[0])):
        if len(waves[-1]) == wave_size or any(u == user for u, _ in waves[-1]):
            waves.append([])
        waves[-1].append((user, turn))
    return waves


def think_hints(
    schedule: list[list[Turn]], arrivals: dict[Turn, float]
) -> tuple[list[float], dict[Turn, float]]:
    """The simulated clock at each wave's release (its last arrival), and for every turn with a
    next one, how long after its wave's release that next turn arrives: what a client that
    knows its think time declares as `next_turn_after_s`."""
    wave_times, wave_of = [], {}
    for index, wave in enumerate(schedule):
        wave_times.append(max(arrivals[t] for t in wave))
        wave_of.update({t: index for t in wave})
    hints = {
        (user, turn): max(0.0, arrivals[(user, turn + 1)] - wave_times[wave_of[(user, turn)]])
        for (user, turn) in arrivals
        if (user, turn + 1) in arrivals
    }
    return wave_times, hints


class _Pending:
    """A generate call waiting for its wave; iterates and resolves once submitted."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.handle: Future[GenerationHandle] = Future()

    def __iter__(self):
        return iter(self.handle.result())

    def result(self):
        return self.handle.result().result()


class PacedBackend(Backend):
    """A LocalBackend whose generate requests reach the engine in a fixed schedule of waves.

    Instances are told apart by their first prompt (`first_prompts[i]` is instance i's), turns
    by counting each program run's requests. With `wave_times` and `hints` (think_hints), each
    continuation declares its think time and `clock` is the simulated time of the running wave.
    """

    def __init__(
        self,
        inner: LocalBackend,
        first_prompts: Sequence[Sequence[int]],
        schedule: list[list[Turn]],
        wave_times: Sequence[float] | None = None,
        hints: dict[Turn, float] | None = None,
    ) -> None:
        self.inner = inner
        self._wave_times = wave_times
        self._hints = hints or {}
        self.now = 0.0
        self.chat_format = inner.chat_format
        self._instance_of_prompt = {tuple(p): i for i, p in enumerate(first_prompts)}
        if len(self._instance_of_prompt) != len(first_prompts):
            raise ValueError("instances need distinct first prompts to be told apart")
        self._schedule = schedule
        self._instance_of_run: dict[str, int] = {}
        self._num_turns: dict[str, int] = {}
        self._pending: dict[Turn, _Pending] = {}
        self._failure: str | None = None
        self._arrived = threading.Condition()
        self._thread = threading.Thread(target=self._release, daemon=True, name="paced-release")
        self._thread.start()

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.inner.tokenize(text, add_special_tokens)

    def score(self, request: ScoreRequest) -> ScoreResult:
        return self.inner.score(request)

    def pin(
        self, prefix_ids: list[int], namespace: str | None = None, hints: GraphHints | None = None
    ) -> PinLease:
        return self.inner.pin(prefix_ids, namespace, hints)

    def generate(self, request: GenerateRequest) -> GenerationHandle:
        run = request.hints.program_id
        pending = _Pending(request)
        with self._arrived:
            if run not in self._instance_of_run:
                self._instance_of_run[run] = self._instance_of_prompt[tuple(request.input_ids)]
            turn = self._num_turns.get(run, 0)
            self._num_turns[run] = turn + 1
            key = (self._instance_of_run[run], turn)
            if request.hints.continuation and key in self._hints:
                hints = request.hints.model_copy(update={"next_turn_after_s": self._hints[key]})
                pending.request = request.model_copy(update={"hints": hints})
            self._pending[key] = pending
            if self._failure is not None:
                pending.handle.set_exception(RuntimeError(self._failure))
            self._arrived.notify_all()
        return pending

    def clock(self) -> float:
        """The simulated time: the running wave's release (engine_tools.set_eviction_clock)."""
        return self.now

    def _release(self) -> None:
        for index, wave in enumerate(self._schedule):
            if self._wave_times is not None:
                self.now = self._wave_times[index]  # the previous wave has finished
            with self._arrived:
                if not self._arrived.wait_for(
                    lambda w=wave: all(t in self._pending for t in w), timeout=STALL_S
                ):
                    self._fail_waiting([t for t in wave if t not in self._pending])
                    return
                batch = [self._pending.pop(t) for t in wave]
            handles = self.inner.engine.submit_many([p.request for p in batch])
            for pending, handle in zip(batch, handles, strict=True):
                pending.handle.set_result(handle)
            for handle in handles:
                handle.result()  # the next wave arrives after this one finished

    def _fail_waiting(self, missing: list[Turn]) -> None:
        """Fail every request still waiting for its wave (the caller holds the lock)."""
        self._failure = f"paced schedule stalled: turns {missing[:4]} never came"
        for pending in self._pending.values():
            pending.handle.set_exception(RuntimeError(self._failure))
