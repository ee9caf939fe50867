"""Benchmark and test hooks into an Engine, off its public class: they read or set the
scheduler's state on the loop thread (the only thread that may touch it).

>>> config = EngineConfig(model="smollm2-135m-instruct", record_trace=True)  # doctest: +SKIP
>>> with Engine(config) as engine:  # doctest: +SKIP
...     engine.generate([GenerateRequest(text="Hi")])
...     trace = cache_trace(engine)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from runtime.engine import Engine
from runtime.errors import InvalidRequestError


def cache_trace(engine: Engine) -> list[tuple]:
    """The recorded access trace (EngineConfig.record_trace): ("access", namespace, ids,
    match_limit) at each admission and ("insert", namespace, ids) at each tree insert."""
    return engine.call_in_loop(lambda: list(engine.scheduler.kv.trace or ()))


def load_eviction_oracle(engine: Engine, trace: Sequence[tuple]) -> None:
    """The "oracle" eviction policy's future: a `cache_trace` recorded by a run of the same
    work (greedy); call before the first request."""
    config = engine.config
    if config.eviction_policy != "oracle" or config.disable_radix_cache:
        raise InvalidRequestError(
            "load_eviction_oracle needs eviction_policy='oracle' and the radix cache on"
        )
    engine.call_in_loop(lambda: engine.scheduler.kv.marks.load(trace))


def set_eviction_clock(engine: Engine, clock: Callable[[], float]) -> None:
    """The clock (seconds) that times when paused program branches are expected back
    (`GraphHints.next_turn_after_s`), for runs on a simulated clock."""
    engine.call_in_loop(lambda: setattr(engine.scheduler.lookahead, "clock", clock))
