"""What callers receive from a request: its GenerateResult when finished, StreamChunks while
it runs."""

from __future__ import annotations

from runtime.generation import GenerationState
from runtime.protocol import GenerateResult, StreamChunk, TokenLogprob
from runtime.scheduler.request import Req


def result_of(req: Req) -> GenerateResult:
    """The result of a finished request: text, ids, counts, logprobs when asked, error."""
    gen = req.gen
    logprobs = None
    if gen.params.logprobs or gen.params.top_logprobs:
        logprobs = _token_logprobs(gen, range(len(gen.output_logprobs)))
    prompt_asked = gen.params.prompt_logprobs
    return GenerateResult(
        rid=req.rid,
        text=gen.text,
        output_ids=list(gen.output_ids),
        finish_reason=gen.finish_reason,
        matched_stop=gen.matched_stop,
        prompt_tokens=len(req.prompt_ids),
        cached_tokens=req.usage.cached_tokens or 0,
        loaded_tokens=req.usage.loaded_tokens or 0,
        ttft_s=_since_submitted(req, req.usage.first_token_s),
        queue_wait_s=_since_submitted(req, req.usage.admitted_s),
        completion_tokens=len(gen.output_ids),
        logprobs=logprobs,
        prompt_logprobs=req.logprobs.values if prompt_asked else None,
        prompt_top_logprobs=req.logprobs.tops if prompt_asked and gen.params.top_logprobs else None,
        prompt_ids=list(req.prompt_ids) if prompt_asked else None,
        error=req.error,
        error_kind=req.error_kind,
    )


def _since_submitted(req: Req, when_s: float | None) -> float | None:
    """Seconds from the request's submission to `when_s` (a time.monotonic()), if it came."""
    return None if when_s is None else when_s - req.usage.submitted_s


def stream_chunk_of(req: Req) -> StreamChunk:
    """What `req` produced since its previous chunk: text safe to show, tokens, logprobs;
    the prompt's logprobs ride on the first chunk."""
    gen = req.gen
    new = gen.take_new_outputs()
    first = new.start == 0
    prompt_asked = first and gen.params.prompt_logprobs
    wants_logprobs = gen.params.logprobs or gen.params.top_logprobs
    return StreamChunk(
        text=gen.stream_delta(),
        output_ids=gen.output_ids[new.start : new.stop],
        num_output_tokens=len(gen.output_ids),
        num_prompt_tokens=len(req.prompt_ids),
        cached_tokens=req.usage.cached_tokens or 0,
        logprobs=_token_logprobs(gen, new) if wants_logprobs else [],
        prompt_logprobs=list(req.logprobs.values) if prompt_asked else None,
        prompt_top_logprobs=list(req.logprobs.tops) if prompt_asked else None,
        prompt_ids=list(req.prompt_ids) if prompt_asked else None,
    )


def _token_logprobs(gen: GenerationState, indices: range) -> list[TokenLogprob]:
    """The logprobs (and top-k, when asked) of the output tokens at `indices`."""
    tops = gen.output_top_logprobs
    num = min(indices.stop, len(gen.output_logprobs))  # forced tokens have none
    return [
        TokenLogprob(
            token_id=gen.output_ids[i],
            logprob=gen.output_logprobs[i],
            top=tops[i] if i < len(tops) else None,
        )
        for i in range(indices.start, num)
    ]


def error_result(rid: str, message: str) -> GenerateResult:
    """The result of a request refused before it ran."""
    return GenerateResult(
        rid=rid,
        text="",
        output_ids=[],
        finish_reason="error",
        prompt_tokens=0,
        cached_tokens=0,
        completion_tokens=0,
        error=message,
    )
