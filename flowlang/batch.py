"""A batch of program instances run by plan: each group on its backend, the shared prefixes of
the group pinned once for as long as needed. `Program.run_batch` compiles the instances, the
backend places them (`Backend.plan_batch`), and `BatchRun.execute` runs the plan."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from flowlang.backends.base import Backend, BatchInstance, BatchPlan, PinLease, PlacedGroup
from flowlang.errors import InstanceError
from flowlang.graph import RequestGraph
from runtime.prefix import shared_prefixes, union_prefix_tokens

# runs one instance (its arguments) on a backend and returns its state
RunOne = Callable[[Mapping[str, Any], Backend], Any]


def batch_instance(graph: RequestGraph) -> BatchInstance:
    """What placement needs of a compiled instance: its first prompt, and what its later static
    requests add (dynamic ones, after a gen, are not known before it runs)."""
    first = tuple(graph.first_prompt() or ())
    static = [r.prompt_ids for r in graph.requests if r.prompt_ids]
    extra = union_prefix_tokens(static) - len(first) if static else 0
    return BatchInstance(first, extra)


@dataclass
class BatchRun:
    """One `run_batch`: the instances' arguments and prefixes, how to run one, the options."""

    batch: Sequence[Mapping[str, Any]]
    instances: Sequence[BatchInstance]
    run_one: RunOne
    namespace: str | None
    min_shared_tokens: int
    max_workers: int
    progress: Any = None  # a tqdm bar, or None
    on_result: Callable[[int, Any], None] = lambda index, state: None  # each state as it ends

    def execute(self, plan: BatchPlan) -> list:
        """Every group of `plan` at once; results (a state or an InstanceError) in batch order."""
        results: list = [None] * len(self.batch)
        if len(plan.groups) == 1:  # one backend: no thread beyond the group's own workers
            self._run_group(plan.groups[0], results)
            return results
        # the replicas work at once, each on its group (the groups write disjoint indices)
        with ThreadPoolExecutor(max_workers=len(plan.groups) or 1) as pool:
            done = [pool.submit(self._run_group, group, results) for group in plan.groups]
        for future in done:
            future.result()  # a group's own failure (a refused pin); instances' are in results
        return results

    def _run_group(self, group: PlacedGroup, results: list) -> None:
        """One group on its backend: its shared prefixes pinned first, each released when the
        last instance reading it finishes; a failing instance yields an InstanceError."""
        prompts = [self.instances[i].prefix_ids for i in group.indices]
        pins = SharedPrefixPins(group.backend, prompts, self.namespace, self.min_shared_tokens)
        workers = max(1, min(self.max_workers, len(group.indices)))
        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                pins.acquire(pool)
                futures = {
                    pool.submit(self.run_one, self.batch[index], group.backend): (position, index)
                    for position, index in enumerate(group.indices)
                }
                for future in as_completed(futures):
                    position, index = futures[future]
                    try:
                        results[index] = future.result()
                        self.on_result(index, results[index])
                    except Exception as err:  # noqa: BLE001 - reported per instance
                        results[index] = InstanceError(index, err, traceback.format_exc())
                    pins.finished(position)
                    if self.progress is not None:
                        self.progress.update(1)
        finally:
            pins.release_all()


@dataclass
class _Pin:
    prefix: tuple[int, ...]
    readers: set[int]  # instances that will still read it
    lease: PinLease | None = None


class SharedPrefixPins:
    """Pins every branching point of the batch's prefix tree (the longest common prefix of
    each pair of neighbouring prompts in sorted order, when long enough): few-shot blocks that
    depend on arguments included. Each pin knows which instances read it and is released when
    the last of them finishes: the engine is told the future uses, not left to guess them."""

    def __init__(
        self,
        backend: Backend,
        prompts: Sequence[Sequence[int] | None],
        namespace: str | None,
        min_tokens: int,
    ) -> None:
        self.backend = backend
        self.namespace = namespace
        found = shared_prefixes(prompts, min_tokens)
        self.pins = [_Pin(prefix, readers) for prefix, readers in found]

    def acquire(self, pool: Executor) -> None:
        """Prefill and lock every shared prefix (concurrently; each is computed once)."""
        leases = pool.map(lambda pin: self.backend.pin(list(pin.prefix), self.namespace), self.pins)
        for pin, lease in zip(self.pins, leases, strict=True):
            pin.lease = lease

    def finished(self, index: int) -> None:
        """Instance `index` is done: release the pins no other instance still reads."""
        for pin in self.pins:
            if index in pin.readers:
                pin.readers.discard(index)
                if not pin.readers and pin.lease is not None:
                    pin.lease.release()
                    pin.lease = None

    def release_all(self) -> None:
        """Release every pin still held (the batch ended, or failed)."""
        for pin in self.pins:
            if pin.lease is not None:
                pin.lease.release()
                pin.lease = None
