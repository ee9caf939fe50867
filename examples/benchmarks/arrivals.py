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


def interleaved_schedule(
    num_users: int, num_turns: int, wave_size: int, seed: int = 0, think_jitter: float = 0.5
) -> list[list[Turn]]:
    """Random arrivals over about one cycle, think times of 1 +- `think_jitter` cycles (a cycle
    is `num_users / wave_size` turn durations), cut into waves of distinct users. With no
    jitter a user's return order is its pause order; with jitter only a recording knows it."""
    rng = random.Random(seed)
    cycle = num_users / wave_size
    events = []
    for user in range(num_users):
        time = rng.uniform(0, cycle)
        for turn in range(num_turns):
            events.append((time, user, turn))
            time += 1 + (1 + rng.uniform(-think_jitter, think_jitter)) * cycle
    events.sort()
    waves: list[list[Turn]] = [[]]
    for _, user, turn in events:
        if len(waves[-1]) == wave_size or any(u == user for u, _ in waves[-1]):
            waves.append([])
        waves[-1].append((user, turn))
    return waves


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
    by counting each program run's requests.
    """

    def __init__(
        self,
        inner: LocalBackend,
        first_prompts: Sequence[Sequence[int]],
        schedule: list[list[Turn]],
    ) -> None:
        self.inner = inner
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
            self._pending[(self._instance_of_run[run], turn)] = pending
            if self._failure is not None:
                pending.handle.set_exception(RuntimeError(self._failure))
            self._arrived.notify_all()
        return pending

    def _release(self) -> None:
        for wave in self._schedule:
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
