"""The engine on the tiny random model: prefill-once counts, identical outputs across
configurations and memory pressure, pins, aborts, bad requests, concurrency."""

from __future__ import annotations

import threading

import pytest

from programs.support_agent import first_turn_ids, make_inputs
from runtime.config import EngineConfig
from runtime.engine import Engine, EngineClosedError, InvalidRequestError
from runtime.prefix import union_prefix_tokens
from runtime.protocol import GenerateRequest, SamplingParams, ScoreRequest

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


# every test here checks tree, allocator and scheduler invariants after each step
pytestmark = pytest.mark.usefixtures("engine_steps_checked")


@pytest.fixture(scope="module")
def w1_prompts(tiny_model_dir):
    """First turns of W1 (test size) as chat-templated token ids."""
    from runtime.model.loader import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    return first_turn_ids(tokenizer, make_inputs(tokenizer, "test"))


def engine(tiny_model_dir, **kwargs) -> Engine:
    kwargs.setdefault("max_kv_tokens", 40_000)
    return Engine(EngineConfig(model=str(tiny_model_dir), **kwargs))


def requests(prompts, params=GREEDY):
    return [GenerateRequest(input_ids=p, sampling=params) for p in prompts]


def pressure_prompts() -> list[list[int]]:
    """Six prompts sharing a 300-token prefix, two groups of three sharing 200 more."""
    shared = [100 + i for i in range(300)]
    groups = [[2000 + i for i in range(200)], [3000 + i for i in range(200)]]
    return [shared + groups[i % 2] + [5000 + 10 * i + j for j in range(40)] for i in range(6)]


# ---------------------------------------------------------------- prefill once, exactly
def test_cold_w1_batch_computes_exactly_the_union_prefix_tree(tiny_model_dir, w1_prompts):
    with engine(tiny_model_dir) as eng:
        results = eng.generate(requests(w1_prompts))
        stats = eng.stats()
    unique = union_prefix_tokens(w1_prompts)
    assert unique < sum(map(len, w1_prompts)) * 0.5  # W1 shares most of every prompt
    assert stats["prefill_tokens_total"] == unique
    assert stats["cached_tokens_total"] == sum(map(len, w1_prompts)) - unique
    assert sum(r.cached_tokens for r in results) == stats["cached_tokens_total"]
    assert all(r.completion_tokens == 12 for r in results)


def test_cold_w1_batch_with_pages_of_16(tiny_model_dir, w1_prompts):
    with engine(tiny_model_dir, page_size=16) as eng:
        eng.generate(requests(w1_prompts))
        computed = eng.stats()["prefill_tokens_total"]
    unique = union_prefix_tokens(w1_prompts)
    divergences = len(w1_prompts) - 1
    assert unique <= computed <= unique + 15 * divergences


# ---------------------------------------------------------------- same outputs everywhere
@pytest.fixture(scope="module")
def reference_outputs(tiny_model_dir, w1_prompts):
    with engine(tiny_model_dir, disable_radix_cache=True) as eng:
        outputs = [r.output_ids for r in eng.generate(requests(w1_prompts + pressure_prompts()))]
    assert len({tuple(o) for o in outputs}) >= 0.75 * len(outputs), "outputs must differ"
    return outputs


@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(page_size=16),
        dict(schedule_policy="lpm"),
        dict(schedule_policy="dfs-weight"),
        dict(schedule_policy="lof"),
        dict(schedule_policy="random"),
        dict(schedule_policy="priority"),
        dict(chunked_prefill_tokens=256),
        dict(eviction_policy="slru", page_size=16, chunked_prefill_tokens=300),
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default",
)
def test_greedy_outputs_equal_cache_off(tiny_model_dir, w1_prompts, reference_outputs, config):
    with engine(tiny_model_dir, **config) as eng:
        results = eng.generate(requests(w1_prompts + pressure_prompts()))
    assert [r.output_ids for r in results] == reference_outputs


def test_pressure_forces_eviction_and_retraction_but_changes_nothing(tiny_model_dir, w1_prompts):
    # each request fits alone (W1 prompts are ~2.7k tokens), all together do not; admission
    # reserves only part of max_new_tokens, so long generations overrun it and get retracted
    params = SamplingParams(temperature=0, max_new_tokens=160, ignore_eos=True)
    prompts = w1_prompts[:4] + pressure_prompts()
    with engine(tiny_model_dir, disable_radix_cache=True) as eng:
        expected = [r.output_ids for r in eng.generate(requests(prompts, params))]
    with engine(tiny_model_dir, max_kv_tokens=3600, chunked_prefill_tokens=512) as eng:
        results = eng.generate(requests(prompts, params))
        stats = eng.stats()
    assert stats["evicted_tokens_total"] > 0
    assert stats["retractions_total"] > 0
    assert [r.output_ids for r in results] == expected


def test_many_submitter_threads(tiny_model_dir, w1_prompts, reference_outputs):
    prompts = w1_prompts + pressure_prompts()
    outputs: dict[int, list[int]] = {}
    with engine(tiny_model_dir) as eng:

        def worker(i: int) -> None:
            outputs[i] = eng.submit(requests([prompts[i]])[0]).result().output_ids

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [outputs[i] for i in range(len(prompts))] == reference_outputs


# ---------------------------------------------------------------- pins
def test_pinned_prefix_survives_pressure_and_is_never_recomputed(tiny_model_dir):
    prefix = [7000 + i for i in range(400)]
    with engine(tiny_model_dir, max_kv_tokens=1200, chunked_prefill_tokens=256) as eng:
        pin = eng.pin(prefix)
        assert pin.info.cached_tokens == 0
        computed_for_pin = eng.stats()["prefill_tokens_total"]
        assert computed_for_pin == 400
        # unrelated traffic that needs the pool several times over
        others = [[9000 + 1000 * k + i for i in range(300)] for k in range(6)]
        eng.generate(requests(others, SamplingParams(temperature=0, max_new_tokens=4)))
        assert eng.stats()["evicted_tokens_total"] > 0
        # the pinned prefix is still fully cached: only the new suffix is computed
        before = eng.stats()["prefill_tokens_total"]
        (result,) = eng.generate(
            requests([prefix + [11, 12, 13]], SamplingParams(temperature=0, max_new_tokens=2))
        )
        assert result.cached_tokens == 400
        assert eng.stats()["prefill_tokens_total"] - before == 3
        pin.release()
        assert eng.stats()["num_pins"] == 0
        eng.generate(requests(others, SamplingParams(temperature=0, max_new_tokens=4)))
        (again,) = eng.generate(
            requests([prefix + [11, 12, 13]], SamplingParams(temperature=0, max_new_tokens=2))
        )
        assert again.cached_tokens < 400, "after unpin and pressure the prefix could go"


def test_pin_handle_dropped_releases_the_pin(tiny_model_dir):
    import gc

    with engine(tiny_model_dir) as eng:
        pin = eng.pin([5, 6, 7, 8])
        assert eng.stats()["num_pins"] == 1
        del pin
        gc.collect()
        assert eng.stats()["num_pins"] == 0


# ---------------------------------------------------------------- lifecycle and errors
def test_flush_cache_frees_every_slot(tiny_model_dir, w1_prompts):
    with engine(tiny_model_dir) as eng:
        eng.generate(requests(w1_prompts[:3]))
        assert eng.stats()["kv_slots_used"] > 0
        flushed = eng.flush_cache()
        stats = eng.stats()
        assert flushed > 0 and stats["kv_slots_used"] == 0 and stats["cache_tokens"] == 0


def test_abort_mid_generation_frees_everything(tiny_model_dir):
    params = SamplingParams(temperature=0, max_new_tokens=2000, ignore_eos=True)
    with engine(tiny_model_dir) as eng:
        handle = eng.submit(GenerateRequest(input_ids=list(range(50, 150)), sampling=params))
        stream = iter(handle)
        next(stream)  # generation is under way
        handle.cancel()
        result = handle.result(timeout=60)
        assert result.finish_reason == "abort" and 0 < result.completion_tokens < 2000
        eng.flush_cache()
        assert eng.stats()["kv_slots_used"] == 0


def test_bad_requests_fail_alone(tiny_model_dir):
    good = GenerateRequest(input_ids=[1, 2, 3], sampling=GREEDY)
    bad = [
        GenerateRequest(input_ids=[], sampling=GREEDY),
        GenerateRequest(input_ids=[1, 49152], sampling=GREEDY),
        GenerateRequest(input_ids=[1] * 8190, sampling=GREEDY),
    ]
    with engine(tiny_model_dir, max_kv_tokens=4000) as eng:
        results = eng.generate([bad[0], good, bad[1], bad[2]])
        assert [r.finish_reason for r in results] == ["error", "length", "error", "error"]
        assert "empty" in results[0].error
        assert "49152 is outside the vocabulary" in results[2].error
        assert "exceeds the model's context of 8192" in results[3].error
        with pytest.raises(InvalidRequestError, match="never fit"):
            eng.submit(
                GenerateRequest(input_ids=[1] * 3000, sampling=SamplingParams(max_new_tokens=1500))
            )
        with pytest.raises(ValueError):
            SamplingParams(max_new_tokens=-1)
        twice = eng.generate([good, good])  # one id, two requests: the second is refused
        assert twice[0].finish_reason == "length" and "already in flight" in twice[1].error
        assert eng.generate([good])[0].output_ids == results[1].output_ids
    with pytest.raises(EngineClosedError):
        eng.submit(good)


def test_a_request_the_pins_leave_no_room_for_fails_alone_as_busy(tiny_model_dir):
    with engine(tiny_model_dir, max_kv_tokens=600) as eng:
        pin = eng.pin(list(range(100, 400)))  # 300 of 600 slots held
        big = GenerateRequest(input_ids=list(range(1000, 1400)), sampling=GREEDY)
        small = GenerateRequest(input_ids=[1, 2, 3], sampling=GREEDY)
        results = eng.generate([big, small])
        assert results[0].finish_reason == "error" and results[0].error_kind == "busy"
        assert "300 of 600 are held: retry later" in results[0].error
        assert results[1].finish_reason == "length"
        pin.release()
        retried = eng.generate(big.model_copy(update={"rid": "again"}))[0]
        assert retried.finish_reason == "length", "with the pin gone the same request fits"


# ---------------------------------------------------------------- scoring, streaming, logprobs
@pytest.mark.parametrize(
    "conts",
    [
        [[5, 6, 7], [8, 9], [11]],
        [[5, 6, 7], [5, 9], [11]],  # a shared first token
        [[216, 33], [216, 33, 32], [216, 34], [216, 33, 33], [216, 33]],  # " 1", " 10", ... twice
    ],
)
@pytest.mark.parametrize("disable", [False, True])
def test_score_matches_prompt_logprobs_and_computes_every_token_once(
    tiny_model_dir, conts, disable
):
    """Each token whose KV scoring needs (a continuation's last token needs none) is computed
    once: the shared prefix and every shared part of the continuations."""
    prefix = list(range(300, 420))
    with engine(tiny_model_dir, disable_radix_cache=disable) as eng:
        (scored,) = eng.score(ScoreRequest(prefix=prefix, continuations=conts))
        computed = eng.stats()["prefill_tokens_total"]
        if not disable:
            assert computed == union_prefix_tokens([prefix + c[:-1] for c in conts])
        assert eng.stats()["num_pins"] == 0
        full = eng.generate(
            [
                GenerateRequest(
                    input_ids=prefix + c,
                    sampling=SamplingParams(max_new_tokens=1, prompt_logprobs=True),
                )
                for c in conts
            ]
        )
    for c, s, f in zip(conts, scored.token_logprobs, full, strict=True):
        assert len(s) == len(c)
        expected = f.prompt_logprobs[len(prefix) :]
        assert max(abs(a - b) for a, b in zip(s, expected, strict=True)) < 1e-4


def test_streaming_and_logprobs(tiny_model_dir):
    params = SamplingParams(
        temperature=0, max_new_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    with engine(tiny_model_dir) as eng:
        handle = eng.submit(GenerateRequest(text="Hello, how are you today?", sampling=params))
        streamed = "".join(handle)
        result = handle.result()
    assert streamed == result.text and result.completion_tokens == 10
    assert [lp.token_id for lp in result.logprobs] == result.output_ids
    assert all(lp.top[0][1] >= lp.logprob - 1e-6 for lp in result.logprobs)


def test_a_cancelled_score_stops_and_tells_whoever_runs_it_elsewhere(tiny_model_dir):
    from runtime.scoring import Cancellation, ScoreCancelled

    forwarded = []
    cancel = Cancellation()
    cancel.on_cancel(lambda: forwarded.append("replica"))
    cancel.cancel()
    cancel.cancel()  # twice: forwarded once
    late = []
    cancel.on_cancel(lambda: late.append("at once"))  # registered after: called at once
    assert forwarded == ["replica"] and late == ["at once"]
    request = ScoreRequest(prefix=list(range(300, 400)), continuations=[[5, 6], [7, 8]])
    with engine(tiny_model_dir) as eng:
        with pytest.raises(ScoreCancelled):
            eng.scorer.score(request, cancel)
        stats = eng.stats()
        assert stats["num_pins"] == 0 and stats["num_running"] == 0
        (scored,) = eng.score(request)  # the engine serves on
        assert len(scored.token_logprobs) == 2


def test_a_cpu_engine_releases_its_builders_openmp_workers_before_its_loop_runs(
    tiny_model_dir, monkeypatch
):
    calls = []
    monkeypatch.setattr(
        "runtime.engine_build.release_openmp_workers", lambda: calls.append(threading.get_ident())
    )
    with engine(tiny_model_dir) as eng:
        assert calls == [threading.get_ident()]  # once, on the thread that built the model
        assert eng.generate(requests([[5, 6, 7, 8]]))[0].output_ids
