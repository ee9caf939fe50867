"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request

from runtime.errors import InvalidRequestError
from runtime.handles import RequestHandle
from runtime.intake import check_unicode
from runtime.protocol import Constraint, GenerateRequest, GenerateResult
from runtime.server.errors import error_frame, failure_of
from runtime.server.schemas import ChatBody, CompletionBody
from runtime.server.state import Server, ServerDep
from runtime.server.streaming import sse

router = APIRouter(prefix="/v1")


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
    logprobs = body.logprobs is not None
    namespace = server.namespace(request, body.namespace)
    requests = []
    for prompt in body.prompts():
        for i in range(body.n):
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
        chunks = _completion_stream(server, handles, cid, created)
        return sse(server.engine, handles, chunks)
    results = _checked(await server.wait(request, handles))
    choices = [
        {
            "index": i,
            "text": r.text,
            "finish_reason": _reason(r),
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
    """Chat completion through the model's chat template, with response_format schemas."""
    prompt = await asyncio.to_thread(_chat_prompt, server, body)  # templates can be slow
    constraint: Constraint | None = body.constraint()
    top = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens or body.max_tokens
    namespace = server.namespace(request, body.namespace)
    requests = [
        GenerateRequest(
            input_ids=prompt,
            constraint=constraint,
            namespace=namespace,
            sampling=body.sampling(max_tokens, i, body.logprobs, top),
        )
        for i in range(body.n)
    ]
    handles = await server.submit(requests, server.tenant(request))
    created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        chunks = _chat_stream(server, handles, cid, created, include_usage)
        return sse(server.engine, handles, chunks)
    results = _checked(await server.wait(request, handles))
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": r.text},
            "logprobs": _chat_logprobs(server, r) if body.logprobs else None,
            "finish_reason": _reason(r),
        }
        for i, r in enumerate(results)
    ]
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": server.engine.config.model,
        "choices": choices,
        "usage": _usage(results),
    }


def _chat_prompt(server: Server, body: ChatBody) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    for message in messages:
        check_unicode(message["content"])
    try:
        return list(
            server.engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
    except Exception as err:  # noqa: BLE001 - jinja raises many kinds; all are bad input
        raise InvalidRequestError(f"the chat template rejects these messages: {err}") from err


def _checked(results: list[GenerateResult]) -> list[GenerateResult]:
    for result in results:
        failure = failure_of(result)
        if failure is not None:
            raise failure
    return results


def _reason(result: GenerateResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


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
    server: Server, handles: list[RequestHandle], cid: str, created: int
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
        async for delta in handle.astream():
            yield chunk(index, delta, None)
        result = await handle.aresult()
        failure = failure_of(result)
        if failure is not None:  # an error frame, never a finish_reason that says it ended well
            yield error_frame(failure)
            return
        yield chunk(index, "", _reason(result))


async def _chat_stream(
    server: Server, handles: list[RequestHandle], cid: str, created: int, include_usage: bool
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
        yield chunk(index, {"role": "assistant", "content": ""}, None)
        async for delta in handle.astream():
            yield chunk(index, {"content": delta}, None)
        result = await handle.aresult()
        failure = failure_of(result)
        if failure is not None:
            yield error_frame(failure)
            return
        results.append(result)
        yield chunk(index, {}, _reason(result))
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
