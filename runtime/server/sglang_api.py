"""SGLang's native /generate: text or ids, single or batch, n samples, streamed with the running
meta_info, logprobs of the prompt and the output. The other native routes are in sglang_ops.

Logprob positions follow SGLang: `input_token_logprobs` covers prompt positions from
`logprob_start_len` on (position 0 has no logprob: null). Where SGLang leaves the first one
null at any start, flowlang gives its value (so every select method of SGLang's frontend has
numbers to add), and with `logprob_start_len` -1 a request that generates nothing gets the
whole prompt's (what the frontend's unconditional-likelihood select asks for).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request

from runtime.engine_api import EngineAPI
from runtime.handles import RequestHandle
from runtime.protocol import GenerateRequest, GenerateResult, GraphHints, StreamChunk
from runtime.server import sglang_ops
from runtime.server.agent_hints import graph_hints
from runtime.server.errors import error_frame, failure_of, invalid_input
from runtime.server.sglang_schemas import GenerateBody, Prompt
from runtime.server.state import Server, ServerDep
from runtime.server.streaming import sse

router = APIRouter()
router.include_router(sglang_ops.router)
log = logging.getLogger(__name__)


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(body: GenerateBody, request: Request, server: ServerDep):
    """Generate for one prompt or a batch, n samples each; `stream` sends the running output."""
    _log_fields(body)
    prompts = body.prompts()
    ids = await _prompt_ids(server.engine, body, prompts)
    hints = graph_hints(server, request, body)  # one program's, whatever the batch
    requests = [_request(server, request, hints, p, ids.get(p.prompt_index)) for p in prompts]
    output = _Output(server.engine, body, ids)
    handles = await server.submit(requests, server.tenant(request))
    if body.stream:
        return sse(server.engine, handles, _stream(output, handles, prompts))
    results = await server.wait(request, handles)
    out = [output(r, p) for r, p in zip(results, prompts, strict=True)]
    return out if body.is_batch else out[0]


def _log_fields(body: GenerateBody) -> None:
    """Say which fields a request sent, and loudly which of them have no effect here."""
    sent, unhonoured = body.fields_sent(), body.fields_unhonoured()
    extra = {"fields_sent": sent, "fields_unhonoured": unhonoured}
    log.debug("/generate fields: %s", sent, extra=extra)
    if unhonoured:
        log.warning("/generate fields with no effect here: %s", unhonoured, extra=extra)


async def _prompt_ids(engine: EngineAPI, body: GenerateBody, prompts: list[Prompt]) -> dict:
    """The token ids of the prompts whose length or ids the answer needs (a default
    max_new_tokens, return_prompt_token_ids), by prompt index: tokenized in a worker thread,
    as the engine's submit tokenizes the others, so a huge text never holds the event loop."""
    wanted = {
        p.prompt_index: p.prompt
        for p in prompts
        if p.sampling.max_new_tokens is None or body.return_prompt_token_ids
    }
    if not wanted:
        return {}

    def tokenize() -> dict[int, list[int]]:
        return {i: engine.tokens(prompt, special=True) for i, prompt in wanted.items()}

    return await asyncio.to_thread(tokenize)


def _request(
    server: Server, request: Request, hints: GraphHints, p: Prompt, ids: list[int] | None
) -> GenerateRequest:
    """The engine request for one prompt (one of its n samples); `ids`: the prompt's tokens
    where they were needed here (else the engine tokenizes it)."""
    engine, prompt = server.engine, p.prompt if ids is None else ids
    max_new_tokens = p.sampling.max_new_tokens
    if max_new_tokens is None:  # SGLang: as many as fit after the prompt (ids: tokenized)
        room = min(engine.arch.max_context_len, engine.num_slots)
        max_new_tokens = max(0, room - len(prompt))
    wants_prompt = p.return_logprob and (p.logprob_start_len >= 0 or max_new_tokens == 0)
    params, constraint = p.sampling.to_protocol(
        max_new_tokens=max_new_tokens,
        seed_offset=p.sample_index,
        logprobs=p.return_logprob,
        top_logprobs=p.top_logprobs_num if p.return_logprob else 0,
        prompt_logprobs=wants_prompt,
        logprob_start_len=max(1, p.logprob_start_len) if wants_prompt else None,
    )
    namespace = server.namespace(request, p.cache_salt)
    with invalid_input():
        return GenerateRequest(
            rid=p.rid or uuid.uuid4().hex,
            sampling=params,
            constraint=constraint,
            namespace=namespace,
            hints=hints,
            **({"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}),
        )


async def _stream(
    output: _Output, handles: list[RequestHandle], prompts: list[Prompt]
) -> AsyncGenerator[str, None]:
    """Each request's output so far whenever its text grows, then its final output; batches
    say `index`. As in SGLang's stream: text (its frontend slices off what it has), output_ids,
    counts and input logprobs are cumulative; the output logprob lists (output_token_logprobs,
    output_top_logprobs) hold the tokens since the request's previous chunk, which is how
    SGLang's frontend reads them (it joins them up). A chunk that adds no text is not sent:
    its tokens ride on the next one."""
    queue: asyncio.Queue[tuple[int, StreamChunk | GenerateResult]] = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        async for chunk in handle.achunks():
            queue.put_nowait((i, chunk))
        queue.put_nowait((i, await handle.aresult()))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    running = [_Running(h.rid) for h in handles]
    logprobs_sent = [0] * len(handles)  # per request: output logprobs already streamed
    num_running = len(handles)
    try:
        while num_running:
            i, item = await queue.get()
            if isinstance(item, GenerateResult):
                num_running -= 1
                failure = failure_of(item)
                if failure is not None:  # SGLang's stream says so in a data frame
                    yield error_frame(failure)
                    return
            if isinstance(item, StreamChunk):
                result = running[i].add(item)
                if not item.text:
                    continue
            else:
                result = item
            out = output(result, prompts[i], logprobs_sent[i])
            logprobs_sent[i] = len(result.logprobs or [])
            if output.body.is_batch:
                out["index"] = i
            yield json.dumps(out)
    finally:
        for task in tasks:
            task.cancel()


class _Running:
    """A streaming request's output so far, as a (not yet finished) GenerateResult."""

    def __init__(self, rid: str) -> None:
        self.fields: dict[str, Any] = dict(rid=rid, text="", output_ids=[], logprobs=[])

    def add(self, chunk: StreamChunk) -> GenerateResult:
        f = self.fields
        f["text"] += chunk.text
        f["output_ids"] += chunk.output_ids
        f["logprobs"] += chunk.logprobs
        f["completion_tokens"] = chunk.num_output_tokens
        f["cached_tokens"] = chunk.cached_tokens
        f["prompt_tokens"] = chunk.num_prompt_tokens
        if chunk.prompt_logprobs is not None:
            f["prompt_logprobs"] = chunk.prompt_logprobs
            f["prompt_top_logprobs"] = chunk.prompt_top_logprobs
            f["prompt_ids"] = chunk.prompt_ids
        # built without validation: the fields came from the engine, and this runs per token
        return GenerateResult.model_construct(finish_reason=None, **f)


class _Output:
    """Outputs in SGLang's shape (text, output_ids, meta_info) for one /generate call."""

    def __init__(self, engine: EngineAPI, body: GenerateBody, prompt_ids: dict) -> None:
        self.engine = engine
        self.body = body
        self.started = time.monotonic()
        self._texts: dict[int, str] = {}  # token texts for logprobs, decoded once per call
        # by prompt index, tokenized off the loop (every prompt's when the answer has them)
        self._prompt_ids: dict[int, list[int]] = prompt_ids

    def __call__(self, result: GenerateResult, p: Prompt, logprobs_from: int = 0) -> dict:
        """One request's output, finished or (streaming) so far; the output logprob lists
        from token `logprobs_from` on (a stream's since its previous chunk)."""
        failure = failure_of(result)
        if failure is not None:
            raise failure
        meta: dict[str, Any] = {
            "id": result.rid,
            "finish_reason": _finish_reason(result),
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "cached_tokens": result.cached_tokens,
            "loaded_tokens": result.loaded_tokens,  # of those, from host memory or disk
            "weight_version": "default",
        }
        if result.finish_reason is not None:
            meta["e2e_latency"] = time.monotonic() - self.started
        if p.return_logprob:
            meta.update(self._logprobs(result, p, logprobs_from))
        out = {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}
        if self.body.return_prompt_token_ids:
            out["prompt_token_ids"] = self._prompt_ids[p.prompt_index]
        return out

    def _logprobs(self, result: GenerateResult, p: Prompt, logprobs_from: int) -> dict:
        """SGLang's logprob lists: [logprob, token_id, text or null] per position."""
        every = result.logprobs or []
        logprobs = every[logprobs_from:]
        ids = result.prompt_ids or []
        positions = range(0)
        if result.prompt_logprobs is not None:
            positions = range(max(0, p.logprob_start_len), len(ids))
        out: dict[str, Any] = {
            "output_token_logprobs": [self._entry(lp.logprob, lp.token_id) for lp in logprobs],
            "output_token_logprobs_length": len(every),
            "input_token_logprobs": [
                self._entry(result.prompt_logprobs[j], ids[j]) for j in positions
            ],
        }
        if p.top_logprobs_num > 0:
            prompt_tops = result.prompt_top_logprobs or [None] * len(ids)
            out["output_top_logprobs"] = [self._tops(lp.top) for lp in logprobs]
            out["input_top_logprobs"] = [self._tops(prompt_tops[j]) for j in positions]
        return out

    def _entry(self, logprob: float | None, token_id: int) -> list:
        if not self.body.return_text_in_logprobs:
            return [logprob, token_id, None]
        if token_id not in self._texts:
            self._texts[token_id] = self.engine.tokenizer.decode([token_id])
        return [logprob, token_id, self._texts[token_id]]

    def _tops(self, top: list[tuple[int, float]] | None) -> list | None:
        return None if top is None else [self._entry(v, t) for t, v in top]


def _finish_reason(result: GenerateResult) -> dict | None:
    if result.finish_reason is None:
        return None
    reason: dict[str, Any] = {"type": result.finish_reason}
    if result.matched_stop is not None:
        reason["matched"] = result.matched_stop
    if result.finish_reason == "length":
        reason["length"] = result.completion_tokens
    return reason
