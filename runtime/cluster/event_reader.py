"""One replica's KV events read from the driver through Ray, with the surface of a local
`KVEventSubscription` (snapshot, poll, closed, close): the front's /v1/flowlang/kv_events
streams it exactly as a single engine's server streams its own."""

from __future__ import annotations

from typing import Any

from runtime.cache.events import KVEvent, KVEventsLostError, KVSnapshot


class RemoteKVSubscription:
    """A reader opened on a replica actor (`Replica.open_reader`)."""

    def __init__(self, ray: Any, actor: Any, reader_id: str, snapshot: KVSnapshot) -> None:
        self.snapshot = snapshot
        self._ray, self._actor, self._reader_id = ray, actor, reader_id
        self._closed = False

    def poll(self, timeout_s: float = 0.0) -> list[KVEvent]:
        """The replica's pending events (waiting up to `timeout_s` for one); none once the
        replica died (then `closed`)."""
        if self._closed:
            return []
        try:
            events = self._ray.get(self._actor.poll_reader.remote(self._reader_id, timeout_s))
        except self._ray.exceptions.RayActorError:
            self._closed = True  # died: its stream ends; a new one starts from a snapshot
            return []
        if events is None:
            self.close()
            raise KVEventsLostError(
                "this reader fell behind the replica's events (or its engine stopped); "
                "subscribe again to get a fresh snapshot"
            )
        return events

    @property
    def closed(self) -> bool:
        """Whether the stream ended (closed here, lost, or the replica died)."""
        return self._closed

    def close(self) -> None:
        """End the reader on the replica too."""
        if not self._closed:
            self._closed = True
            self._actor.close_reader.remote(self._reader_id)
