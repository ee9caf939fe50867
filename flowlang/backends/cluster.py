"""ClusterBackend: programs on engine replicas behind a router (runtime.cluster, on Ray).

Requests are routed one by one (the cluster's policy; a fork's branches follow its pin).
`program.run_batch(batch, backend=ClusterBackend(...))` places whole instances first (through
`plan_batch`): the batch's compiled prefixes are partitioned so that
instances sharing the deepest prefixes run on one replica with token load balanced
(runtime/cluster/placement.py); each replica's share then runs there as a group of the batch
(its shared prefixes pinned there, each prefilled once).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from flowlang.backends.base import (
    Backend,
    BatchInstance,
    BatchPlan,
    GenerationHandle,
    PinLease,
    PlacedGroup,
)
from flowlang.chat import CHATML, ChatFormat
from runtime.protocol import GenerateRequest, GenerateResult, GraphHints, ScoreRequest, ScoreResult


class ClusterHandle:
    """A routed generation: no token streaming across the cluster, the text comes whole."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def __iter__(self) -> Iterator[str]:
        yield self.result().text

    def result(self) -> GenerateResult:
        """The one answer (re-run elsewhere if its replica died)."""
        return self._future.result()


class ClusterBackend(Backend):
    """Runs programs on a `runtime.cluster.cluster.Cluster`; `replica` fixes every request of
    this backend to one replica (placement's per-replica views); `place=False` leaves a batch
    to the router, request by request (to compare routing policies with placement).

    >>> from runtime.cluster.cluster import Cluster  # doctest: +SKIP
    >>> backend = ClusterBackend(Cluster(EngineConfig(model=path)), tokenizer)  # doctest: +SKIP
    """

    def __init__(
        self, cluster: Any, tokenizer: Any, replica: int | None = None, place: bool = True
    ) -> None:
        if tokenizer is None:
            raise ValueError("ClusterBackend needs the model's tokenizer")
        self.cluster = cluster
        self.tokenizer = tokenizer
        self.replica = replica
        self.place = place
        self.chat_format = ChatFormat(
            tokenizer.chat_template or CHATML, tokenizer.bos_token or "", tokenizer.eos_token or ""
        )
        from runtime.constrain.formats import model_reasoning_format, model_tool_format

        self.tool_format = model_tool_format(cluster.engine_config, tokenizer)  # as replicas say
        self.reasoning_format = model_reasoning_format(cluster.engine_config, tokenizer)

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids, with the replicas' tokenizer loaded here."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def generate(self, request: GenerateRequest) -> GenerationHandle:
        """Route and start a generation; returns at once."""
        return ClusterHandle(self.cluster.submit(request, prefer=self.replica))

    def score(self, request: ScoreRequest) -> ScoreResult:
        """Score continuations on a routed replica."""
        return self.cluster.score(request, prefer=self.replica)

    def pin(
        self, prefix_ids: list[int], namespace: str | None = None, hints: GraphHints | None = None
    ) -> PinLease:
        """Pin on one replica; requests extending the prefix are routed there."""
        return self.cluster.pin(prefix_ids, namespace, hints, prefer=self.replica)

    def on_replica(self, replica: int) -> ClusterBackend:
        """A view whose requests all go to `replica`."""
        return ClusterBackend(self.cluster, self.tokenizer, replica, self.place)

    def run_batch(self, program: Any, batch: Sequence[Mapping[str, Any]], **options: Any) -> list:
        """`program.run_batch(batch, backend=self, **options)`: placed graph-aware."""
        return program.run_batch(batch, backend=self, **options)

    def place_batch(
        self, program: Any, batch: Sequence[Mapping[str, Any]], options: Mapping[str, Any]
    ) -> list | None:
        """None where this backend leaves a batch to the router (a view of one replica, or
        `place=False`); else the batch run placed, as `run_batch`. (`program.run_batch` asks
        `plan_batch` instead; this stays for callers of the earlier protocol.)"""
        if not self._places():
            return None
        return self.run_batch(program, batch, **options)

    def plan_batch(self, instances: Sequence[BatchInstance], namespace: str | None) -> BatchPlan:
        """Place the batch's compiled instances on the replicas: those sharing the deepest
        prefixes together, computed tokens balanced (runtime/cluster/placement.py); each
        replica's group runs on a view of that replica, its shared prefixes pinned there. A
        view of one replica, or a backend made with `place=False`, keeps the batch whole
        (routed request by request)."""
        if not self._places():
            return super().plan_batch(instances, namespace)
        from runtime.cluster.placement import Instance, place_batch

        replicas = self.cluster.router.replica_ids
        placement = place_batch(
            [Instance(namespace, i.prefix_ids, i.num_extra_tokens) for i in instances],
            len(replicas),
        )
        groups: dict[int, list[int]] = {}
        for index, slot in enumerate(placement):
            groups.setdefault(slot, []).append(index)
        return BatchPlan(
            tuple(
                PlacedGroup(self.on_replica(replicas[slot]), tuple(indices))
                for slot, indices in groups.items()
            )
        )

    def _places(self) -> bool:
        """Whether this backend places batches itself (else the router routes each request)."""
        return self.replica is None and self.place
