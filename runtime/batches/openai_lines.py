"""The OpenAI routes as batch line routes: each line goes through the server's own route
in-process (ASGI, no socket), so a batch line is checked, limited and answered exactly as the
same request over HTTP would be; its prompt (for the shared pins) is what that route renders."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
from pydantic import ValidationError

from runtime.batches.lines import BatchLine
from runtime.engine_api import EngineAPI
from runtime.errors import InvalidRequestError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


class AppRoute:
    """Lines of `url` posted to `app` with `headers` (the batch owner's API key, so the line
    runs as that tenant); `prompt` from `engine` like the route renders it."""

    def __init__(
        self,
        app: Any,
        url: str,
        engine: EngineAPI,
        headers: Mapping[str, str] | None = None,
        namespace: str | None = None,
    ) -> None:
        self.app = app
        self.url = url
        self.engine = engine
        self.namespace = namespace  # the tenant's cache salt (Server.namespace)
        self.headers = dict(headers or {})
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://batch", timeout=None
        )

    def for_tenant(self, headers: Mapping[str, str], namespace: str | None) -> AppRoute:
        """This route for one tenant's batch: its key sent with each line, its cache salt."""
        return AppRoute(self.app, self.url, self.engine, headers, namespace)

    async def run(self, line: BatchLine) -> tuple[int, Any]:
        response = await self.client.post(self.url, json=line.body, headers=self.headers)
        try:
            return response.status_code, response.json()
        except ValueError:  # a route answering text (should not happen): kept as text
            return response.status_code, {"error": {"message": response.text}}

    def prompt(self, body: Mapping[str, Any]) -> tuple[str | None, list[int]] | None:
        from runtime.server.chat_turn import plan_chat
        from runtime.server.schemas import ChatBody, CompletionBody

        try:
            if self.url == CHAT_URL:
                chat = ChatBody.model_validate(body)
                return self._salted(chat.cache_namespace()), plan_chat(self.engine, chat).prompt_ids
            completion = CompletionBody.model_validate(body)
            prompts = completion.prompts()
            if len(prompts) != 1:  # several prompts: each is its own request, none pinned
                return None
            prompt = prompts[0]
            special = completion.add_special_tokens
            ids = self.engine.tokens(prompt, special) if isinstance(prompt, str) else prompt
            return self._salted(completion.cache_namespace()), list(ids)
        except (ValidationError, InvalidRequestError, ValueError):
            return None  # the route answers it with its 400 when the line runs

    def _salted(self, requested: str | None) -> str | None:
        parts = [p for p in (self.namespace, requested) if p]
        return "/".join(parts) or None

    async def aclose(self) -> None:
        await self.client.aclose()


def openai_routes(
    app: Any,
    engine: EngineAPI,
    headers: Mapping[str, str] | None = None,
    namespace: str | None = None,
) -> dict[str, AppRoute]:
    return {
        url: AppRoute(app, url, engine, headers, namespace) for url in (CHAT_URL, COMPLETIONS_URL)
    }
