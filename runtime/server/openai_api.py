"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.errors import InvalidRequestError
from runtime.handles import RequestHandle
from runtime.protocol import (
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    TokenLogprob,
)
from runtime.server.agent_hints import graph_hints
from runtime.server.chat_turn import ChatDeltas, ChatPlan, chat_message, finish_reason, plan_chat
from runtime.server.errors import AsciiJSONResponse, error_frame, failure_of
from runtime.server.fields import AuditedFields
from runtime.server.schemas import ChatBody, CompletionBody
from runtime.server.sglang_ops import model_path
from runtime.server.state import Server, ServerDep
from runtime.server.streaming import interleave, sse
from runtime.server.tenant_pool import TEXT_WORK

router = APIRouter(prefix="/v1")
log = logging.getLogger("flowlang.server")

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@router.get("/models")
async def models(server: ServerDep):
    """The one model served."""
    return {
        "object": "list",
        "data": [
            {
                "id": server.engine.config.model,
                "object": "model",
                "created": int(server.started),
                "owned_by": "flowlang",
                "max_model_len": server.engine.arch.max_context_len,
            }
        ],
    }


def served_model_names(server: Server) -> list[str]:
    """The names a request's `model` may give: the id /v1/models lists, and the Hugging Face
    repo id /get_model_info reports as model_path (the same model)."""
    names = [server.engine.config.model, model_path(server.engine)]
    return list(dict.fromkeys(names))


def _unknown_model(server: Server, model: str | None) -> JSONResponse | None:
    """OpenAI's 404 (code model_not_found) for a model this server does not serve; None
    (any model) when the request names none."""
    names = served_model_names(server)
    if model is None or model in names:
        return None
    server.http_errors[404] += 1
    message = f"The model {model!r} does not exist: this server serves {names[0]!r}"
    error = {
        "message": message,
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    return AsciiJSONResponse({"error": error}, status_code=404)


@router.post("/completions")
async def completions(body: CompletionBody, request: Request, server: ServerDep):
    """Text completion: n choices per prompt, optionally streamed, with logprobs."""
    unknown = _unknown_model(server, body.model)
    if unknown is not None:
        return unknown
    _log_ignored("/v1/completions", body)
    logprobs = body.logprobs is not None
    namespace = server.namespace(request, body.cache_namespace())
    hints = graph_hints(server, request, body)
    constraint = body.constraint()
    max_tokens = body.max_tokens or COMPLETION_MAX_TOKENS
    requests, echoes = [], []
    for prompt in body.prompts():
        if isinstance(prompt, str) and not body.add_special_tokens:  # tokenized off the loop
            prompt = await asyncio.to_thread(server.engine.tokens, prompt, False)
        echo = _prompt_text(server, prompt) if body.echo else ""
        for i in range(body.n):
            echoes.append(echo)
            params = body.sampling(max_tokens, i, logprobs, body.logprobs or 0)
            requests.append(
                GenerateRequest(
                    sampling=params,
                    constraint=constraint,
                    namespace=namespace,
                    hints=hints,
                    **({"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}),
                )
            )
    handles, cid, created = await _submit(server, request, requests, "cmpl")
    if body.stream:
        chunks = _completion_stream(server, body, handles, cid, created, echoes)
        return sse(server.engine, handles, chunks)
    results = _checked(await server.wait(request, handles))
    choices = [
        {
            "index": i,
            "text": echoes[i] + r.text,
            "finish_reason": finish_reason(r),
            "logprobs": _completion_logprobs(server, r.logprobs or []) if logprobs else None,
        }
        for i, r in enumerate(results)
    ]
    return _whole_response(server, cid, "text_completion", created, choices, results, body.n)


@router.post("/chat/completions")
async def chat(body: ChatBody, request: Request, server: ServerDep):
    """Chat completion through the model's chat template: tools and tool calls, reasoning
    split off, response_format schemas."""
    unknown = _unknown_model(server, body.model)
    if unknown is not None:
        return unknown
    _log_ignored("/v1/chat/completions", body, body.messages)
    # templates can be slow: on the few threads for request texts, a bounded share per key
    limit = server.settings.max_requests_per_key
    plan = await TEXT_WORK.run(server.tenant(request), limit, plan_chat, server.engine, body)
    top = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens or body.max_tokens or _room_after(server, plan)
    namespace = server.namespace(request, body.cache_namespace())
    hints = graph_hints(server, request, body)
    requests = [
        GenerateRequest(
            input_ids=plan.prompt_ids,
            constraint=plan.constraint,
            namespace=namespace,
            hints=hints,
            sampling=_chat_sampling(body, plan, max_tokens, i, top),
        )
        for i in range(body.n)
    ]
    handles, cid, created = await _submit(server, request, requests, "chatcmpl")
    if body.stream:
        chunks = _chat_stream(server, body, plan, handles, cid, created)
        return sse(server.engine, handles, chunks)
    results = _checked(await server.wait(request, handles))
    choices = []
    for i, r in enumerate(results):
        message, finish = chat_message(plan, r)
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": _chat_logprobs(server, r.logprobs or []) if body.logprobs else None,
                "finish_reason": finish,
            }
        )
    return _whole_response(server, cid, "chat.completion", created, choices, results, body.n)


def _room_after(server: Server, plan: ChatPlan) -> int:
    """vLLM's default max_tokens for chat: the rest of the context after the prompt (and of
    the KV pool, where that is smaller: a request must fit in it whole)."""
    engine = server.engine
    room = min(engine.arch.max_context_len, engine.num_slots)
    left = room - len(plan.prompt_ids)
    if left < 1:
        raise InvalidRequestError(
            f"the prompt of {len(plan.prompt_ids)} tokens leaves no room for an answer in "
            f"{room} tokens (the model's context, or the KV pool if smaller)"
        )
    return left


def _chat_sampling(
    body: ChatBody, plan: ChatPlan, max_tokens: int, index: int, top: int
) -> SamplingParams:
    params = body.sampling(max_tokens, index, body.logprobs, top)
    if plan.keep_special_tokens:  # the calls' marker must stay in the text the parser reads
        params = params.model_copy(update={"skip_special_tokens": False})
    return params


def _log_ignored(route: str, body: AuditedFields, parts: Sequence[AuditedFields] = ()) -> None:
    """Say loudly which fields a request set that have no effect here."""
    ignored = body.fields_of_kind("ignored")
    ignored += sorted({f"messages.{n}" for m in parts for n in m.fields_of_kind("ignored")})
    for name in ("stream_options", "structured_outputs"):
        nested = getattr(body, name)
        if nested is not None:
            ignored += [f"{name}.{n}" for n in nested.fields_of_kind("ignored")]
    if ignored:
        log.warning("%s fields with no effect here: %s", route, ignored, extra={"ignored": ignored})


def _prompt_text(server: Server, prompt: str | list[int]) -> str:
    """What `echo` puts before a choice: the prompt's text (token prompts decoded)."""
    if isinstance(prompt, str):
        return prompt
    server.engine.validate_ids(prompt, "token id")
    return server.engine.tokenizer.decode(prompt)


def _checked(results: list[GenerateResult]) -> list[GenerateResult]:
    for result in results:
        failure = failure_of(result)
        if failure is not None:
            raise failure
    return results


async def _submit(
    server: Server, request: Request, requests: list[GenerateRequest], id_prefix: str
) -> tuple[list[RequestHandle], str, int]:
    """Queue a route's requests as the caller's key: their handles, then the response's id
    ("<id_prefix>-<hex>") and creation time in Unix seconds, which its stream frames repeat."""
    handles = await server.submit(requests, server.tenant(request))
    return handles, f"{id_prefix}-{uuid.uuid4().hex}", int(time.time())


def _whole_response(
    server: Server,
    cid: str,
    kind: str,
    created_s: int,
    choices: list[dict],
    results: list[GenerateResult],
    n: int,
) -> dict:
    """A non-streamed response of OpenAI's `kind` ("object"), its n choices per prompt."""
    return {
        "id": cid,
        "object": kind,
        "created": created_s,
        "model": server.engine.config.model,
        "choices": choices,
        "usage": _usage(results, n),
    }


def _usage(results: list[GenerateResult], n: int) -> dict:
    """Token counts of a call whose results are n choices per prompt, prompt-major: each
    prompt counts once (as OpenAI and vLLM count it), every choice's output counts."""
    firsts = results[::n]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)},
    }


def _token_text(server: Server, token_id: int) -> str:
    return server.engine.tokenizer.decode([token_id])


def _completion_logprobs(server: Server, logprobs: list[TokenLogprob], offset: int = 0) -> dict:
    """OpenAI's completions logprobs of these tokens, whose text starts at `offset`."""
    tokens, offsets = [], []
    for lp in logprobs:
        text = _token_text(server, lp.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{_token_text(server, t): v for t, v in (lp.top or [])} for lp in logprobs],
        "text_offset": offsets,
    }


def _chat_logprobs(server: Server, logprobs: list[TokenLogprob]) -> dict:
    """OpenAI's chat logprobs (`content`) of these tokens."""
    content = []
    for lp in logprobs:
        text = _token_text(server, lp.token_id)
        content.append(
            {
                "token": text,
                "logprob": lp.logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": _token_text(server, t),
                        "logprob": v,
                        "bytes": list(_token_text(server, t).encode()),
                    }
                    for t, v in (lp.top or [])
                ],
            }
        )
    return {"content": content}


async def _pieces(handle: RequestHandle) -> AsyncGenerator[tuple[str, list[TokenLogprob]], None]:
    """A stream's text deltas, each with the logprobs of the tokens generated since the
    previous delta (tokens whose text is held back, by a stop string that may still match,
    ride on the next delta); the tokens after the last delta come with an empty text."""
    pending: list[TokenLogprob] = []
    async for chunk in handle.achunks():
        pending += chunk.logprobs
        if chunk.text:
            yield chunk.text, pending
            pending = []
    if pending:
        yield "", pending


def _completion_stream(
    server: Server,
    body: CompletionBody,
    handles: list[RequestHandle],
    cid: str,
    created: int,
    echoes: list[str],
) -> AsyncGenerator[str, None]:
    model = server.engine.config.model
    logprobs = body.logprobs is not None

    def frame(choices: list[dict], **extra) -> str:
        out = {"id": cid, "object": "text_completion", "created": created, "model": model}
        return json.dumps({**out, "choices": choices, **extra})

    def chunk(index: int, text: str, finish: str | None, lps: dict | None = None) -> str:
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": lps}
        return frame([choice])

    async def choice(index: int, handle: RequestHandle) -> AsyncGenerator[str, None]:
        if echoes[index]:
            yield chunk(index, echoes[index], None)
        offset = 0
        async for text, token_logprobs in _pieces(handle):
            lps = _completion_logprobs(server, token_logprobs, offset) if logprobs else None
            offset += sum(len(t) for t in lps["tokens"]) if lps else 0
            if text or lps:
                yield chunk(index, text, None, lps)
        result = await handle.aresult()
        failure = failure_of(result)
        if failure is not None:  # an error frame, never a finish_reason that says it ended well
            raise _ChoiceFailed(error_frame(failure))
        results[index] = result
        yield chunk(index, "", finish_reason(result))

    results: list[GenerateResult | None] = [None] * len(handles)
    return _choices_interleaved(choice, handles, results, frame, body)


def _chat_stream(
    server: Server,
    body: ChatBody,
    plan: ChatPlan,
    handles: list[RequestHandle],
    cid: str,
    created: int,
) -> AsyncGenerator[str, None]:
    model = server.engine.config.model

    def frame(choices: list[dict], **extra) -> str:
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
        return json.dumps({**out, "choices": choices, **extra})

    def chunk(index: int, delta: dict, finish: str | None, lps: list | None = None) -> str:
        logprobs = _chat_logprobs(server, lps) if lps else None
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return frame([choice])

    async def choice(index: int, handle: RequestHandle) -> AsyncGenerator[str, None]:
        deltas = ChatDeltas(plan)
        yield chunk(index, {"role": "assistant", "content": ""}, None)
        pending: list[TokenLogprob] = []  # logprobs not yet sent: they go with the next delta
        async for text, token_logprobs in _pieces(handle):
            pending += token_logprobs if body.logprobs else []
            for delta in deltas.feed(text):
                yield chunk(index, delta, None, pending)
                pending = []
        result = await handle.aresult()
        failure = failure_of(result)
        if failure is not None:
            raise _ChoiceFailed(error_frame(failure))
        for delta in deltas.finish():
            yield chunk(index, delta, None, pending)
            pending = []
        results[index] = result
        yield chunk(index, {}, finish_reason(result, deltas.num_calls > 0), pending)

    results: list[GenerateResult | None] = [None] * len(handles)
    return _choices_interleaved(choice, handles, results, frame, body)


class _ChoiceFailed(Exception):
    """A streamed choice failed: `frame` says so, and the stream ends after it."""

    def __init__(self, frame: str) -> None:
        super().__init__(frame)
        self.frame = frame


async def _choices_interleaved(
    choice: Callable[[int, RequestHandle], AsyncGenerator[str, None]],
    handles: list[RequestHandle],
    results: list[GenerateResult | None],
    frame: Callable[..., str],
    body: CompletionBody | ChatBody,
) -> AsyncGenerator[str, None]:
    """Each choice's frames as they come, the n choices interleaved as their tokens are
    produced; a failed choice's error frame ends the stream (the others are aborted). When
    every choice finished (`choice` fills `results`) and `body` asked for usage, a last
    `frame` carries it."""
    streams = [choice(index, handle) for index, handle in enumerate(handles)]
    async with contextlib.aclosing(interleave(streams)) as frames:
        try:
            async for out in frames:
                yield out
        except _ChoiceFailed as failed:
            yield failed.frame
    if body.include_usage and all(r is not None for r in results):
        yield frame([], usage=_usage(results, body.n))
