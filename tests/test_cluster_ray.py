"""Two engine replicas as Ray actors (local Ray, tiny model): the same greedy outputs as one
engine, event-fed trees equal to the replicas' own, the computed-token counts of each routing
policy and of graph-aware placement, and a replica killed mid-run. Counts, never times: every
wait is on a condition (a chunk arrived, a replica rejoined, a counter moved) with a generous
deadline, so the tests hold on a machine busy with other work."""

from __future__ import annotations

import json
import threading
import time

import pytest
import ray

import flowlang as fl
from flowlang import gen, program
from flowlang.backends.cluster import ClusterBackend
from flowlang.backends.local import LocalBackend
from programs import support_agent, tree_of_thought
from runtime.cluster.cluster import Cluster, ClusterConfig
from runtime.cluster.policy import RouterConfig
from runtime.cluster.ray_support import init_ray
from runtime.cluster.replica import Replica
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.errors import EngineClosedError
from runtime.prefix import common_prefix_len, union_prefix_tokens
from runtime.protocol import GenerateRequest, SamplingParams

MAX_KV_TOKENS = 16_384  # per replica: W1 at test size fits, small enough for two on 2 cores
WAIT_S = 600  # deadline for a condition: Ray restarting an actor on a busy machine takes long


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture(scope="module")
def engine_config(tiny_model_dir):
    return EngineConfig(model=str(tiny_model_dir), max_kv_tokens=MAX_KV_TOKENS)


@pytest.fixture(scope="module")
def cluster(engine_config):
    init_ray(num_cpus=2)
    # tests kill and stop replica 1 (and the HTTP front's a random one): restarts to spare,
    # whatever order the tests run in
    config = ClusterConfig(num_replicas=2, max_restarts=10)
    with Cluster(engine_config, config) as running:
        yield running
    ray.shutdown()


@pytest.fixture(scope="module")
def single(engine_config):
    with Engine(engine_config) as engine:
        yield engine


@pytest.fixture
def fresh(cluster):
    """Every replica routed to and idle, empty caches and the default router before each
    test: a test before it may have killed or stopped a replica (Ray's restart is waited for
    here), in whatever order the tests run."""
    _wait_until(
        lambda: sorted(cluster.router.replica_ids) == sorted(cluster.actors),
        "a replica did not rejoin after Ray restarted it",
    )
    _wait_until(lambda: not any(cluster.router.loads().values()), "earlier requests still run")
    cluster.set_router_config(RouterConfig())
    cluster.flush_caches()
    cluster.wait_for_events(timeout_s=WAIT_S)
    return cluster


def _computed(cluster: Cluster) -> dict[int, float]:
    return {i: s["prefill_tokens_total"] for i, s in cluster.stats().items()}


def _delta(before: dict, after: dict) -> dict:
    return {i: after[i] - before.get(i, 0) for i in after}


def _leaf_paths(snapshot) -> dict:
    """Maximal cached paths from a snapshot's edges (no MirrorTree code involved)."""
    paths: dict = {}
    parents: dict = {}
    for event in snapshot.stored:
        paths.setdefault(event.namespace, set()).add(event.token_ids)
        parents.setdefault(event.namespace, set()).add(event.token_ids[: event.start_len])
    return {ns: frozenset(p - parents[ns]) for ns, p in paths.items()}


def test_w1_w3_greedy_outputs_equal_one_engine_and_trees_follow_events(fresh, single):
    local = LocalBackend(single)
    backend = ClusterBackend(fresh, single.tokenizer)
    w1 = support_agent.batch_args(support_agent.make_inputs(single.tokenizer, "test"))
    w3 = [{"question": q} for q in tree_of_thought.make_inputs(single.tokenizer, "test")]
    for prog, batch in ((support_agent.support_agent, w1), (tree_of_thought.tree_of_thought, w3)):
        expected = prog.run_batch(batch, backend=local, progress=False)
        placed = backend.run_batch(prog, batch)
        assert all(isinstance(s, fl.ProgramState) for s in placed), placed
        assert [s.variables() for s in placed] == [s.variables() for s in expected]
    fresh.wait_for_events(timeout_s=WAIT_S)
    for replica_id in fresh.router.replica_ids:
        truth = ray.get(fresh.actors[replica_id].peek_snapshot.remote())
        assert fresh.router.tree(replica_id).leaf_paths() == _leaf_paths(truth)
        assert truth.stored, "each replica ran part of the batch"
    fresh.check_integrity()


def test_cache_aware_is_near_the_bound_and_round_robin_repeats_the_shared_prefix(fresh, single):
    prompts = support_agent.first_turn_ids(
        single.tokenizer, support_agent.make_inputs(single.tokenizer, "test")
    )
    bound = union_prefix_tokens(prompts)  # one turn: nothing decoded is reused
    shared_len = min(common_prefix_len(prompts[0], p) for p in prompts)
    computed = {}
    for policy in ("cache_aware", "round_robin"):
        fresh.set_router_config(RouterConfig(policy=policy))
        fresh.flush_caches()
        fresh.wait_for_events(timeout_s=WAIT_S)
        before = _computed(fresh)
        sampling = SamplingParams(max_new_tokens=2, temperature=0.0)
        results = fresh.generate([GenerateRequest(input_ids=p, sampling=sampling) for p in prompts])
        assert all(r.finish_reason == "length" for r in results), results
        computed[policy] = _delta(before, _computed(fresh))
    assert sum(computed["cache_aware"].values()) <= 1.05 * bound
    round_robin = computed["round_robin"]
    assert min(round_robin.values()) >= shared_len  # every replica computed the shared prompt
    assert sum(round_robin.values()) >= bound + shared_len


@program
def grouped(s, prefix: str, question: str):
    """A long per-group prefix, then a short per-instance question."""
    s += prefix + "\n" + question
    s += gen("answer", max_new_tokens=32, temperature=0.0, ignore_eos=True)


def test_graph_aware_placement_computes_less_than_routing_request_by_request(fresh, single):
    """Four groups of four instances. Routed one request at a time (all in flight together, a
    tight balance guard), some group is split across the replicas and its prefix computed
    twice; placed as a batch, each group lands whole on one replica."""
    words = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor"]
    prefixes = [" ".join(words[(g + i * 3) % 8] for i in range(220)) for g in range(4)]
    batch = [
        {"prefix": f"Group {g}: {prefixes[g]}", "question": f"Question {i} of {g}?"}
        for g in range(4)
        for i in range(4)
    ]
    backend = ClusterBackend(fresh, single.tokenizer)
    fresh.set_router_config(RouterConfig(policy="cache_aware", balance_abs_threshold=2))
    prompts = [grouped.compile(backend=backend, **args).first_prompt() for args in batch]
    sampling = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)

    before = _computed(fresh)
    routed = fresh.generate(
        [GenerateRequest(input_ids=list(p), sampling=sampling) for p in prompts]
    )
    routed_tokens = sum(_delta(before, _computed(fresh)).values())

    fresh.flush_caches()
    fresh.wait_for_events(timeout_s=WAIT_S)
    before = _computed(fresh)
    placed = grouped.run_batch(batch, backend=backend, progress=False)  # placed by the backend
    placed_tokens = sum(_delta(before, _computed(fresh)).values())
    assert [state["answer"] for state in placed] == [r.text for r in routed]
    assert placed_tokens < routed_tokens
    assert placed_tokens <= union_prefix_tokens(prompts) + 8  # only "Group" twice
    unplaced = ClusterBackend(fresh, single.tokenizer, place=False)
    assert unplaced.place_batch(grouped, batch, {}) is None  # left to the router
    assert unplaced.on_replica(1).place is False


def _round_robin_requests(cluster, single, num_requests: int, max_new_tokens: int):
    """Distinct greedy requests of fixed length, and one engine's answers; the cluster is set
    to round-robin so that every replica gets some."""
    cluster.set_router_config(RouterConfig(policy="round_robin"))
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    requests = [
        GenerateRequest(input_ids=[5 + i] * 40 + list(range(100, 160)), sampling=sampling)
        for i in range(num_requests)
    ]
    return requests, [r.output_ids for r in single.generate(requests)]


def test_replica_killed_mid_run_loses_no_request_and_rejoins_empty(fresh, single):
    """Killed while it surely runs a request (a long one whose first chunk has arrived): every
    request is answered once with one engine's greedy answer; the streamed one, its chunks
    taken back by its caller, runs again from the start."""
    requests, expected = _round_robin_requests(fresh, single, 12, 48)
    sampling = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    anchor = GenerateRequest(input_ids=list(range(500, 560)), sampling=sampling)
    (anchor_expected,) = single.generate(anchor)
    reruns_before = fresh.num_reruns
    chunks: list[int] = []
    started = threading.Event()

    def on_chunk(chunk) -> None:
        chunks.extend(chunk.output_ids)
        started.set()

    def retract() -> bool:  # this caller shows nothing before the end: it starts over
        chunks.clear()
        return True

    anchored = fresh.submit(anchor, prefer=1, on_chunk=on_chunk, retract=retract)
    futures = [fresh.submit(r) for r in requests]
    assert started.wait(WAIT_S), "the long request never started on replica 1"
    ray.kill(fresh.actors[1], no_restart=False)
    results = [f.result(timeout=WAIT_S) for f in futures]
    assert [r.rid for r in results] == [r.rid for r in requests]  # one answer each
    assert [r.output_ids for r in results] == expected  # re-runs are the same greedy answer
    rerun = anchored.result(timeout=WAIT_S)
    assert rerun.finish_reason == "length", rerun
    assert rerun.output_ids == anchor_expected.output_ids == chunks  # only the re-run's chunks
    assert fresh.num_reruns > reruns_before
    survivor = fresh.stats()[0]
    assert survivor["kv_slots_used"] == survivor["cache_tokens"], "a slot leaked"
    assert survivor["num_running"] == 0 and survivor["num_pins"] == 0
    _wait_until(lambda: 1 in fresh.router.replica_ids, "Ray did not bring the replica back")
    assert fresh.router.tree(1).num_tokens == 0  # it rejoined empty
    assert fresh.stats()[1]["requests_finished_total"] == 0
    fresh.check_integrity()


def test_http_front_reruns_a_killed_replicas_whole_requests_and_ends_its_streams_with_503(
    fresh, single
):
    """`flowlang serve --replicas 2`, a replica killed (as kill -9) while it runs one whole
    and one streamed request: the whole one runs again on the other replica and gets one
    engine's answer; the stream, which already sent tokens, ends with a 503 error frame and
    [DONE]; the other replica's requests finish. No connection is dropped."""
    import httpx
    from conftest import ServerThread

    from runtime.cluster.front import ClusterEngine

    fresh.set_router_config(RouterConfig(policy="round_robin"))
    sampling = {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True}
    prompts = {name: [7 + i] * 30 + list(range(200, 240)) for i, name in enumerate("abcd")}
    answers: dict[str, object] = {}
    first_frame = {name: threading.Event() for name in "cd"}
    thread = ServerThread(ClusterEngine(fresh, owns_cluster=False))

    def whole(name: str) -> None:
        body = {"input_ids": prompts[name], "rid": name, "sampling_params": sampling}
        reply = httpx.post(f"{thread.url}/generate", json=body, timeout=WAIT_S)
        answers[name] = (reply.status_code, reply.text)

    def streamed(name: str) -> None:
        body = {"input_ids": prompts[name], "rid": name, "sampling_params": sampling}
        frames: list[str] = []
        try:
            with httpx.stream(
                "POST", f"{thread.url}/generate", json={**body, "stream": True}, timeout=WAIT_S
            ) as reply:
                for line in reply.iter_lines():
                    if line:
                        frames.append(line)
                        first_frame[name].set()
            answers[name] = (reply.status_code, frames)
        except httpx.HTTPError as err:  # a dropped connection: what must never happen
            answers[name] = (err, frames)

    # round-robin in this order: "a" and "c" share a replica, "b" and "d" the other
    clients = []
    try:
        for name, run in (("a", whole), ("b", whole), ("c", streamed), ("d", streamed)):
            clients.append(threading.Thread(target=run, args=(name,)))
            clients[-1].start()
            _wait_until(lambda n=name: fresh.router.replica_of(n) is not None, f"{name} unrouted")
        for event in first_frame.values():
            assert event.wait(WAIT_S), "a stream sent nothing"
        victim = fresh.router.replica_of("a")
        assert fresh.router.replica_of("c") == victim != fresh.router.replica_of("b")
        reruns_before = fresh.num_reruns
        ray.kill(fresh.actors[victim], no_restart=False)
        for client in clients:
            client.join(WAIT_S)
    finally:
        thread.stop()
    assert fresh.num_reruns == reruns_before + 1  # "a", and only "a", ran again
    for name in "ab":
        status, text = answers[name]
        assert status == 200, text
        request = GenerateRequest(
            input_ids=prompts[name], sampling=SamplingParams(**{**sampling, "temperature": 0.0})
        )
        (expected,) = single.generate(request)
        assert json.loads(text)["output_ids"] == expected.output_ids
    status, frames = answers["c"]
    assert status == 200 and frames[-1] == "data: [DONE]", (status, frames[-3:])
    error = json.loads(frames[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and "died" in error["message"], error
    sent = [json.loads(frame.removeprefix("data: ")) for frame in frames[:-2]]
    # the stream was killed after its first frame, so at least one went out (a second may not)
    assert sent and all("output_ids" in chunk for chunk in sent), frames[:3]
    status, frames = answers["d"]
    assert status == 200 and frames[-1] == "data: [DONE]", (status, frames[-3:])
    last = json.loads(frames[-2].removeprefix("data: "))
    assert last["meta_info"]["finish_reason"]["type"] == "length", last


def test_a_routed_handle_takes_back_its_chunks_only_while_nobody_read_one():
    """What decides whether a request whose replica died may run again at the front: the
    chunks pushed so far are dropped (True) until a reader took one (then False)."""
    import asyncio

    from runtime.handles import RequestHandle
    from runtime.protocol import StreamChunk

    def _chunk(text: str, token: int) -> StreamChunk:
        return StreamChunk(
            text=text, output_ids=[token], num_output_tokens=1, num_prompt_tokens=1, cached_tokens=0
        )

    async def scenario() -> tuple[bool, list[int], bool]:
        loop = asyncio.get_running_loop()
        handle = RequestHandle("r", lambda rid: None, loop)
        for token in (1, 2):
            handle.push_chunk(_chunk("x", token))
        dropped = await asyncio.to_thread(handle.retract, 60.0)
        handle.push_chunk(_chunk("y", 3))
        chunks = handle.achunks()
        first = await anext(chunks)
        kept = await asyncio.to_thread(handle.retract, 60.0)
        return dropped, first.output_ids, kept

    dropped, first, kept = asyncio.run(scenario())
    assert dropped and first == [3]  # the reader saw only what came after
    assert not kept
    assert not RequestHandle("r", lambda rid: None).retract(60.0)  # no loop: never dropped


def test_http_front_serves_the_same_api_and_refuses_bad_input(fresh, single):
    """`flowlang serve --replicas 2`'s app: SGLang and OpenAI routes answer as one engine
    would; bad input is a 400 from the front, never a hung request."""
    import httpx
    from conftest import ServerThread

    from runtime.cluster.front import ClusterEngine

    front = ClusterEngine(fresh, owns_cluster=False)
    thread = ServerThread(front)
    try:
        with httpx.Client(base_url=thread.url, timeout=WAIT_S) as client:
            ids = list(range(300, 360))
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
            reply = client.post("/generate", json=body)
            assert reply.status_code == 200, reply.text
            sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
            (expected,) = single.generate(GenerateRequest(input_ids=ids, sampling=sampling))
            assert reply.json()["output_ids"] == expected.output_ids
            chat = client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                },
            )
            assert chat.status_code == 200, chat.text
            bad = client.post("/generate", json={**body, "input_ids": [10**9]})
            assert bad.status_code == 400 and "token id" in bad.text
            assert client.get("/health").status_code == 200
            # the dashboard shows every replica's tree, each namespace tagged with its replica
            data = client.get("/dashboard/data")
            assert data.status_code == 200, data.text
            per_replica = fresh.stats()
            assert data.json()["tree"]["total_tokens"] == sum(
                s["cache_tokens"] for s in per_replica.values()
            )
            view = front.cache_view(max_nodes=12)
            assert sorted({ns.replica for ns in view.namespaces}) == sorted(per_replica)
            assert view.num_nodes == sum(s["cache_nodes"] for s in per_replica.values())
            assert "<svg" in data.json()["tree"]["svg"]
    finally:
        thread.stop()
    assert fresh.router.replica_ids  # the front did not stop the cluster it does not own


def test_the_front_summarizes_its_replicas_as_one_engine_would(fresh, single, tiny_model_dir):
    """What `flowlang serve --replicas 2` prints at startup: a replica's summary, and how many."""
    from runtime.cluster.front import ClusterEngine

    summary = ClusterEngine(fresh, owns_cluster=False).summary()
    assert summary.num_replicas == 2 and summary.model_path == str(tiny_model_dir)
    # the kernels line is each process's own (one may have compiled what the other loads), and
    # so is the thread count (Ray gives a one-CPU replica one thread)
    own = ("kernels", "threads")
    facts = [line for line in summary.lines()[1:] if not line.startswith(own)]
    assert facts == [line for line in single.summary().lines() if not line.startswith(own)]
    assert summary.lines()[0] == "replicas   2, each as below"


def test_http_front_streams_each_replicas_kv_events(fresh):
    """GET /v1/flowlang/kv_events?replica=N at the front: that replica's snapshot, then its
    events as it serves, read through Ray; the tree they rebuild is the replica's own.
    Without ?replica, the 400 names the live replicas."""
    import json

    import httpx
    from conftest import ServerThread

    from runtime.cache.events import KVEvent, KVSnapshot
    from runtime.cluster.front import ClusterEngine
    from runtime.cluster.mirror import MirrorTree

    thread = ServerThread(ClusterEngine(fresh, owns_cluster=False))
    route = "/v1/flowlang/kv_events"
    try:
        with httpx.Client(base_url=thread.url, timeout=WAIT_S) as client:
            missing = client.get(route)
            assert missing.status_code == 400 and "[0, 1]" in missing.text
            assert client.get(route, params={"replica": 7}).status_code == 400
            with client.stream("GET", route, params={"replica": 1}) as stream:
                lines = stream.iter_lines()
                first = json.loads(next(lines))
                stored = tuple(KVEvent.from_dict(e) for e in first["stored"])
                mirror = MirrorTree()
                mirror.load(KVSnapshot(first["snapshot"], stored))
                sampling = SamplingParams(max_new_tokens=4, temperature=0.0)
                request = GenerateRequest(input_ids=list(range(400, 470)), sampling=sampling)
                assert fresh.submit(request, prefer=1).result(timeout=WAIT_S).finish_reason
                truth = ray.get(fresh.actors[1].peek_snapshot.remote())
                while mirror.last_seq < truth.seq:
                    mirror.apply(KVEvent.from_dict(json.loads(next(lines))))
        assert mirror.leaf_paths() == _leaf_paths(truth)
        assert any(path[:70] == tuple(range(400, 470)) for path in mirror.leaf_paths()[None])
    finally:
        thread.stop()


def test_http_front_streams_token_by_token(fresh, single):
    """A streaming client of the front gets the replica's chunks as they come (several, not
    one at the end), and together they are the answer a non-streaming request gets."""
    import json

    import httpx
    from conftest import ServerThread

    from runtime.cluster.front import ClusterEngine

    thread = ServerThread(ClusterEngine(fresh, owns_cluster=False))
    body = {"prompt": list(range(300, 340)), "max_tokens": 12, "temperature": 0}
    try:
        with httpx.Client(base_url=thread.url, timeout=WAIT_S) as client:
            whole = client.post("/v1/completions", json=body)
            assert whole.status_code == 200, whole.text
            pieces = []
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
                assert reply.status_code == 200
                for line in reply.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text = json.loads(line[6:])["choices"][0]["text"]
                        if text:
                            pieces.append(text)
    finally:
        thread.stop()
    assert len(pieces) >= 2, pieces  # streamed, not delivered whole at the end
    assert "".join(pieces) == whole.json()["choices"][0]["text"]


def test_a_replica_whose_engine_stops_is_restarted_and_its_requests_run_elsewhere(fresh, single):
    """The health check: a replica whose engine stopped (its actor alive, so Ray would not
    restart it by itself) is restarted; requests it refuses meanwhile run on the other one."""
    requests, expected = _round_robin_requests(fresh, single, 8, 24)
    restarts_before = fresh.num_restarts
    ray.get(fresh.actors[1].stop.remote(0.0))
    results = [f.result(timeout=WAIT_S) for f in [fresh.submit(r) for r in requests]]
    assert [r.output_ids for r in results] == expected  # every request answered, once
    assert all(r.finish_reason == "length" for r in results)
    _wait_until(
        lambda: fresh.num_restarts > restarts_before and 1 in fresh.router.replica_ids,
        "the stopped replica was not restarted",
    )
    assert fresh.num_restarts == restarts_before + 1
    assert ray.get(fresh.actors[1].health.remote())
    assert fresh.stats()[1]["requests_finished_total"] == 0  # a fresh engine
    fresh.check_integrity()


def test_a_stopped_replica_gives_no_snapshot_so_it_cannot_rejoin_before_its_restart(
    engine_config,
):
    """The kill that restarts a stopped replica lands a moment later; until then the old
    actor still answers, and a snapshot from it would let the router take back a dead engine."""
    replica = Replica(engine_config.model_dump())
    assert replica.snapshot().seq >= 0  # a running engine resyncs the router
    replica.stop(0.0)
    assert not replica.health()
    with pytest.raises(EngineClosedError, match="awaits its restart"):
        replica.snapshot()


@program
def forked(s, prefix: str):
    """One shared prefix, three branches extending it."""
    s += prefix
    branches = s.fork(3)
    for i, branch in enumerate(branches):
        branch += f" Option {i}:" + gen("option", max_new_tokens=8, temperature=0.0)
    s.join(branches)


def _finished(cluster: Cluster) -> dict[int, float]:
    return {i: s["requests_finished_total"] for i, s in cluster.stats().items()}


def test_fork_branches_run_where_the_fork_pinned_its_prefix(fresh, single):
    """Round-robin would alternate the branches between the replicas; the fork's pin sends
    them all to the replica holding the prefix, so the other one computes nothing."""
    fresh.set_router_config(RouterConfig(policy="round_robin"))
    prefix = "Lanterns along the harbor wall. " * 20
    expected = forked.run(prefix, backend=LocalBackend(single))
    finished, computed = _finished(fresh), _computed(fresh)
    state = forked.run(prefix, backend=ClusterBackend(fresh, single.tokenizer))
    assert state["option"] == expected["option"]
    finished, computed = _delta(finished, _finished(fresh)), _delta(computed, _computed(fresh))
    idle = min(finished, key=finished.get)
    assert finished[idle] == 0 and computed[idle] == 0, (finished, computed)
    assert max(finished.values()) >= 3


@program
def short_turns(s, name: str):
    """Turns too short for a cached match to decide where they run (under 32 tokens)."""
    for turn in range(3):
        s += f" {name}, turn {turn}:" + gen(f"turn{turn}", max_new_tokens=4, temperature=0.0)


def test_a_programs_turns_stay_on_its_home_replica(fresh, single):
    """Routed request by request, every turn of a program runs where its first turn did (the
    least loaded replica would take each turn otherwise): its program id reaches the router."""
    known, moves = fresh.router.program_homes()
    backend = ClusterBackend(fresh, single.tokenizer, place=False)
    batch = [{"name": f"Caller {i}"} for i in range(6)]
    states = short_turns.run_batch(batch, backend=backend, progress=False, max_workers=6)
    assert all(state["turn2"] is not None for state in states)
    assert fresh.router.program_homes() == (known + 6, moves)  # one home each, none moved


def test_a_cancelled_score_is_stopped_on_its_replica(fresh):
    """The front's score forwards its cancellation (a client that went away): the replica
    stops the score, releases its pin and keeps serving."""
    import threading

    from runtime.cluster.front import ClusterEngine
    from runtime.protocol import ScoreRequest
    from runtime.scoring import Cancellation, ScoreCancelled

    front = ClusterEngine(fresh, owns_cluster=False)
    continuations = [[10 + i] * 40 for i in range(200)]  # long enough to be caught running
    request = ScoreRequest(prefix=list(range(300, 1300)), continuations=continuations)
    cancel, outcome = Cancellation(), []

    def run() -> None:
        try:
            outcome.append(front.score(request, cancel)[0])
        except ScoreCancelled as err:
            outcome.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + WAIT_S
    while not any(s["num_running"] or s["num_pins"] for s in fresh.stats().values()):
        assert time.monotonic() < deadline and not outcome, "the score never ran"
        time.sleep(0.01)
    cancel.cancel()
    worker.join(WAIT_S)
    assert len(outcome) == 1 and isinstance(outcome[0], ScoreCancelled), outcome
    _wait_until(
        lambda: not any(s["num_running"] or s["num_pins"] for s in fresh.stats().values()),
        "the replica kept the score's work",
    )
    small = ScoreRequest(prefix=list(range(300, 340)), continuations=[[5, 6]])
    assert len(front.score(small)[0].token_logprobs) == 1


def test_tool_calls_through_the_front_equal_one_engine(fresh, single):
    """`--replicas`: tools, tool_choice and the history pass through the front; the greedy
    calls (and streamed deltas) equal one engine's."""
    from conftest import ServerThread
    from openai import OpenAI

    from runtime.cluster.front import ClusterEngine

    add = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a"],
            },
        },
    }
    kwargs = dict(
        messages=[{"role": "user", "content": "Add."}],
        tools=[add],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
    )
    answers = {}
    for name in ("front", "one"):  # stopping a server stops its engine: `single` is kept
        front = name == "front"
        engine = ClusterEngine(fresh, owns_cluster=False) if front else Engine(single.config)
        thread = ServerThread(engine)
        try:
            oc = OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
            model = engine.config.model
            call = oc.chat.completions.create(**kwargs, model=model).choices[0].message
            call = call.tool_calls[0]
            streamed = "".join(
                d.function.arguments or ""
                for chunk in oc.chat.completions.create(**kwargs, model=model, stream=True)
                for d in chunk.choices[0].delta.tool_calls or []
            )
            assert streamed == call.function.arguments
            answers[name] = (call.function.name, call.function.arguments)
        finally:
            thread.stop()
    assert answers["front"] == answers["one"] and answers["one"][0] == "add"
