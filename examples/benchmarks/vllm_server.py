"""vLLM's OpenAI server as a peer over HTTP: `vllm serve` (its api_server module) from its own venv,
its compute bound to both cores (VLLM_CPU_OMP_THREADS_BIND=0-1, what its CPU docs recommend),
prefix caching on, driven as flowlang_server.py drives `flowlang serve`: a `/v1/completions`
request per token-id prompt, all at once, greedy, the output's token ids returned
(`return_token_ids`). The prompt tokens it computed are its `/metrics` counters' difference:
prompt tokens less those read from its cache (`vllm:prompt_tokens_total` -
`vllm:prompt_tokens_cached_total`), what the in-process row reads.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile

import httpx
from flowlang_server import ServedPeer
from serve_bench import free_port, start


def counter(name: str, text: str) -> float:
    """A Prometheus counter's value summed over its label sets (0 if absent)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


class VllmServer(ServedPeer):
    """vLLM's OpenAI server on MODEL in DTYPE from the venv of `python`, on a free port."""

    def __init__(self, python: str, model: str, dtype: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.model = model
        # (its `vllm` command looks up a distribution named vllm; the CPU build's is vllm-cpu)
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--dtype", dtype, "--port", str(port), "--enable-prefix-caching",
               "--max-model-len", "8192", "--seed", "0"]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
        self.log = tempfile.NamedTemporaryFile("w", prefix="vllm-serve-", suffix=".log")
        self.proc = start(cmd, self.url, env, timeout=900, log=self.log)
        self.client = httpx.Client(base_url=self.url, timeout=3600)

    def prefilled(self) -> int:
        """Prompt tokens the server has computed so far (not read from its prefix cache)."""
        text = self.client.get("/metrics").text
        total = counter("vllm:prompt_tokens_total", text)
        return int(total - counter("vllm:prompt_tokens_cached_total", text))

    def one(self, prompt: list[int], n: int) -> list[int]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                "return_token_ids": True}  # fmt: skip
        answer = self.client.post("/v1/completions", json=body)
        answer.raise_for_status()
        return answer.json()["choices"][0]["token_ids"]

    def close(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        self.log.close()
