"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence

from fastapi import APIRouter, Request

from runtime.handles import RequestHandle
from runtime.protocol import GenerateRequest, GenerateResult, SamplingParams
from runtime.server.chat_turn import ChatDeltas, ChatPlan, chat_message, finish_reason, plan_chat
from runtime.server.errors import error_frame, failure_of
from runtime.server.fields import AuditedFields
from runtime.server.schemas import ChatBody, CompletionBody
from runtime.server.state import Server, ServerDep
from runtime.server.streaming import sse

router = APIRouter(prefix="/v1")
log = logging.getLogger("flowlang.server")


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


@router.post("/completions")
async def completions(body: CompletionBody, request: Request, server: ServerDep):
    """Text completion: n choices per prompt, optionally streamed, with logprobs."""
    _log_ignored("/v1/completions", body)
    logprobs = body.logprobs is not None
    namespace = server.namespace(request, body.namespace)
    requests, echoes = [], []
    for prompt in body.prompts():
        echo = _prompt_text(server, prompt) if body.echo else ""
        for i in range(body.n):
            echoes.append(echo)
            params = body.sampling(body.max_tokens or 16, i, logprobs, body.logprobs or 0)
            requests.append(
                GenerateRequest(
                    sampling=params,
                    namespace=namespace,
                    **({"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}),
                )
            )
    handles = await server.submit(requests, server.tenant(request))
    created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
    if body.stream:
        chunks = _completion_stream(server, handles, cid, created, echoes)
        return sse(server.engine, handles, chunks)
    results = _checked(await server.wait(request, handles))
    choices = [
        {
            "index": i,
            "text": echoes[i] + r.text,
            "finish_reason": finish_reason(r),
            "logprobs": _completion_logprobs(server, r) if logprobs else None,
        }
        for i, r in enumerate(results)
    ]
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": server.engine.config.model,
        "choices": choices,
        "usage": _usage(results),
    }


@router.post("/chat/completions")
async def chat(body: ChatBody, request: Request, server: ServerDep):
    """Chat completion through the model's chat template: tools and tool calls, reasoning
    split off, response_format schemas."""
    _log_ignored("/v1/chat/completions", body, body.messages)
    plan = await asyncio.to_thread(plan_chat, server.engine, body)  # templates can be slow
    top = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens or body.max_tokens
    namespace = server.namespace(request, body.namespace)
    requests = [
        GenerateRequest(
            input_ids=plan.prompt_ids,
            constraint=plan.constraint,
            namespace=namespace,
            sampling=_chat_sampling(body, plan, max_tokens, i, top),
        )
        for i in range(body.n)
    ]
    handles = await server.submit(requests, server.tenant(request))
    created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        chunks = _chat_stream(server, plan, handles, cid, created, body.include_usage)
        return sse(server.engine, handles, chunks)
    results = _checked(await server.wait(request, handles))
    choices = []
    for i, r in enumerate(results):
        message, finish = chat_message(plan, r)
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": _chat_logprobs(server, r) if body.logprobs else None,
                "finish_reason": finish,
            }
        )
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": server.engine.config.model,
        "choices": choices,
        "usage": _usage(results),
    }


def _chat_sampling(
    body: ChatBody, plan: ChatPlan, max_tokens: int | None, index: int, top: int
) -> SamplingParams:
    params = body.sampling(max_tokens, index, body.logprobs, top)
    if plan.keep_special_tokens:  # the calls' marker must stay in the text the parser reads
        params = params.model_copy(update={"skip_special_tokens": False})
    return params


def _log_ignored(route: str, body: AuditedFields, parts: Sequence[AuditedFields] = ()) -> None:
    """Say loudly which fields a request set that have no effect here."""
    ignored = body.fields_of_kind("ignored")
    ignored += sorted({f"messages.{n}" for m in parts for n in m.fields_of_kind("ignored")})
    if body.stream_options is not None:
        ignored += [f"stream_options.{n}" for n in body.stream_options.fields_of_kind("ignored")]
    if ignored:
        log.warning("%s fields with no effect here: %s", route, ignored, extra={"ignored": ignored})


def _prompt_text(server: Server, prompt: str | list[int]) -> str:
    """What `echo` puts before a choice: the prompt's text (token prompts decoded)."""
    if isinstance(prompt, str):
        return prompt
    server.engine.intake.validate_ids(prompt, "token id")
    return server.engine.tokenizer.decode(prompt)


def _checked(results: list[GenerateResult]) -> list[GenerateResult]:
    for result in results:
        failure = failure_of(result)
        if failure is not None:
            raise failure
    return results


def _usage(results: list[GenerateResult]) -> dict:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)},
    }


def _token_text(server: Server, token_id: int) -> str:
    return server.engine.tokenizer.decode([token_id])


def _completion_logprobs(server: Server, result: GenerateResult) -> dict:
    tokens, offsets, offset = [], [], 0
    for lp in result.logprobs or []:
        text = _token_text(server, lp.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in result.logprobs or []],
        "top_logprobs": [
            {_token_text(server, t): v for t, v in (lp.top or [])} for lp in result.logprobs or []
        ],
        "text_offset": offsets,
    }


def _chat_logprobs(server: Server, result: GenerateResult) -> dict:
    content = []
    for lp in result.logprobs or []:
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


async def _completion_stream(
    server: Server, handles: list[RequestHandle], cid: str, created: int, echoes: list[str]
) -> AsyncGenerator[str, None]:
    model = server.engine.config.model

    def chunk(index: int, text: str, finish: str | None) -> str:
        return json.dumps(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
                ],
            }
        )

    for index, handle in enumerate(handles):
        if echoes[index]:
            yield chunk(index, echoes[index], None)
        async for delta in handle.astream():
            yield chunk(index, delta, None)
        result = await handle.aresult()
        failure = failure_of(result)
        if failure is not None:  # an error frame, never a finish_reason that says it ended well
            yield error_frame(failure)
            return
        yield chunk(index, "", finish_reason(result))


async def _chat_stream(
    server: Server,
    plan: ChatPlan,
    handles: list[RequestHandle],
    cid: str,
    created: int,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    model = server.engine.config.model

    def chunk(index: int, delta: dict, finish: str | None) -> str:
        return json.dumps(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
                ],
            }
        )

    results = []
    for index, handle in enumerate(handles):
        deltas = ChatDeltas(plan)
        yield chunk(index, {"role": "assistant", "content": ""}, None)
        async for text in handle.astream():
            for delta in deltas.feed(text):
                yield chunk(index, delta, None)
        result = await handle.aresult()
        failure = failure_of(result)
        if failure is not None:
            yield error_frame(failure)
            return
        for delta in deltas.finish():
            yield chunk(index, delta, None)
        results.append(result)
        yield chunk(index, {}, finish_reason(result, deltas.num_calls > 0))
    if include_usage:
        yield json.dumps(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(results),
            }
        )
