"""`RuntimeEndpoint(url)`: SGLang's backend constructor, returning a flowlang backend.

Against `flowlang serve` it is our RemoteBackend (token ids, scores, pins that lock). Against
any other server that speaks SGLang's native API (SGLang's own included) it is an
`SGLangAPIBackend`: the same programs, sent as /generate requests only. What that API cannot
express is weaker there, never wrong: a pin only prefills (nothing locks it), a select is
scored with input logprobs, a gen's text arrives whole (`text_iter` does not trickle).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import httpx

from flowlang.backends.base import Backend
from flowlang.chat import CHATML, ChatFormat
from flowlang.sglang.expr import NotSupportedError
from runtime.protocol import (
    GenerateRequest,
    GenerateResult,
    GraphHints,
    ScoreRequest,
    ScoreResult,
    TokenLogprob,
)

API_KINDS = ("auto", "flowlang", "sglang")


def RuntimeEndpoint(  # noqa: N802 - SGLang's name
    base_url: str,
    api_key: str | None = None,
    verify: str | None = None,
    chat_template_name: str | None = None,
    api: str = "auto",
) -> Backend:
    """A backend for the server at `base_url`: flowlang's protocol when the server speaks it
    (`api="auto"`), else SGLang's native API; `api="sglang"` forces the latter. `verify` is
    accepted and ignored; `chat_template_name` may only be "chatml" (else the server's).

    >>> backend = RuntimeEndpoint("http://127.0.0.1:30000")  # doctest: +SKIP
    """
    if api not in API_KINDS:
        raise ValueError(f"api must be one of {API_KINDS}, got {api!r}")
    if chat_template_name not in (None, "chatml"):
        raise NotSupportedError(
            f"chat_template_name={chat_template_name!r}: flowlang uses the model's own chat "
            f"template (or 'chatml'); for another, pass SGLangAPIBackend(chat_template=...)"
        )
    if api == "auto":
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        probe = httpx.get(base_url.rstrip("/") + "/v1/flowlang/info", headers=headers, timeout=30)
        api = "flowlang" if probe.status_code == 200 else "sglang"
    if api == "flowlang":
        from flowlang.backends.remote import RemoteBackend

        backend: Backend = RemoteBackend(base_url, api_key=api_key)
    else:
        backend = SGLangAPIBackend(base_url, api_key=api_key)
    if chat_template_name == "chatml":
        backend.chat_format = ChatFormat(CHATML)
    return backend


class _Done:
    """A finished generation: iterating yields its whole text once."""

    def __init__(self, result: GenerateResult) -> None:
        self.result_value = result

    def __iter__(self):
        yield self.result_value.text

    def result(self) -> GenerateResult:
        return self.result_value


class _Prefilled:
    """SGLang's API has no pins: the prefix was prefilled, nothing holds it."""

    def release(self) -> None:
        """Nothing to release."""


class SGLangAPIBackend(Backend):
    """Programs over SGLang's native HTTP API only (/generate, /get_model_info, /tokenize).

    Tokens come from the server's /tokenize when it has one, else from `tokenizer` (anything
    with `encode(text, add_special_tokens=)`), else from the model's folder loaded here.
    `tool_format`/`reasoning_format` (runtime/constrain/): how the model writes tool calls and
    reasoning; default: read off the chat template. Constraints with tools or reasoning are
    sent as SGLang's `structural_tag` sampling parameter.

    >>> backend = SGLangAPIBackend("http://127.0.0.1:30000")  # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        timeout: float = 600.0,
        tool_format: str | None = None,
        reasoning_format: str | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
        self.model_info = self._post_or_get("GET", "/get_model_info")
        self.tokenizer = tokenizer
        if tokenizer is None and self.client.post("/tokenize", json={"prompt": "a"}).is_error:
            self.tokenizer = _local_tokenizer(self.model_info)
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        self.chat_format = ChatFormat(
            template or CHATML,
            getattr(self.tokenizer, "bos_token", None) or "",
            getattr(self.tokenizer, "eos_token", None) or "",
        )
        # SGLang's API does not say how the model writes calls and reasoning: read them off
        # the chat template, as `flowlang serve` does (or take them as given)
        from runtime.constrain.reasoning import detect_reasoning_format
        from runtime.constrain.tool_calls import detect_tool_format

        self.tool_format = tool_format or detect_tool_format(template)
        self.reasoning_format = reasoning_format or detect_reasoning_format(template)
        self._tokens: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        key = (text, add_special_tokens)
        with self._lock:
            if key in self._tokens:
                return list(self._tokens[key])
        if self.tokenizer is not None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        else:
            body = {"prompt": text, "add_special_tokens": add_special_tokens}
            ids = self._post_or_get("POST", "/tokenize", body)["tokens"]
        with self._lock:
            self._tokens[key] = ids
            if len(self._tokens) > 4096:
                self._tokens.popitem(last=False)
        return list(ids)

    def generate(self, request: GenerateRequest) -> _Done:
        params = request.sampling
        body: dict[str, Any] = {
            "input_ids": request.input_ids or self.tokenize(request.text or "", True),
            "sampling_params": _sglang_sampling(request),
            "return_logprob": params.logprobs,
            "top_logprobs_num": params.top_logprobs,
        }
        if params.prompt_logprobs:
            body["logprob_start_len"] = params.logprob_start_len or 1
        out = self._post_or_get("POST", "/generate", body)
        return _Done(self._result(request, out))

    def score(self, request: ScoreRequest) -> ScoreResult:
        prefix = request.prefix
        prefix_ids = prefix if isinstance(prefix, list) else self.tokenize(prefix, True)
        continuations = [
            c if isinstance(c, list) else self.tokenize(c) for c in request.continuations
        ]
        body = {
            "input_ids": [prefix_ids + c for c in continuations],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": len(prefix_ids),
        }
        outs = self._post_or_get("POST", "/generate", body)
        logprobs = [[entry[0] for entry in o["meta_info"]["input_token_logprobs"]] for o in outs]
        return ScoreResult(
            prefix_ids=prefix_ids, continuation_ids=continuations, token_logprobs=logprobs
        )

    def pin(
        self, prefix_ids: list[int], namespace: str | None = None, hints: GraphHints | None = None
    ) -> _Prefilled:
        body = {"input_ids": list(prefix_ids), "sampling_params": {"max_new_tokens": 0}}
        self._post_or_get("POST", "/generate", body)
        return _Prefilled()

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()

    def _result(self, request: GenerateRequest, out: dict[str, Any]) -> GenerateResult:
        meta = out["meta_info"]
        reason = meta.get("finish_reason") or {}
        output_ids = out.get("output_ids")
        logprobs = None
        if request.sampling.logprobs:
            entries = meta["output_token_logprobs"]
            tops = meta.get("output_top_logprobs") or [None] * len(entries)
            logprobs = [
                TokenLogprob(token_id=token, logprob=lp, top=_pairs(top))
                for (lp, token, *_), top in zip(entries, tops, strict=True)
            ]
        return GenerateResult(
            rid=request.rid,
            text=out["text"],
            output_ids=output_ids if output_ids is not None else self.tokenize(out["text"]),
            finish_reason=reason.get("type"),
            matched_stop=reason.get("matched"),
            prompt_tokens=meta["prompt_tokens"],
            cached_tokens=meta.get("cached_tokens", 0),
            completion_tokens=meta["completion_tokens"],
            logprobs=logprobs,
            **(_prompt_logprobs(request, meta) if request.sampling.prompt_logprobs else {}),
        )

    def _post_or_get(self, method: str, path: str, body: Any = None) -> Any:
        response = self.client.request(method, path, json=body)
        if response.is_error:
            raise RuntimeError(f"{path}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json()


def _sglang_sampling(request: GenerateRequest) -> dict[str, Any]:
    """Our SamplingParams and constraint as SGLang's sampling_params."""
    p = request.sampling
    params: dict[str, Any] = {
        "max_new_tokens": p.max_new_tokens,
        "min_new_tokens": p.min_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k or -1,
        "min_p": p.min_p,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
        "repetition_penalty": p.repetition_penalty,
        "stop": p.stop,
        "stop_token_ids": p.stop_token_ids,
        "stop_regex": p.stop_regex,
        "ignore_eos": p.ignore_eos,
        "skip_special_tokens": p.skip_special_tokens,
        "no_stop_trim": p.include_stop_str_in_output,
    }
    if p.seed is not None:
        params["sampling_seed"] = p.seed
    c = request.constraint
    if c is not None:
        if c.json_schema is not None:
            params["json_schema"] = json.dumps(c.json_schema)
        elif c.grammar is not None:
            params["ebnf"] = c.grammar
        elif c.structural_tag is not None:  # tool calls, reasoning: as SGLang takes it, a text
            params["structural_tag"] = json.dumps(c.structural_tag)
        else:  # SGLang has no choices constraint: the same language as a regex
            params["regex"] = c.regex or "(" + "|".join(map(_regex_escape, c.choices)) + ")"
    return params


def _pairs(top: list | None) -> list[tuple[int, float]] | None:
    """SGLang's [logprob, id, text] entries as our (id, logprob) pairs."""
    return None if top is None else [(token, lp) for lp, token, *_ in top]


def _prompt_logprobs(request: GenerateRequest, meta: dict[str, Any]) -> dict[str, Any]:
    """SGLang's input logprobs (positions from the start asked) as ours (by position)."""
    ids = list(request.input_ids or [])
    entries = meta.get("input_token_logprobs") or []
    start = len(ids) - len(entries)
    logprobs: list[float | None] = [None] * start + [entry[0] for entry in entries]
    out: dict[str, Any] = {"prompt_logprobs": logprobs, "prompt_ids": ids}
    if "input_top_logprobs" in meta:
        out["prompt_top_logprobs"] = [None] * start + [
            _pairs(top) for top in meta["input_top_logprobs"]
        ]
    return out


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in r".^$*+?{}[]\|()" else ch for ch in text)


def _local_tokenizer(model_info: dict[str, Any]) -> Any:
    """The served model's tokenizer loaded here: from its folder when it is on this machine,
    through our registry when the server names a registry model, else from the hub."""
    import os

    from transformers import AutoTokenizer

    names = [model_info.get(k) for k in ("tokenizer_path", "served_model_name", "model_path")]
    names = [n for n in names if n]
    for name in names:
        if os.path.exists(name):
            return AutoTokenizer.from_pretrained(name)
    from runtime.model.registry import MODELS, resolve_model

    for name in names:
        if name in MODELS:
            return AutoTokenizer.from_pretrained(str(resolve_model(name)))
    return AutoTokenizer.from_pretrained(names[0])
