"""Sampler: seeds, support restriction (statistical, on a fixed distribution), penalties, logprobs;
GenerationState: stop strings cut exactly, EOS, lengths, streaming; incremental detokenizing."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.generation import GenerationState
from runtime.model.sampler import draw_by_cdf, sample, sample_on_device, token_logprobs
from runtime.protocol import SamplingParams

PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0, 0.0, 0.0])
LOGITS = torch.log(PROBS.clamp_min(1e-30))
VOCAB = PROBS.numel()


def state(prompt=(7,), tokenizer=None, eos=(), **params) -> GenerationState:
    return GenerationState(SamplingParams(**params), list(prompt), tokenizer, eos, VOCAB)


def draw_frequencies(num_draws=6000, sampler=sample, **params) -> torch.Tensor:
    rows = [state(seed=0, max_new_tokens=10**6, **params)] * num_draws  # one generator, N draws
    out = sampler(LOGITS.expand(num_draws, VOCAB), [r.sampler for r in rows])
    return torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).float() / num_draws


# the host sampler, and the one used where logits stay on an accelerator (device-agnostic)
SAMPLERS = pytest.mark.parametrize("sampler", [sample, sample_on_device], ids=["host", "device"])


@SAMPLERS
@pytest.mark.parametrize(
    "params, support",
    [
        (dict(), [0, 1, 2, 3, 4]),
        (dict(top_k=2), [0, 1]),
        (dict(top_p=0.7), [0, 1]),  # 0.4 + 0.3 reaches 0.7: the smallest such set
        (dict(top_p=0.75), [0, 1, 2]),
        (dict(min_p=0.3), [0, 1, 2]),  # keeps p >= 0.3 * 0.4 = 0.12
        (dict(top_k=3, top_p=0.5), [0, 1]),
    ],
)
def test_support_is_restricted_and_renormalized(params, support, sampler):
    freqs = draw_frequencies(temperature=1.0, sampler=sampler, **params)
    expected = torch.zeros(VOCAB)
    expected[support] = PROBS[support] / PROBS[support].sum()
    assert set(torch.nonzero(freqs).flatten().tolist()) == set(support)
    assert (freqs - expected).abs().max() < 0.03, (freqs, expected)


@SAMPLERS
def test_temperature_sharpens(sampler):
    cold = draw_frequencies(temperature=0.25, sampler=sampler)
    warm = draw_frequencies(temperature=1.0, sampler=sampler)
    assert cold[0] > 0.65 and cold[0] > warm[0] + 0.2


def test_draw_by_cdf_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]])
    for u in (0.0, 1e-9, 0.25, 0.4999, 0.5, 0.75, 1 - 1e-7):
        picked = draw_by_cdf(probs, torch.tensor([u, u])).tolist()
        assert picked[0] in (1, 3) and picked[1] == 4  # unnormalized rows too
        assert picked[0] == (1 if u < 0.5 else 3)


@SAMPLERS
def test_seed_reproduces_regardless_of_batch_neighbours(sampler):
    def run(seed, neighbours):
        row = state(seed=seed, max_new_tokens=100)
        others = [state(seed=99 + i, max_new_tokens=100) for i in range(neighbours)]
        tokens = []
        for _ in range(20):
            rows = [*others, row]
            samplers = [r.sampler for r in rows]
            tokens.append(sampler(LOGITS.expand(len(rows), VOCAB), samplers).token_ids[-1])
        return tokens

    assert run(seed=5, neighbours=0) == run(seed=5, neighbours=3)
    assert run(seed=5, neighbours=0) != run(seed=6, neighbours=0)


@SAMPLERS
def test_greedy_rows_and_sampled_rows_share_a_batch(sampler):
    rows = [state(temperature=0), state(seed=1, top_k=1), state(seed=1)]
    out = sampler(LOGITS.expand(3, VOCAB), [r.sampler for r in rows])
    assert out.token_ids[:2] == [0, 0]
    nan = LOGITS.expand(3, VOCAB).clone()
    nan[1, 2] = float("nan")
    out = sampler(nan, [r.sampler for r in rows])
    assert out.errors[0] is None and "no token" in out.errors[1] and out.errors[2] is None


def test_repetition_frequency_presence_penalties():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0, -5.0, -5.0, -5.0, -5.0]])
    assert sample(logits, [state(temperature=0, prompt=[0]).sampler]).token_ids == [0]
    # token 0 was in the prompt: 2.0 / 1.2 < 1.9
    penalized = state(temperature=0, prompt=[0], repetition_penalty=1.2)
    assert sample(logits, [penalized.sampler]).token_ids == [1]
    row = state(temperature=0, frequency_penalty=0.15, max_new_tokens=10)
    row.append(0)
    assert sample(logits, [row.sampler]).token_ids == [1]  # 2.0 - 0.15 < 1.9
    row.append(1)
    row.append(1)
    assert sample(logits, [row.sampler]).token_ids == [0]  # 1.85 > 1.9 - 2 * 0.15
    row = state(temperature=0, presence_penalty=0.5, max_new_tokens=10)
    row.append(0)
    assert sample(logits, [row.sampler]).token_ids == [1]


def test_logprobs_are_raw_and_top_logprobs_sorted():
    rows = [state(temperature=0, logprobs=True, top_logprobs=3, repetition_penalty=1.5)]
    out = sample(LOGITS[None], [r.sampler for r in rows])
    assert math.isclose(out.logprobs[0], math.log(0.4), rel_tol=1e-5)
    ids, values = zip(*out.top_logprobs[0], strict=True)
    assert list(ids) == [0, 1, 2]
    assert list(values) == sorted(values, reverse=True)
    assert math.isclose(values[1], math.log(0.3), rel_tol=1e-5)
    assert torch.allclose(token_logprobs(LOGITS[None], torch.tensor([2])), torch.log(PROBS[2:3]))


# ---------------------------------------------------------------- stop rules on real tokens
TEXT = "Hello world. The end is near, said the émigré 🙂. Goodbye."


def feed(tokenizer, text=TEXT, **params) -> tuple[GenerationState, str]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    gen = GenerationState(SamplingParams(max_new_tokens=1000, **params), [1], tokenizer, [2], 49152)
    streamed = ""
    for token_id in ids:
        gen.append(token_id)
        streamed += gen.stream_delta()
        if gen.finished:
            break
    else:
        gen.finish("length")
    return gen, streamed + gen.stream_delta()


def test_incremental_text_equals_full_decode(default_tokenizer):
    gen, streamed = feed(default_tokenizer)
    assert gen.text == TEXT == streamed


def test_stop_string_across_token_boundaries_cuts_exactly(default_tokenizer):
    ids = default_tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [default_tokenizer.decode([i]) for i in ids]
    assert " end" in pieces and " is" in pieces  # "end is" spans two tokens
    gen, streamed = feed(default_tokenizer, stop=["end is", "never"])
    assert gen.text == "Hello world. The " == streamed
    assert gen.finish_reason == "stop" and gen.matched_stop == "end is"
    assert gen.output_ids == ids[: pieces.index(" is") + 1]


def test_stop_string_inside_one_token_and_included(default_tokenizer):
    gen, _ = feed(default_tokenizer, stop=["orl"])
    assert gen.text == "Hello w"
    gen, streamed = feed(default_tokenizer, stop=["émigré"], include_stop_str_in_output=True)
    assert gen.text == "Hello world. The end is near, said the émigré" == streamed


def test_eos_min_and_max_new_tokens(default_tokenizer):
    gen = GenerationState(SamplingParams(max_new_tokens=5), [1], default_tokenizer, [2], 49152)
    gen.append(19556)
    gen.append(2)
    assert gen.finish_reason == "stop" and gen.matched_stop == 2
    assert "<|im_end|>" not in gen.text and gen.output_ids[-1] == 2
    gen = GenerationState(
        SamplingParams(max_new_tokens=5, min_new_tokens=3), [1], default_tokenizer, [2], 49152
    )
    gen.append(2)
    assert not gen.finished, "EOS before min_new_tokens is not a stop"
    for _ in range(4):
        gen.append(19556)
    assert gen.finish_reason == "length" and len(gen.output_ids) == 5
    with pytest.raises(RuntimeError):
        gen.append(1)
    ignoring = GenerationState(SamplingParams(ignore_eos=True), [1], default_tokenizer, [2], 49152)
    ignoring.append(2)
    assert not ignoring.finished


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="exceeds"):
        SamplingParams(min_new_tokens=5, max_new_tokens=2)
    with pytest.raises(ValueError, match="Extra inputs"):
        SamplingParams(temprature=0.5)
    assert SamplingParams(stop="x").stop == ["x"]
