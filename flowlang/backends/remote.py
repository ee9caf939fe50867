"""RemoteBackend: programs run against `flowlang serve` over HTTP, with the same protocol types.

Token ids travel both ways (token stability across turns); tokenization is asked of the server
once per distinct text and cached here; pins are leases renewed in the background while held.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator

import httpx

from flowlang.backends.base import Backend
from flowlang.chat import CHATML, ChatFormat
from runtime.protocol import GenerateRequest, GenerateResult, GraphHints, ScoreRequest, ScoreResult
from runtime.telemetry import tracer


class RemoteError(RuntimeError):
    """The server refused or failed a call; the message is the server's."""


class RemoteHandle:
    """Streams one generation; iterating yields text deltas, `result()` the final result."""

    def __init__(self, backend: RemoteBackend, request: GenerateRequest) -> None:
        self._backend = backend
        self._request = request
        self._result: GenerateResult | None = None
        # the caller's trace context now (W3C traceparent): the server's spans join its trace
        self._trace_headers = tracer().carrier()

    def __iter__(self) -> Iterator[str]:
        if self._result is not None:
            return
        body = self._request.model_dump(mode="json")
        client, headers = self._backend.client, self._trace_headers
        with client.stream("POST", "/v1/flowlang/generate", json=body, headers=headers) as response:
            _check(response, read=True)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "delta" in event:
                    yield event["delta"]
                else:
                    self._result = GenerateResult.model_validate(event["result"])

    def result(self) -> GenerateResult:
        for _ in self:
            pass
        if self._result is None:
            raise RemoteError("the stream ended without a result")
        return self._result


class RemotePin:
    def __init__(self, backend: RemoteBackend, pin_id: str, info: dict) -> None:
        self.backend = backend
        self.pin_id = pin_id
        self.info = info
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.backend._drop_pin(self)


class RemoteBackend(Backend):
    """`RemoteBackend("http://127.0.0.1:30000", api_key=...)`."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float = 600.0,
        lease_seconds: float = 30.0,
        tokenize_cache: int = 4096,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.client = httpx.Client(
            base_url=url.rstrip("/"), headers=headers, timeout=timeout, limits=limits
        )
        self.lease_seconds = lease_seconds
        info = _check(self.client.get("/v1/flowlang/info")).json()
        self.info = info
        self.chat_format = ChatFormat(
            info.get("chat_template") or CHATML,
            info.get("bos_token") or "",
            info.get("eos_token") or "",
        )
        self.tool_format = info.get("tool_format") or "hermes"
        self.reasoning_format = info.get("reasoning_format")
        self._tokens: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()
        self._tokenize_cache = tokenize_cache
        self._lock = threading.Lock()
        self._pins: dict[str, RemotePin] = {}
        self._stop = threading.Event()
        self._renewer = threading.Thread(
            target=self._renew_loop, daemon=True, name="flowlang-pin-renewer"
        )
        self._renewer.start()

    @property
    def model_name(self) -> str | None:
        """The model the server runs (its /v1/flowlang/info)."""
        return self.info.get("model")

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        key = (text, add_special_tokens)
        with self._lock:
            if key in self._tokens:
                self._tokens.move_to_end(key)
                return list(self._tokens[key])
        ids = _check(
            self.client.post(
                "/v1/flowlang/tokenize",
                json={"text": text, "add_special_tokens": add_special_tokens},
            )
        ).json()["ids"]
        with self._lock:
            self._tokens[key] = ids
            if len(self._tokens) > self._tokenize_cache:
                self._tokens.popitem(last=False)
        return list(ids)

    def generate(self, request: GenerateRequest) -> RemoteHandle:
        return RemoteHandle(self, request)

    def score(self, request: ScoreRequest) -> ScoreResult:
        body, headers = request.model_dump(mode="json"), tracer().carrier()
        response = self.client.post("/v1/flowlang/score", json=body, headers=headers)
        return ScoreResult.model_validate(_check(response).json())

    def pin(
        self, prefix_ids: list[int], namespace: str | None = None, hints: GraphHints | None = None
    ) -> RemotePin:
        body = {
            "prefix_ids": list(prefix_ids),
            "namespace": namespace,
            "hints": (hints or GraphHints()).model_dump(),
            "lease_seconds": self.lease_seconds,
        }
        headers = tracer().carrier()
        info = _check(self.client.post("/v1/flowlang/pin", json=body, headers=headers)).json()
        pin = RemotePin(self, info["pin_id"], info)
        with self._lock:
            self._pins[pin.pin_id] = pin
        return pin

    def close(self) -> None:
        """Release held pins and the connection pool."""
        with self._lock:
            pins = list(self._pins.values())
        for pin in pins:
            pin.release()
        self._stop.set()
        self.client.close()

    def _drop_pin(self, pin: RemotePin) -> None:
        with self._lock:
            self._pins.pop(pin.pin_id, None)
        response = self.client.delete(f"/v1/flowlang/pin/{pin.pin_id}")
        if response.status_code not in (200, 404):  # 404: its lease had already run out
            _check(response)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_seconds / 3):
            with self._lock:
                pin_ids = list(self._pins)
            for pin_id in pin_ids:
                try:
                    self.client.post(f"/v1/flowlang/pin/{pin_id}/renew")
                except httpx.HTTPError:
                    pass  # the next round retries; the server's lease decides


def _check(response: httpx.Response, read: bool = False) -> httpx.Response:
    if response.status_code >= 400:
        if read:
            response.read()
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise RemoteError(f"HTTP {response.status_code}: {message}")
    return response
