"""`flowlang serve` as a peer over HTTP: the server in a subprocess on both cores, driven the way
its clients drive it, so that its figures in a peer table pay what llama-server's pay (HTTP,
JSON, a request per user, the server's own event loop and tokenizer threads).

`FlowlangServer.complete(prompts, n)` sends each token-id prompt as its own SGLang-native
`/generate` request (all at once, greedy), and reads the prompt tokens the server computed
from its `/metrics` (`flowlang_prefill_tokens_total`), the counter the in-process rows read.
"""

from __future__ import annotations

import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
from serve_bench import free_port, start

PREFILL_METRIC = re.compile(r"^flowlang_prefill_tokens_total (\S+)$", re.MULTILINE)


class ServedPeer:
    """A server driven as its clients drive it: each prompt its own request, all sent together.
    A peer says how one request goes (`one`) and what its server has computed (`prefilled`)."""

    def prefilled(self) -> int:
        """Prompt tokens the server has computed so far."""
        raise NotImplementedError

    def one(self, prompt: list[int], n: int) -> list[int]:
        """Up to `n` greedy tokens after `prompt`, as one request."""
        raise NotImplementedError

    def complete(self, prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
        """Greedy completions of token-id prompts, each its own request, sent together: (output
        ids each, prompt tokens computed in all)."""
        before = self.prefilled()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(lambda prompt: self.one(prompt, n), prompts))
        return outputs, self.prefilled() - before


class FlowlangServer(ServedPeer):
    """`flowlang serve --model MODEL --dtype DTYPE --max-kv-tokens KV_TOKENS` on a free port."""

    def __init__(self, model: str, dtype: str, kv_tokens: int) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "flowlang", "serve", "--model", model, "--dtype", dtype,
               "--max-kv-tokens", str(kv_tokens), "--port", str(port)]  # fmt: skip
        self.proc = start(cmd, self.url)
        self.client = httpx.Client(base_url=self.url, timeout=3600)

    def prefilled(self) -> int:
        text = self.client.get("/metrics").text
        return int(float(PREFILL_METRIC.search(text).group(1)))

    def one(self, prompt: list[int], n: int) -> list[int]:
        body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": n}}
        answer = self.client.post("/generate", json=body)
        answer.raise_for_status()
        return answer.json()["output_ids"]

    def close(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
