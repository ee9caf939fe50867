"""The logits at the end of recently computed prompts, for requests that repeat a whole prompt.

A request whose prompt is entirely in the radix tree still computes its last prompt token, for
the logits its first output token is sampled from (SGLang and vLLM do the same). Fork siblings
that reach the same `gen`, `n > 1` samples and retries repeat a whole prompt; keeping that row
(one fp32 vocabulary row per prompt, a few hundred kB) lets them prefill nothing. A row is used
only while the tree holds the whole prompt's KV, so the request decodes on from cached KV exactly
as if it had computed it; rows are keyed by namespace and prompt, so none crosses namespaces.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from runtime.scheduler.request import Req, ReqKind


class PromptLogits:
    """Up to `max_rows` prompt-end logit rows, least recently used dropped first."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key -> (vocab,) fp32
        self.num_stored = 0
        self.num_reused = 0

    @staticmethod
    def eligible(req: Req) -> bool:
        """A generate request that wants nothing but the next-token row after its prompt."""
        return (
            req.kind is ReqKind.GENERATE
            and req.logprobs.start is None
            and not req.logprobs.keep_last
        )

    @staticmethod
    def keeps_row(req: Req) -> bool:
        """Whether the row after `req`'s prompt is kept: an eligible request's, or a pin's
        (a fork's branches often `gen` right after the prefix their fork pinned)."""
        return req.kind is ReqKind.PIN or PromptLogits.eligible(req)

    def offer(self, req: Req) -> bool:
        """Give `req` the row for its whole prompt if one is kept (then it may match its whole
        prompt in the cache: Req.match_limit); True if it got one."""
        if not self._rows or req.reuse.logits is not None or req.gen.output_ids:
            return False  # (a request retracted after sampling computes its own end)
        if not self.eligible(req):
            return False
        row = self._rows.get(_key(req))
        if row is None:
            return False
        self._rows.move_to_end(_key(req))
        req.reuse.logits = row
        req.queue.match_pos = None  # its match limit grew: match again
        return True

    def used(self, req: Req) -> None:
        """`req` sampled its first token from its reused row."""
        req.reuse.logits = None
        self.num_reused += 1

    def keep(self, req: Req, row: torch.Tensor) -> None:
        """`row` (vocab,): the next-token logits after `req`'s whole prompt (or pinned
        prefix), just computed."""
        if self.max_rows == 0 or not self.keeps_row(req):
            return
        key = _key(req)
        self._rows[key] = row.detach().clone()
        self._rows.move_to_end(key)
        self.num_stored += 1
        while len(self._rows) > self.max_rows:
            self._rows.popitem(last=False)

    def stats(self) -> dict[str, float]:
        return {
            "prompt_logits_rows": len(self._rows),
            "prompt_logits_reused_total": self.num_reused,
        }

    def check_integrity(self) -> None:
        assert len(self._rows) <= self.max_rows, (len(self._rows), self.max_rows)
        for row in self._rows.values():
            assert row.dim() == 1 and row.dtype == torch.float32, (row.shape, row.dtype)


def _key(req: Req) -> bytes:
    """A digest of (namespace, prompt ids), computed once per request."""
    if req.reuse.prompt_key is None:
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr(req.namespace).encode())
        digest.update(b"\0")
        digest.update(array("q", req.prompt_ids).tobytes())
        req.reuse.prompt_key = digest.digest()
    return req.reuse.prompt_key
