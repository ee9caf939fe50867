"""RequestIntake: protocol requests in, scheduler requests out (tokenized, validated, compiled).

Runs on the callers' threads, so a bad request fails at submit with a message that names the
problem, before the loop thread ever sees it.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch

from runtime.config import EngineConfig
from runtime.constrain.compile_queue import CompileQueue
from runtime.errors import InvalidRequestError
from runtime.generation import GenerationState
from runtime.model.arch import ModelArch
from runtime.protocol import Constraint, GenerateRequest, GraphHints, SamplingParams
from runtime.scheduler.request import Req, ReqKind

MAX_TENANTS_REMEMBERED = 4096  # request ids compiled ahead, not yet submitted: whose they are


class RequestIntake:
    """Builds `Req`s for one engine: its tokenizer, model limits, pool size and grammars."""

    def __init__(
        self, config: EngineConfig, arch: ModelArch, tokenizer: Any, num_slots: int
    ) -> None:
        self.arch = arch
        self.tokenizer = tokenizer
        self.num_slots = num_slots
        self._rng = torch.Generator().manual_seed(config.seed)  # for requests with no seed
        self._arrivals = itertools.count()
        self._grammars = None
        self._grammar_lock = threading.Lock()
        self.compile_queue = CompileQueue()
        # rid -> tenant, from compile_ahead until the request's submit: whose grammar cache
        self._tenant_of: OrderedDict[str, str] = OrderedDict()

    # ------------------------------------------------------------------ requests
    def generate_req(self, request: GenerateRequest) -> Req:
        """A generate (or, with max_new_tokens=0, prefill-only) request."""
        params = request.sampling
        ids = (
            list(request.input_ids)
            if request.input_ids is not None
            else self.tokens(request.text, special=True)
        )
        self.validate_prompt(ids, params.max_new_tokens)
        self.validate_ids(params.stop_token_ids, "stop token id")
        self.validate_ids(list(params.logit_bias), "logit_bias token id")
        if (params.stop or params.stop_regex) and self.tokenizer is None:
            raise InvalidRequestError(
                "stop and stop_regex match the text, and this model has no tokenizer: "
                "use stop_token_ids"
            )
        kind = ReqKind.GENERATE if params.max_new_tokens else ReqKind.PREFILL
        logprob_start = (params.logprob_start_len or 1) if params.prompt_logprobs else None
        return self._req(
            request.rid,
            ids,
            params,
            kind,
            request.namespace,
            request.hints,
            self._constraint_state(request),
            logprob_start=logprob_start,
            deadline=time.monotonic() + request.timeout_s if request.timeout_s else None,
        )

    def pin_req(
        self,
        pin_id: str,
        ids: list[int],
        namespace: str | None,
        hints: GraphHints | None,
        keep_last_logprobs: bool,
    ) -> Req:
        """Prefill `ids` (what is not cached) and keep them locked until unpinned."""
        self.validate_prompt(ids, 0)
        params = SamplingParams(max_new_tokens=0)
        return self._req(
            pin_id,
            ids,
            params,
            ReqKind.PIN,
            namespace,
            hints or GraphHints(),
            None,
            keep_last_logprobs=keep_last_logprobs,
        )

    def score_req(
        self,
        rid: str,
        ids: list[int],
        namespace: str | None,
        hints: GraphHints,
        logprob_start: int,
    ) -> Req:
        """Prefill-only: prompt logprobs from `logprob_start` and the last position's row."""
        params = SamplingParams(max_new_tokens=0)
        return self._req(
            rid,
            ids,
            params,
            ReqKind.PREFILL,
            namespace,
            hints,
            None,
            logprob_start=logprob_start,
            keep_last_logprobs=True,
        )

    def _req(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        kind: ReqKind,
        namespace: str | None,
        hints: GraphHints,
        constraint: Any,
        **kwargs: Any,
    ) -> Req:
        gen = GenerationState(
            params,
            ids,
            self.tokenizer,
            self.arch.eos_token_ids,
            self.arch.vocab_size,
            constraint=constraint,
            default_generator=self._rng,
        )
        return Req(rid, ids, gen, kind, namespace, hints, next(self._arrivals), **kwargs)

    # ------------------------------------------------------------------ checks
    def tokens(self, text_or_ids: str | list[int], special: bool) -> list[int]:
        """Token ids of a text (or the ids themselves)."""
        if not isinstance(text_or_ids, str):
            return list(text_or_ids)
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send input_ids, not text")
        check_unicode(text_or_ids)
        return list(self.tokenizer.encode(text_or_ids, add_special_tokens=special))

    def validate_prompt(self, ids: list[int], max_new_tokens: int) -> None:
        """Refuse prompts that are empty, out of vocabulary, or can never fit."""
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        self.validate_ids(ids, "token id")
        total = len(ids) + max_new_tokens
        context = self.arch.max_context_len
        if total > context:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens} exceeds the "
                f"model's context of {context} tokens"
            )
        if total > self.num_slots:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens} can never fit "
                f"in the KV pool of {self.num_slots} slots"
            )

    def validate_ids(self, ids: list[int], what: str) -> None:
        """Every id must name a token of the vocabulary (a bad one would fail the forward)."""
        vocab = self.arch.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"{what} {bad} is outside the vocabulary (0..{vocab - 1})")

    # ------------------------------------------------------------------ grammars
    @property
    def grammars(self) -> Any:
        """The grammar cache (xgrammar), made on first use."""
        with self._grammar_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("constrained generation needs a tokenizer")
                from runtime.constrain.grammar import GrammarCache

                self._grammars = GrammarCache(
                    self.tokenizer, self.arch.vocab_size, self.arch.eos_token_ids
                )
            return self._grammars

    def compile_ahead(self, requests: list[GenerateRequest], tenant: str) -> list[Future]:
        """Compile the requests' new constraints (each distinct one once) on the compile queue,
        before they are submitted: Futures that fail with InvalidRequestError for a bad one.
        Raises CompileQueueFullError when `tenant` has its limit queued. Each tenant's grammars
        are cached apart (grammar.py); the requests' submit then looks in `tenant`'s cache."""
        from runtime.constrain.grammar import InvalidConstraintError, check_nesting, constraint_key

        futures: dict[str, Future] = {}
        for request in requests:
            constraint = request.constraint
            if constraint is None:
                continue
            try:
                check_nesting(constraint)  # before anything recurses through it
            except InvalidConstraintError as err:
                raise InvalidRequestError(str(err)) from err
            key = constraint_key(constraint)  # the n samples of a prompt share one
            self._remember_tenant(request.rid, tenant)
            grammars = self._grammars
            if key in futures or (grammars is not None and grammars.is_compiled(key, tenant)):
                continue
            futures[key] = self.compile_queue.submit(
                tenant, partial(self._compiled, constraint, tenant=tenant)
            )
        return list(futures.values())

    def _remember_tenant(self, rid: str, tenant: str) -> None:
        """`rid`'s submit compiles (finds) its grammar in `tenant`'s cache; the oldest go past
        MAX_TENANTS_REMEMBERED (requests compiled ahead but never submitted)."""
        with self._grammar_lock:
            self._tenant_of[rid] = tenant
            self._tenant_of.move_to_end(rid)
            while len(self._tenant_of) > MAX_TENANTS_REMEMBERED:
                self._tenant_of.popitem(last=False)

    def _constraint_state(self, request: GenerateRequest) -> Any:
        """Compile the request's constraint now (unless compile_ahead did), so a bad one fails
        at submit."""
        if request.constraint is None:
            return None
        with self._grammar_lock:
            tenant = self._tenant_of.pop(request.rid, None)  # None: in process, no server
        return self.grammars.new_state(self._compiled(request.constraint, tenant=tenant))

    def _compiled(self, constraint: Constraint, tenant: str | None = None) -> Any:
        """`constraint` compiled (from `tenant`'s cache if it is there), or
        InvalidRequestError."""
        from runtime.constrain.grammar import InvalidConstraintError, check_nesting

        try:
            check_nesting(constraint)
            check_unicode(json.dumps(constraint.model_dump(), ensure_ascii=False))
            return self.grammars.compile(constraint, tenant)
        except InvalidConstraintError as err:
            raise InvalidRequestError(str(err)) from err


def check_unicode(text: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate, which JSON can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(
            f"the text is not valid Unicode: {err.reason} at character {err.start}"
        ) from err
