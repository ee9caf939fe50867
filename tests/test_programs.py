"""The workload programs end to end on the tiny model through the in-process engine."""

from __future__ import annotations

import pytest
import torch

import flowlang as fl
from flowlang import gen, program, select
from flowlang.backends.local import LocalBackend
from programs import fewshot_choice, judge, multi_turn_chat, support_agent, tree_of_thought
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.prefix import union_prefix_tokens
from runtime.protocol import GenerateRequest, SamplingParams


def workloads(tokenizer):
    return {
        "W1": (
            support_agent.support_agent,
            support_agent.batch_args(support_agent.make_inputs(tokenizer, "test")),
        ),
        "W2": (
            fewshot_choice.fewshot_choice,
            fewshot_choice.batch_args(fewshot_choice.make_inputs(tokenizer, "test")),
        ),
        "W3": (
            tree_of_thought.tree_of_thought,
            [{"question": q} for q in tree_of_thought.make_inputs(tokenizer, "test")],
        ),
        "W4": (judge.judge, [{"case": c} for c in judge.make_inputs(tokenizer, "test")]),
        "W6": (
            multi_turn_chat.multi_turn_chat,
            multi_turn_chat.batch_args(multi_turn_chat.make_inputs(tokenizer, "test")),
        ),
    }


def run(tiny_model_dir, name, **config):
    config.setdefault("max_kv_tokens", 60_000)
    with Engine(EngineConfig(model=str(tiny_model_dir), **config)) as engine:
        backend = LocalBackend(engine, record=True)
        prog, batch = workloads(engine.tokenizer)[name]
        states = prog.run_batch(batch, backend=backend, progress=False)
        assert all(isinstance(s, fl.ProgramState) for s in states), states
        outputs = [s.variables() for s in states]
        return outputs, engine.stats(), backend


@pytest.mark.parametrize("name", ["W1", "W2", "W3", "W4", "W6"])
def test_greedy_outputs_equal_cache_disabled(tiny_model_dir, name):
    cached, stats, _ = run(tiny_model_dir, name)
    uncached, _, _ = run(tiny_model_dir, name, disable_radix_cache=True)
    assert cached == uncached
    assert stats["cache_hit_rate"] > 0.3


@pytest.mark.parametrize("name", ["W1", "W3", "W4"])
def test_prefill_computed_is_the_exact_lower_bound(tiny_model_dir, name):
    _, stats, backend = run(tiny_model_dir, name)
    assert stats["prefill_tokens_total"] == backend.prompt_report()["lower_bound"]
    assert stats["num_pins"] == 0, "every fork and batch pin was released"


def test_fork_branches_equal_independent_runs(tiny_model_dir):
    with Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=20_000)) as engine:
        backend = LocalBackend(engine)
        case = judge.make_inputs(engine.tokenizer, "test")[0]
        forked = judge.judge.run(case=case, backend=backend)

        @program
        def one_branch(s, criterion):
            s += fl.system("You grade support replies strictly and briefly.")
            s += fl.user(f"Customer question: {case.question}\n\nAgent reply: {case.answer}")
            s += fl.assistant(
                f"Judging {criterion}: ",
                gen("assessment", max_new_tokens=judge.ASSESS_TOKENS, temperature=0.0),
            )

        engine.flush_cache()
        alone = [one_branch.run(criterion=c, backend=backend)["assessment"] for c in judge.CRITERIA]
    assert forked["assessment"] == alone


def test_fork_prefix_is_computed_once_under_eviction_pressure(tiny_model_dir):
    prefix = " ".join(f"word{i}" for i in range(180))  # about 700 tokens

    @program
    def fan_out(s):
        s += prefix
        branches = s.fork(4)
        for i, branch in enumerate(branches):
            branch += f" Branch {i} says:"
            branch += gen("x", max_new_tokens=60, temperature=0.0, ignore_eos=True)
        s.join(branches)

    with Engine(
        EngineConfig(model=str(tiny_model_dir), max_kv_tokens=2600, chunked_prefill_tokens=256)
    ) as engine:
        backend = LocalBackend(engine, record=True)
        filler = [" ".join(f"fill{k}x{i}" for i in range(150)) for k in range(4)]
        engine.generate(
            [GenerateRequest(text=f, sampling=SamplingParams(max_new_tokens=1)) for f in filler]
        )  # fill the cache first
        before = engine.stats()
        fan_out.run(backend=backend)
        after = engine.stats()
    assert after["evicted_tokens_total"] > before["evicted_tokens_total"]
    prompts = [r.input_ids for r, _ in backend.generations]
    computed = after["prefill_tokens_total"] - before["prefill_tokens_total"]
    assert computed == union_prefix_tokens(prompts), "the shared prefix was computed once"


# ---------------------------------------------------------------- select vs a direct reference
def reference_choice(hf, prefix_ids, choice_ids, method, uncond_prefix):
    """Score each choice on its own with a transformers forward (fp32)."""

    def token_logprobs(prompt, cont):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + cont])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return [float(logprobs[len(prompt) - 1 + j, t]) for j, t in enumerate(cont)]

    cond = [token_logprobs(prefix_ids, c) for c in choice_ids]
    if method == "token_length_normalized":
        scores = [sum(lp) / len(lp) for lp in cond]
    elif method == "unconditional_likelihood_normalized":
        unc = [token_logprobs(uncond_prefix, c) for c in choice_ids]
        scores = [
            sum(a - b for a, b in zip(x, y, strict=True)) / len(x)
            for x, y in zip(cond, unc, strict=True)
        ]
    else:  # greedy: the choice greedy decoding restricted to the choices would produce
        alive, pos = list(range(len(choice_ids))), 0
        while len(alive) > 1:
            ended = [i for i in alive if pos >= len(choice_ids[i])]
            if ended:
                return ended[0]
            best = max(alive, key=lambda i: cond[i][pos])
            alive = [i for i in alive if choice_ids[i][pos] == choice_ids[best][pos]]
            pos += 1
        return alive[0]
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


CHOICES = [" Paris", " London", " a city in France", " Rome", " Par"]


@program
def capital(s, method):
    s += fl.user("What is the capital of France? Answer with one name.")
    with s.assistant():
        s += "The answer is"
        s += select("city", choices=CHOICES, method=method)


@pytest.mark.parametrize("which", ["tiny", "default"])
@pytest.mark.parametrize(
    "method", ["token_length_normalized", "greedy", "unconditional_likelihood_normalized"]
)
def test_select_picks_what_a_direct_reference_picks(
    which, method, tiny_model_dir, default_model_path
):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir if which == "tiny" else default_model_path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with Engine(EngineConfig(model=str(path), max_kv_tokens=8192)) as engine:
        backend = LocalBackend(engine, record=True)
        state = capital.run(method=method, backend=backend)
        (scored, *rest) = backend.scores
        choice_ids = [backend.tokenize(c) for c in CHOICES]
        uncond = rest[0].prefix_ids if rest else None
        expected = reference_choice(hf, scored.prefix_ids, choice_ids, method, uncond)
    assert state["city"] == CHOICES[expected]
