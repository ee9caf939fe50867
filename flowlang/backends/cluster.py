"""ClusterBackend: programs on engine replicas behind a router (runtime.cluster, on Ray).

Requests are routed one by one (the cluster's policy; a fork's branches follow its pin).
`program.run_batch(batch, backend=ClusterBackend(...))` places whole instances first (through
`place_batch`): the batch's compiled prefixes are partitioned so that
instances sharing the deepest prefixes run on one replica with token load balanced
(runtime/cluster/placement.py); each replica's share then runs as an ordinary `run_batch`
(its shared prefixes pinned there, each prefilled once).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from flowlang.backends.base import Backend, GenerationHandle, PinLease
from flowlang.chat import CHATML, ChatFormat
from flowlang.errors import InstanceError
from runtime.prefix import union_prefix_tokens
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
        """Place the batch's instances on the replicas (those sharing the deepest prefixes
        together, computed tokens balanced), then run each replica's part there as a batch of
        its own (its shared prefixes pinned there). A view of one replica, or a backend made
        with `place=False`, runs it in place (routed request by request)."""
        if self.replica is not None or not self.place:
            return None
        from runtime.cluster.placement import Instance, place_batch

        namespace = options.get("namespace")
        instances = []
        for args in batch:
            graph = program.compile(backend=self, **dict(args))
            first = tuple(graph.first_prompt() or ())
            static = [r.prompt_ids for r in graph.requests if r.prompt_ids]
            # what its later static requests add; dynamic ones (after a gen) are not known yet
            extra = union_prefix_tokens(static) - len(first) if static else 0
            instances.append(Instance(namespace, first, extra))
        replicas = self.cluster.router.replica_ids
        placement = place_batch(instances, len(replicas))
        groups: dict[int, list[int]] = {}
        for index, slot in enumerate(placement):
            groups.setdefault(slot, []).append(index)
        options = {**options, "progress": False}
        with ThreadPoolExecutor(max_workers=len(groups) or 1) as pool:
            futures = {
                slot: pool.submit(
                    program.run_batch,
                    [batch[i] for i in indices],
                    backend=self.on_replica(replicas[slot]),
                    **options,
                )
                for slot, indices in groups.items()
            }
        results: list = [None] * len(batch)
        for slot, indices in groups.items():
            for index, result in zip(indices, futures[slot].result(), strict=True):
                if isinstance(result, InstanceError):  # renumber: the index in the whole batch
                    result = InstanceError(index, result.error, result.traceback_text)
                results[index] = result
        return results
