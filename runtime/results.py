"""GenerateResult from a finished request (the wire type callers receive)."""

from __future__ import annotations

from runtime.protocol import GenerateResult, TokenLogprob
from runtime.scheduler.request import Req


def result_of(req: Req) -> GenerateResult:
    """The result of a finished request: text, ids, counts, logprobs when asked, error."""
    gen = req.gen
    logprobs = None
    if gen.params.logprobs or gen.params.top_logprobs:
        tops = gen.output_top_logprobs or [None] * len(gen.output_logprobs)
        logprobs = [
            TokenLogprob(token_id=t, logprob=lp, top=top)
            for t, lp, top in zip(gen.output_ids, gen.output_logprobs, tops, strict=False)
        ]
    return GenerateResult(
        rid=req.rid,
        text=gen.text,
        output_ids=list(gen.output_ids),
        finish_reason=gen.finish_reason,
        matched_stop=gen.matched_stop,
        prompt_tokens=len(req.prompt_ids),
        cached_tokens=req.cached_tokens or 0,
        completion_tokens=len(gen.output_ids),
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs if gen.params.prompt_logprobs else None,
        prompt_ids=list(req.prompt_ids) if gen.params.prompt_logprobs else None,
        error=req.error,
    )


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
