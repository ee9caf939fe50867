"""With the radix cache disabled, programs compute exactly the prompt tokens they send.

A pin exists to keep a prefix for its readers; without a cache its KV would be freed at once
and every reader would compute it again, so the engine answers a pin with an unheld lease that
computes nothing (issue 37: react computed 2.08x the tokens sent, tree-of-thought +11,491).
"""

from __future__ import annotations

import pytest
from conftest import ServerThread

import flowlang as fl
from flowlang import gen, program, select
from flowlang.backends.local import LocalBackend
from flowlang.backends.remote import RemoteBackend
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.errors import InvalidRequestError

SYSTEM = "You answer arithmetic questions briefly and check your work twice. " * 4


@program
def fork_and_select(s, question):
    s += fl.system(SYSTEM)
    s += fl.user(question)
    branches = s.fork(3)
    for i, branch in enumerate(branches):
        branch += f" Idea {i}:" + gen("idea", max_new_tokens=6, temperature=0.0)
    s.join(branches)
    s += " Verdict:" + select("verdict", ["right", "wrong", "unsure"])
    s += " Answer:" + gen("answer", max_new_tokens=6, temperature=0.0)


BATCH = [{"question": f"What is {i} times {i + 3}?"} for i in range(3)]


def run(tiny_model_dir, *, disable_radix_cache):
    config = EngineConfig(
        model=str(tiny_model_dir), max_kv_tokens=8192, disable_radix_cache=disable_radix_cache
    )
    with Engine(config) as engine:
        backend = LocalBackend(engine, record=True)
        leases = []
        real_pin = backend.pin
        backend.pin = lambda *a, **k: leases.append(real_pin(*a, **k)) or leases[-1]
        states = fork_and_select.run_batch(BATCH, backend=backend, progress=False)
        assert all(isinstance(s, fl.ProgramState) for s in states), states
        return [s.variables() for s in states], engine.stats(), backend.prompt_report(), leases


def test_cache_off_computes_exactly_the_tokens_sent(tiny_model_dir):
    on_outputs, on_stats, on_report, on_leases = run(tiny_model_dir, disable_radix_cache=False)
    off_outputs, off_stats, off_report, off_leases = run(tiny_model_dir, disable_radix_cache=True)
    assert off_outputs == on_outputs, "greedy outputs do not depend on the cache"
    assert off_report["prompt_tokens"] == on_report["prompt_tokens"]
    assert off_stats["prefill_tokens_total"] == off_report["prompt_tokens"]
    # the same pins were asked for (3 forks, and the batch's shared prefix): none was held
    assert len(off_leases) == len(on_leases) >= 4
    assert all(lease.info.held for lease in on_leases)
    assert not any(lease.info.held for lease in off_leases)
    assert off_stats["num_pins"] == on_stats["num_pins"] == 0
    assert on_stats["prefill_tokens_total"] < on_report["prompt_tokens"], "the cache still shares"


def test_unheld_pin_computes_nothing_and_releases_cleanly(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096, disable_radix_cache=True)
    with Engine(config) as engine:
        pin = engine.pin(list(range(100, 180)), namespace="ns")
        assert (pin.info.num_tokens, pin.info.cached_tokens, pin.info.held) == (80, 0, False)
        assert pin.info.namespace == "ns"
        stats = engine.stats()
        assert stats["prefill_tokens_total"] == stats["num_pins"] == stats["kv_slots_used"] == 0
        pin.release()
        pin.release()  # idempotent, as a held pin's
        assert pin.released
        with pytest.raises(InvalidRequestError, match="empty"):  # refused as a held pin would be
            engine.pin([])
        with pytest.raises(InvalidRequestError, match="KV pool"):
            engine.pin([7] * 5000)
        engine.check_integrity()


def test_remote_pins_on_a_cache_off_server(tiny_model_dir):
    """Over HTTP: the same counts as in-process, every lease released, no quota taken."""
    _, local_stats, _, _ = run(tiny_model_dir, disable_radix_cache=True)
    config = EngineConfig(model=str(tiny_model_dir), max_kv_tokens=8192, disable_radix_cache=True)
    thread = ServerThread(Engine(config), max_pinned_tokens_per_key=8)
    backend = RemoteBackend(thread.url)
    try:
        states = fork_and_select.run_batch(BATCH, backend=backend, progress=False)
        assert all(isinstance(s, fl.ProgramState) for s in states), states
        stats = thread.engine.stats()
        assert stats["prefill_tokens_total"] == local_stats["prefill_tokens_total"]
        assert stats["num_pins"] == 0
        assert len(thread.app.state.server.leases) == 0, "every lease was released"
        pin = backend.pin(list(range(100, 180)))  # 80 tokens over an 8-token quota: nothing held
        assert pin.info["held"] is False
        pin.release()
    finally:
        backend.close()
        thread.stop()
