"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request

from runtime.engine import InvalidRequestError, RequestHandle
from runtime.protocol import Constraint, GenerateRequest, GenerateResult
from runtime.server.common import Server, sse
from runtime.server.schemas import ChatBody, CompletionBody


def register(app: FastAPI, server: Server) -> None:
    engine = server.engine
    model_name = engine.config.model

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(server.started),
                    "owned_by": "flowlang",
                    "max_model_len": engine.arch.max_context_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
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
        handles = [server.submit(r) for r in requests]
        created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return sse(_completion_stream(server, handles, cid, created, body))
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
            "model": model_name,
            "choices": choices,
            "usage": _usage(results),
        }

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = list(
                engine.tokenizer.apply_chat_template(
                    messages,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            )
        except Exception as err:  # noqa: BLE001 - jinja raises many kinds; all are bad input
            raise InvalidRequestError(f"the chat template rejects these messages: {err}") from err
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
        handles = [server.submit(r) for r in requests]
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return sse(_chat_stream(server, handles, cid, created, include_usage))
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
            "model": model_name,
            "choices": choices,
            "usage": _usage(results),
        }


def _abort_unfinished(server: Server, handles: list[RequestHandle]) -> None:
    """A stream that ends early (the client went away) aborts what is still running."""
    for handle in handles:
        if not handle.future.done():
            server.engine.abort(handle.rid)


def _checked(results: list[GenerateResult]) -> list[GenerateResult]:
    for result in results:
        if result.finish_reason == "error":
            raise InvalidRequestError(result.error or "generation failed")
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
    server: Server, handles: list[RequestHandle], cid: str, created: int, body: CompletionBody
) -> AsyncIterator[str]:
    model = server.engine.config.model
    try:
        for index, handle in enumerate(handles):
            async for delta in handle.astream():
                yield json.dumps(
                    {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [
                            {"index": index, "text": delta, "finish_reason": None, "logprobs": None}
                        ],
                    }
                )
            result = await handle.aresult()
            yield json.dumps(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": index,
                            "text": "",
                            "logprobs": None,
                            "finish_reason": _reason(result),
                        }
                    ],
                }
            )
    finally:
        _abort_unfinished(server, handles)


async def _chat_stream(
    server: Server, handles: list[RequestHandle], cid: str, created: int, include_usage: bool
) -> AsyncIterator[str]:
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

    try:
        results = []
        for index, handle in enumerate(handles):
            yield chunk(index, {"role": "assistant", "content": ""}, None)
            async for delta in handle.astream():
                yield chunk(index, {"content": delta}, None)
            result = await handle.aresult()
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
    finally:
        _abort_unfinished(server, handles)
