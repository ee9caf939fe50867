"""Lower KV tiers in the engine: KV the pool evicts moves to host memory (L2) or disk (L3) and
is loaded back instead of computed. Outputs never change (greedy, fp32, reference attention);
the counters say what was computed, loaded and from where; a restart on the same directory
starts warm; bad files, a full disk and an unwritable directory cost only recomputation."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from test_eviction_engine import NUM_TURNS, NUM_USERS, POOL_TOKENS, REPLY_LEN, conversations

from runtime.cache import tiers as tiers_module
from runtime.cache.disk_tier import DiskTier
from runtime.cache.events import KVEvent
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.engine_tools import set_eviction_clock
from runtime.protocol import GenerateRequest, GraphHints, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
EIGHT_CHUNKS_GB = 8 * 8192 / 2**30  # random:tiny: a 16-token chunk of KV is 8 KiB
GREEDY = SamplingParams(max_new_tokens=REPLY_LEN, ignore_eos=True, temperature=0)


def config(**settings) -> EngineConfig:
    # the tiers' mechanics, under lru: its counters are the same run after run, and it pushes a
    # paused branch down to disk (graph, the default, keeps a declared return in the upper
    # tiers and prices program entries by measured time; graph with tiers: agent_trace_bench's
    # "programs + host tier" row, test_hostile_round4_state.py)
    base = {
        "model": "random:tiny",
        "max_kv_tokens": POOL_TOKENS,
        "attention_backend": "torch",
        "eviction_policy": "lru",
    }
    return EngineConfig(**{**base, **settings})


def run_rounds(engine: Engine) -> list:
    """Every user's turn t together, then turn t + 1 (each turn extends the conversation)."""
    history = [[] for _ in range(NUM_USERS)]
    outputs = []
    for turn in range(NUM_TURNS):
        requests = []
        for user, messages in enumerate(conversations()):
            history[user] = history[user] + messages[turn]
            hints = GraphHints(program_id=f"user-{user}", continuation=turn < NUM_TURNS - 1)
            requests.append(GenerateRequest(input_ids=history[user], sampling=GREEDY, hints=hints))
        results = [h.result() for h in engine.submit_many(requests)]
        engine.check_integrity()
        for user, result in enumerate(results):
            assert result.finish_reason == "length", result.error
            history[user] = history[user] + list(result.output_ids)
        outputs.append([list(r.output_ids) for r in results])
    return outputs


def long_prompt(seed: int, length: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def generate(engine: Engine, ids: list[int], **sampling):
    params = SamplingParams(**{**GREEDY.model_dump(), **sampling})
    [result] = engine.generate(GenerateRequest(input_ids=ids, sampling=params))
    assert result.finish_reason == "length", result.error
    return result


@pytest.fixture(scope="module")
def no_tiers():
    with Engine(config()) as engine:
        return run_rounds(engine), engine.stats()


@pytest.mark.parametrize(
    "settings",
    [
        {"host_kv_gb": 0.05},
        {"disk_kv_dir": "DIR"},
        {"host_kv_gb": EIGHT_CHUNKS_GB, "disk_kv_dir": "DIR"},  # a small host tier spills
        {"host_kv_gb": 0.05, "eviction_policy": "graph"},
        {"host_kv_gb": 0.05, "disk_kv_dir": "DIR", "kv_write_policy": "write_through"},
    ],
    ids=["L2", "L3", "L2+L3", "L2-graph", "write-through"],
)
def test_outputs_are_unchanged_and_evicted_kv_is_loaded_not_computed(no_tiers, settings, tmp_path):
    outputs, stats = no_tiers
    settings = {k: str(tmp_path) if v == "DIR" else v for k, v in settings.items()}
    with Engine(config(**settings)) as engine:
        assert run_rounds(engine) == outputs
        tiered = engine.stats()
    loaded = tiered["kv_loaded_host_tokens_total"] + tiered["kv_loaded_disk_tokens_total"]
    assert stats["evicted_tokens_total"] > 0 and tiered["kv_demoted_tokens_total"] > 0
    assert loaded > 0
    # every loaded token is one not computed again (the partial chunk at a path's end is)
    assert tiered["prefill_tokens_total"] <= stats["prefill_tokens_total"] - loaded // 2
    if "disk_kv_dir" not in settings:
        assert tiered["kv_loaded_disk_tokens_total"] == 0
    elif "host_kv_gb" not in settings:
        assert tiered["kv_loaded_host_tokens_total"] == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_with_enough_host_memory_a_quarter_pool_computes_the_lower_bound(page_size):
    """L1 at a quarter of the working set, L2 holding all of it, computes exactly what an
    unconstrained pool does (page 1: a path's partial last chunk is kept too)."""
    with Engine(config(max_kv_tokens=4096, page_size=page_size)) as engine:
        unconstrained = run_rounds(engine), engine.stats()
    working_set = unconstrained[1]["kv_slots_peak"]
    small = max(256, working_set // 4 // 16 * 16)  # the longest request must still fit
    assert small < working_set / 2
    with Engine(config(max_kv_tokens=small, page_size=page_size, host_kv_gb=0.05)) as engine:
        outputs = run_rounds(engine)
        stats = engine.stats()
    assert outputs == unconstrained[0]
    assert stats["evicted_tokens_total"] > 0
    assert stats["prefill_tokens_total"] == unconstrained[1]["prefill_tokens_total"]


def test_loaded_kv_is_bit_identical_to_computed(tmp_path):
    """The KV a load writes is the KV that was computed, so the generated tokens' logprobs
    equal a device cache hit's exactly (page 16: both reuse 192 tokens, compute the last 8)."""
    ids = long_prompt(1)
    settings = {"host_kv_gb": 0.01, "disk_kv_dir": str(tmp_path), "page_size": 16}
    with Engine(config(**settings)) as engine:
        first = generate(engine, ids, logprobs=True)
        hit = generate(engine, ids, logprobs=True)  # from the device cache
        engine.flush_cache()  # everything leaves L1 for L2
        loaded = generate(engine, ids, logprobs=True)
        stats = engine.stats()
    assert hit.cached_tokens == len(ids) // 16 * 16 and hit.loaded_tokens == 0
    assert loaded.loaded_tokens == len(ids) // 16 * 16 and loaded.output_ids == first.output_ids
    assert [t.logprob for t in loaded.logprobs] == [t.logprob for t in hit.logprobs]
    assert stats["kv_loaded_host_tokens_total"] == loaded.loaded_tokens


def test_a_restart_on_the_same_directory_answers_from_disk(tmp_path, monkeypatch):
    """close() writes the whole cache to disk (not through the bounded write queue, which is
    one chunk here: a shutdown must not drop what does not fit)."""
    monkeypatch.setattr(tiers_module, "WRITE_QUEUE_CHUNKS", 1)
    prompts = [long_prompt(seed) for seed in range(3)]
    with Engine(config(disk_kv_dir=str(tmp_path), host_kv_gb=0.01)) as engine:
        cold = [generate(engine, ids) for ids in prompts]
    with Engine(config(disk_kv_dir=str(tmp_path))) as engine:
        warm = [generate(engine, ids) for ids in prompts]
        stats = engine.stats()
    assert [r.output_ids for r in warm] == [r.output_ids for r in cold]
    assert all(r.cached_tokens == r.loaded_tokens == 192 for r in warm)  # whole chunks < 200
    assert stats["prefill_tokens_total"] == 3 * (200 - 192)
    assert stats["kv_loaded_disk_tokens_total"] == 3 * 192
    # another dtype, or another namespace, never reads these files
    with Engine(config(disk_kv_dir=str(tmp_path), dtype="bfloat16")) as engine:
        assert generate(engine, prompts[0]).loaded_tokens == 0
    with Engine(config(disk_kv_dir=str(tmp_path))) as engine:
        request = GenerateRequest(input_ids=prompts[0], sampling=GREEDY, namespace="tenant-b")
        assert engine.generate(request)[0].loaded_tokens == 0
        assert generate(engine, prompts[0]).loaded_tokens == 192


def chunk_files(engine: Engine, ids: list[int]) -> list[Path]:
    names = engine.tiers.names(None, ids, len(ids))
    return [engine.tiers.disk.path(name) for name in names]


def test_bad_files_are_misses_and_a_crash_leaves_nothing_trusted(tmp_path, caplog):
    prompts = [long_prompt(seed) for seed in range(4)]
    with Engine(config(disk_kv_dir=str(tmp_path))) as engine:
        cold = [generate(engine, ids) for ids in prompts]
        files = [chunk_files(engine, ids) for ids in prompts]
    raw = bytearray(files[0][0].read_bytes())
    raw[-1] ^= 0x01  # one flipped bit
    files[0][0].write_bytes(bytes(raw))
    files[1][0].write_bytes(files[1][0].read_bytes()[:1000])  # truncated
    shutil.copy(files[0][1], files[2][0])  # a valid file of another chunk
    # a write cut short by a crash: only its temporary file exists
    partial = files[3][0].read_bytes()[:5000]
    files[3][0].unlink()
    dead_pid = 2**22 + 1  # above Linux's largest pid: no process has it
    files[3][0].with_name(f"{files[3][0].name}.{dead_pid}.1.tmp").write_bytes(partial)
    # and one that a live engine sharing the directory is writing right now: kept
    live = files[3][1].with_name(f"{files[3][1].name}.{os.getpid()}.1.tmp")
    live.write_bytes(partial)
    with caplog.at_level(logging.WARNING, logger="flowlang.kv_tiers"):
        with Engine(config(disk_kv_dir=str(tmp_path))) as engine:
            assert list(files[3][0].parent.glob("*.tmp")) == [live]  # the dead one removed
            warm = [generate(engine, ids) for ids in prompts]
            stats = engine.stats()
    assert [r.output_ids for r in warm] == [r.output_ids for r in cold]
    assert [r.loaded_tokens for r in warm] == [0, 0, 0, 0]  # each misses at its first chunk
    assert stats["kv_disk_bad_files_total"] == 3
    assert len([r for r in caplog.records if "is not used" in r.message]) == 1  # logged once


def test_a_full_disk_turns_writing_off_and_serving_goes_on(no_tiers, tmp_path, monkeypatch, caplog):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "_write_file", staticmethod(full))
    with caplog.at_level(logging.WARNING, logger="flowlang.kv_tiers"):
        with Engine(config(disk_kv_dir=str(tmp_path))) as engine:
            assert run_rounds(engine) == no_tiers[0]
            engine.tiers.drain()
            stats = engine.stats()
    assert stats["kv_disk_writable"] == 0 and stats["kv_disk_write_errors_total"] == 1
    assert any("disk is full" in r.message for r in caplog.records)
    assert not list(tmp_path.rglob("*.kv")) and not list(tmp_path.rglob("*.tmp"))


def test_an_unusable_directory_is_a_warning_not_a_failure(no_tiers, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="flowlang.kv_tiers"):
        with Engine(config(disk_kv_dir=str(blocker / "kv"), host_kv_gb=0.05)) as engine:
            assert run_rounds(engine) == no_tiers[0]
            stats = engine.stats()
    assert stats["kv_disk_writable"] == 0 and stats["kv_loaded_host_tokens_total"] > 0
    assert any("no longer written" in r.message for r in caplog.records)


def test_write_through_copies_computed_chunks_down_at_once(tmp_path):
    ids = long_prompt(5)
    with Engine(config(disk_kv_dir=str(tmp_path), kv_write_policy="write_through")) as engine:
        generate(engine, ids)
        engine.tiers.drain()
        assert all(path.is_file() for path in chunk_files(engine, ids))  # before any eviction
        assert engine.stats()["evicted_tokens_total"] == 0


def test_queued_requests_are_prefetched_from_disk_into_host_memory(tmp_path):
    """Requests waiting behind one another: their disk chunks are read into host memory on
    the prefetch thread while they wait, so admission copies from memory."""
    prompts = [long_prompt(seed) for seed in range(6)]
    with Engine(config(disk_kv_dir=str(tmp_path))) as engine:
        cold = [generate(engine, ids) for ids in prompts]
    settings = {"disk_kv_dir": str(tmp_path), "host_kv_gb": 0.05, "max_running_requests": 1}
    with Engine(config(**settings)) as engine:
        requests = [GenerateRequest(input_ids=ids, sampling=GREEDY) for ids in prompts]
        warm = [h.result() for h in engine.submit_many(requests)]
        stats = engine.stats()
    assert [r.output_ids for r in warm] == [r.output_ids for r in cold]
    assert stats["kv_prefetched_tokens_total"] > 0
    assert stats["kv_loaded_host_tokens_total"] > 0  # prefetched, then copied from memory
    assert sum(r.loaded_tokens for r in warm) == 6 * 192


def test_a_branch_that_declared_its_return_is_prefetched_before_it_comes_back(tmp_path):
    """A conversation pauses for 10 s (GraphHints.next_turn_after_s); its KV goes to disk;
    2 s before it is due, while other work runs, its chunks are read into host memory."""
    now = [0.0]
    ids = long_prompt(7)
    settings = {"disk_kv_dir": str(tmp_path), "host_kv_gb": EIGHT_CHUNKS_GB}
    with Engine(config(**settings)) as engine:
        set_eviction_clock(engine, lambda: now[0])
        hints = GraphHints(program_id="conv", continuation=True, next_turn_after_s=10.0)
        [first] = engine.generate(GenerateRequest(input_ids=ids, sampling=GREEDY, hints=hints))
        for seed in range(10, 14):  # other work pushes it out of L1, then out of L2
            generate(engine, long_prompt(seed, 300))
        engine.flush_cache()
        engine.tiers.drain()
        assert engine.stats()["kv_prefetched_tokens_total"] == 0
        now[0] = 8.5  # within the prefetch lead
        generate(engine, long_prompt(20, 40))  # a step runs; the prefetch thread reads
        engine.tiers.drain()
        assert engine.stats()["kv_prefetched_tokens_total"] > 0
        turn = ids + list(first.output_ids) + long_prompt(21, 10)
        [back] = engine.generate(GenerateRequest(input_ids=turn, sampling=GREEDY))
        stats = engine.stats()
    assert back.loaded_tokens > 0
    assert stats["kv_loaded_disk_tokens_total"] < back.loaded_tokens  # mostly from memory


def test_settings_are_checked():
    with pytest.raises(ValueError, match="kv_write_policy"):
        EngineConfig(model="random:tiny", kv_write_policy="sometimes")
    with pytest.raises(ValueError, match="host_kv_gb"):
        EngineConfig(model="random:tiny", host_kv_gb=-1)


def test_pool_rows_round_trip():
    from runtime.cache.pool import KVPool

    pool = KVPool(num_layers=3, num_slots=8, num_kv_heads=2, head_dim=4)
    counts = pool.track_writes()
    k = torch.randn(3, 2, 2, 4)
    pool.write_rows(torch.tensor([5, 1]), k, -k)
    got_k, got_v = pool.read_rows(torch.tensor([5, 1]))
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    assert counts.tolist() == [0, 3, 0, 0, 0, 3, 0, 0]  # a packed copy of those rows is stale


def test_engines_sharing_a_directory_read_what_another_computed(tmp_path):
    """Two replicas of one model on one machine share the disk tier: with write-through,
    what one computes the other loads (it finds files written after its own start)."""
    ids = long_prompt(30)
    shared = config(disk_kv_dir=str(tmp_path), kv_write_policy="write_through")
    with Engine(shared) as first, Engine(shared) as second:
        computed = generate(first, ids)
        first.tiers.drain()
        loaded = generate(second, ids)
        assert second.stats()["prefill_tokens_total"] == len(ids) - 192
    assert loaded.loaded_tokens == 192 and loaded.output_ids == computed.output_ids


def test_the_startup_summary_names_the_tiers(tmp_path):
    with Engine(config(host_kv_gb=0.01, disk_kv_dir=str(tmp_path))) as engine:
        text = engine.summary().render()
    assert "KV below   host 0.01 GiB" in text and str(tmp_path) in text


def test_the_router_prices_lower_tiers_as_cheap_to_load(tmp_path):
    """A replica whose pool is full (admitting the prompt there evicts 100 tokens) but that
    caches the prompt, against an idle one without it: when the shared disk (or the idle
    replica's host memory, as its KV events say) holds the prompt, the idle replica loads it
    for a tenth of the cost of computing it, and gets the request."""
    from runtime.cache.chunks import TierView, chunk_file
    from runtime.cluster.policy import RouterConfig, choose_cache_aware
    from runtime.cluster.router import Router

    config = RouterConfig()
    args = ([200, 0], [1, 0], [100, 0], 210, config)
    assert choose_cache_aware(*args) == 0  # computing 210 tokens costs more than evicting 100
    assert choose_cache_aware(*args, reach=[192, 192]) == 1  # 18 computed + 192 x 0.1 loaded

    ids = tuple(long_prompt(40, 210))
    view = TierView(tmp_path, b"f" * 16, 16)
    names = view.names(None, ids)

    def routed(router: Router) -> str:
        router.route("busy-1", ids[:200], prefer="r0")  # r0 computes the prompt now
        router.route("busy-2", long_prompt(41, 250), prefer="r0")  # and more: its pool is full
        return router.route("q", ids)

    def router_with(lower: TierView | None, host_of_r1: tuple[str, ...] = ()) -> Router:
        router = Router(RouterConfig(min_match_tokens=1, balance_abs_threshold=100))
        router.add_replica("r0", capacity_tokens=300)  # 450 being computed: admitting evicts
        router.add_replica("r1", capacity_tokens=300)
        router.lower_tiers = lower
        if host_of_r1:
            router.apply_events("r1", [KVEvent(1, "stored", medium="host", chunks=host_of_r1)])
        return router

    assert routed(router_with(None)) == "r0"  # only r0 has (is computing) the prompt
    assert routed(router_with(view)) == "r0"  # nothing below yet
    assert routed(router_with(view, tuple(names))) == "r1"  # r1's host memory holds it
    view.dir.mkdir(parents=True)
    for name in names:
        (view.dir / chunk_file(name)).write_bytes(b"")
    assert view.tokens_on_disk(names) == 208
    assert routed(router_with(view)) == "r1"  # the shared disk holds it


def test_a_tier_view_sees_what_engines_wrote(tmp_path):
    from runtime.cache.chunks import TierView

    ids = long_prompt(31)
    with Engine(config(disk_kv_dir=str(tmp_path), kv_write_policy="write_through")) as engine:
        generate(engine, ids)
        engine.tiers.drain()
        view = TierView(*engine.tiers.view().describe())
    assert view.tokens_on_disk(view.names(None, ids)) == 192
    assert view.tokens_on_disk(view.names(None, ids[:100])) == 96
    assert view.tokens_on_disk(view.names("someone-else", ids)) == 0
    assert view.tokens_on_disk(view.names(None, long_prompt(32))) == 0


def test_kv_events_name_the_lower_tiers_chunks(tmp_path):
    """Subscribers see chunks enter and leave host memory and disk (medium, hex names); a
    late subscriber's snapshot lists what is there. The router's mirror follows them."""
    from runtime.cluster.mirror import MirrorTree

    ids = long_prompt(33)
    settings = {"host_kv_gb": EIGHT_CHUNKS_GB, "disk_kv_dir": str(tmp_path)}
    with Engine(config(**settings)) as engine:
        assert engine.tiers.host.capacity_chunks == 8
        subscription = engine.subscribe_kv_events()
        mirror = MirrorTree()
        mirror.load(subscription.snapshot)
        generate(engine, ids)
        engine.flush_cache()  # 12 chunks down: 8 stay in host memory, 4 spill to disk
        engine.tiers.drain()
        generate(engine, long_prompt(34, 20))  # a step: the loop publishes what changed
        events = subscription.poll()
        mirror.apply_all(events)
        late = engine.subscribe_kv_events().snapshot
        names = [n.hex() for n in engine.tiers.names(None, ids, len(ids))]
        tiers = engine.tiers
        in_host = {n.hex() for n, _ in tiers.host.items() if n not in tiers._tail_of}
    lower = [e for e in events if e.medium != "device"]
    assert {e.medium for e in lower} == {"host", "disk"} and all(e.chunks for e in lower)
    assert mirror.lower["host"] | mirror.lower["disk"] >= set(names)
    assert mirror.lower["host"] == in_host and len(in_host) >= 7  # a partial chunk: no events
    snapshot_lower = {e.medium: set(e.chunks) for e in late.stored if e.medium != "device"}
    assert snapshot_lower == {"host": mirror.lower["host"], "disk": mirror.lower["disk"]}
    assert KVEvent.from_dict(lower[0].to_dict()) == lower[0]


def test_the_cache_picture_shows_what_lies_below(tmp_path):
    with Engine(config(host_kv_gb=0.01)) as engine:
        generate(engine, long_prompt(50))
        engine.flush_cache()
        view = engine.cache_view()
    # 200 prompt tokens and 7 of the 8 generated (the last has no KV): 12 chunks and 15 more
    assert (view.total_tokens, view.host_tokens, view.disk_tokens) == (0, 207, 0)
    assert "below: host 207, disk 0 tokens" in view.to_svg()
    assert view.to_dict()["host_tokens"] == 207


def test_a_pin_loads_its_prefix_from_below_and_keeps_it_on_the_device():
    ids = long_prompt(60)
    with Engine(config(host_kv_gb=0.01)) as engine:
        generate(engine, ids)
        engine.flush_cache()
        computed = engine.stats()["prefill_tokens_total"]
        pin = engine.pin(ids[:160])
        assert pin.info.cached_tokens == 160  # all of it loaded, nothing computed
        stats = engine.stats()
        assert stats["prefill_tokens_total"] == computed
        assert stats["kv_loaded_host_tokens_total"] == 160
        engine.flush_cache()  # a pinned prefix is locked: it stays
        assert engine.stats()["cache_protected_tokens"] == 160
        engine.check_integrity()
        pin.release()


def serve_once(disk_dir: Path, ids: list[int]) -> dict:
    """`flowlang serve --disk-kv-dir`, one /generate, then a graceful stop (SIGTERM)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "flowlang", "serve", "--model", "random:tiny", "--port", "0"]
        + ["--max-kv-tokens", "384", "--disk-kv-dir", str(disk_dir)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        for line in process.stderr:
            if "serving on" in line or time.monotonic() > deadline:
                break
        url = re.search(r"serving on (http://\S+);", line).group(1)
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        }
        request = urllib.request.Request(
            f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
    finally:
        process.terminate()
        process.wait(60)
    # a graceful stop (uvicorn re-raises the signal once shut down, hence the status)
    assert process.returncode in (0, -signal.SIGTERM)
    return answer


def test_flowlang_serve_restarted_on_the_same_directory_answers_from_disk(tmp_path):
    ids = long_prompt(70)
    cold = serve_once(tmp_path, ids)
    warm = serve_once(tmp_path, ids)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] == warm["meta_info"]["loaded_tokens"] == 192
    assert warm["output_ids"] == cold["output_ids"]


def test_a_failure_below_the_pool_costs_recomputation_not_results(no_tiers, monkeypatch, caplog):
    """A bug in demotion (simulated) runs inside the tree's eviction: it is caught, counted
    and logged once; the tree stays whole and every output is unchanged."""
    from runtime.cache.tiers import KVTiers

    def broken(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(KVTiers, "_store", broken)
    with caplog.at_level(logging.ERROR, logger="flowlang.kv_tiers"):
        with Engine(config(host_kv_gb=0.05)) as engine:
            assert run_rounds(engine) == no_tiers[0]  # check_integrity after every round
            stats = engine.stats()
    assert stats["kv_tier_errors_total"] > 0 and stats["kv_loaded_host_tokens_total"] == 0
    assert stats["prefill_tokens_total"] == no_tiers[1]["prefill_tokens_total"]
    assert len([r for r in caplog.records if "simulated bug" in (r.exc_text or "")]) == 1


def test_a_passing_write_error_loses_one_chunk_not_the_disk_tier(tmp_path, monkeypatch):
    """A temporary file removed under a write (say by another engine's cleanup) is not a full
    disk: that chunk is not written, later ones are."""
    calls = []

    def flaky(path, data):
        calls.append(path)
        if len(calls) == 1:
            raise FileNotFoundError(errno.ENOENT, "gone", str(path))
        path.write_bytes(data)

    monkeypatch.setattr(DiskTier, "_write_file", staticmethod(flaky))
    with Engine(config(disk_kv_dir=str(tmp_path), kv_write_policy="write_through")) as engine:
        generate(engine, long_prompt(80))
        engine.tiers.drain()
        stats, num_calls = engine.stats(), len(calls)
    assert stats["kv_disk_write_errors_total"] == 1 and stats["kv_disk_writable"] == 1
    assert stats["kv_disk_writes_total"] == num_calls - 1 > 0
    assert len(calls) == num_calls + 1  # close() wrote the lost chunk


def test_write_through_selective_copies_a_prefix_down_at_its_second_hit(tmp_path):
    ids = long_prompt(90)
    policy = {"disk_kv_dir": str(tmp_path), "kv_write_policy": "write_through_selective"}
    with Engine(config(**policy)) as engine:
        on_disk = []
        for _ in range(3):  # computed, then a first and a second cache hit
            generate(engine, ids)
            engine.tiers.drain()
            on_disk.append(sum(path.is_file() for path in chunk_files(engine, ids)))
    assert on_disk == [0, 0, 12]
