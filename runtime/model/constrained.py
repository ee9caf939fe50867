"""Constrained decoding with xgrammar: compiled grammars (cached), per-request matchers, masks
for a whole batch of differently constrained rows, and jump-forward.

xgrammar is imported on first use. Its tokenizer info does not know SmolLM2's special tokens,
so every constrained row is also masked to allow no special token but EOS.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from runtime.protocol import Constraint


class InvalidConstraintError(ValueError):
    """A regex, JSON schema, grammar or choice list that cannot be compiled."""


MAX_CONSTRAINT_BYTES = 64 << 10  # a regex, grammar, schema or choice list, serialized
COMPILE_BUDGET_S = 10.0


class GrammarCache:
    """Compiles each distinct constraint once per process and makes matchers for requests."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        try:
            import xgrammar as xgr
        except ImportError as err:
            raise InvalidConstraintError(
                "constrained generation needs xgrammar: pip install --no-deps xgrammar==0.2.9 "
                f"(and apache-tvm-ffi) [{err}]"
            ) from err

        self._xgr = xgr
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=True)
        self.blocked = torch.zeros(vocab_size, dtype=torch.bool)  # special tokens but EOS
        for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if token.special and token_id not in eos_token_ids and token_id < vocab_size:
                self.blocked[token_id] = True
        self._compiled: dict[str, Any] = {}
        self._lock = threading.Lock()
        # compiles run here, so a caller waits at most COMPILE_BUDGET_S (xgrammar cannot be
        # interrupted: a runaway compile finishes in the background, bounded by the size cap)
        self._workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="flowlang-grammar")
        self.compile_seconds: dict[str, float] = {}

    def compile(self, constraint: Constraint) -> Any:
        key = constraint.model_dump_json()
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
        kind = next(
            k for k in ("regex", "json_schema", "choices", "grammar") if getattr(constraint, k)
        )
        if len(key) > MAX_CONSTRAINT_BYTES:
            raise InvalidConstraintError(
                f"the {kind} is {len(key):,} bytes serialized; the limit is "
                f"{MAX_CONSTRAINT_BYTES:,}"
            )
        started = time.perf_counter()
        try:
            compiled = self._workers.submit(self._compile, constraint).result(COMPILE_BUDGET_S)
        except FutureTimeout as err:
            raise InvalidConstraintError(
                f"compiling the {kind} took over {COMPILE_BUDGET_S:g} s: simplify it"
            ) from err
        except (RuntimeError, ValueError, TypeError) as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
            raise InvalidConstraintError(f"invalid {kind}: {first_line}") from err
        with self._lock:
            self._compiled[key] = compiled
            self.compile_seconds[key] = time.perf_counter() - started
        return compiled

    def _compile(self, constraint: Constraint) -> Any:
        if constraint.regex is not None:
            return self.compiler.compile_regex(constraint.regex)
        if constraint.json_schema is not None:
            if not has_finite_instance(constraint.json_schema):
                # xgrammar would try to force an endless value (and run out of memory)
                raise ValueError(
                    "the JSON schema admits no finite value: a required property (or a "
                    "non-empty array) refers back to a schema that contains it"
                )
            return self.compiler.compile_json_schema(
                json.dumps(constraint.json_schema), any_whitespace=False, separators=(",", ":")
            )
        if constraint.choices is not None:
            alternatives = " | ".join(json.dumps(c) for c in constraint.choices)
            return self.compiler.compile_grammar(f"root ::= {alternatives}")
        return self.compiler.compile_grammar(constraint.grammar)

    def new_state(self, constraint: Constraint) -> ConstraintState:
        return ConstraintState(self, self._xgr.GrammarMatcher(self.compile(constraint)))


def has_finite_instance(schema: Any, budget: int = 10_000) -> bool:
    """Whether some finite JSON value satisfies `schema` (local $refs followed).

    A $ref reached again on the way down through required properties, non-empty arrays or
    allOf parts can only be satisfied by an endless value; anyOf/oneOf need one finite
    alternative. Keywords this does not model count as satisfiable, and so does a schema too
    large to check within `budget` steps (xgrammar still validates it).
    """
    steps = [budget]

    def finite(node: Any, visiting: frozenset[str]) -> bool:
        steps[0] -= 1
        if steps[0] < 0:
            return True
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if ref in visiting:
                return False
            target = _resolve_pointer(schema, ref)
            if target is not None and not finite(target, visiting | {ref}):
                return False
        for key in ("anyOf", "oneOf"):
            if key in node and not any(finite(n, visiting) for n in node[key]):
                return False
        if not all(finite(n, visiting) for n in node.get("allOf", ())):
            return False
        properties = node.get("properties", {})
        for name in node.get("required", ()):
            if name in properties and not finite(properties[name], visiting):
                return False
        if node.get("minItems", 0) > 0 and not finite(node.get("items", True), visiting):
            return False
        return True

    return finite(schema, frozenset())


def _resolve_pointer(schema: Any, ref: str) -> Any:
    node = schema
    for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


class ConstraintState:
    """One request's position in its grammar, and the tokens the grammar forces next.

    Where the grammar admits exactly one continuation, its canonical tokenization (all but the
    last token, which may merge with what follows; and only if it joins the previous token
    canonically) is the plan: jump-forward appends it in one go, and without jump-forward the
    mask allows only the plan's next token. Both produce the very same tokens.
    """

    def __init__(self, grammars: GrammarCache, matcher: Any) -> None:
        self.grammars = grammars
        self.matcher = matcher
        self.last_token: int | None = None
        self.plan: list[int] = []
        self.num_forced = 0  # tokens appended by jump-forward

    def accept(self, token_id: int) -> bool:
        if not self.matcher.accept_token(token_id):
            return False
        self.last_token = token_id
        if self.plan and self.plan[0] == token_id:
            self.plan.pop(0)
        else:
            self.plan = []
        return True

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def forced(self) -> list[int]:
        """The plan of forced tokens from here (computed once per forced stretch)."""
        if self.plan or self.last_token is None:
            return self.plan
        forced = self.matcher.find_jump_forward_string()
        if not forced:
            return self.plan
        tokenizer = self.grammars.tokenizer
        ids = tokenizer.encode(forced, add_special_tokens=False)[:-1]
        if ids:
            text = tokenizer.decode([self.last_token, *ids])
            if tokenizer.encode(text, add_special_tokens=False) == [self.last_token, *ids]:
                self.plan = ids
        return self.plan

    def jump_forward(self) -> list[int]:
        """Accept the whole plan now and return it (the caller appends it as forced tokens)."""
        ids = list(self.forced())
        for count, token_id in enumerate(ids):
            if not self.accept(token_id):
                self.matcher.rollback(count)
                self.plan = []
                return []
        self.num_forced += len(ids)
        return ids


def apply_constraints(logits: torch.Tensor, states: list[ConstraintState | None]) -> None:
    """Mask, in place, what each constrained row's grammar does not allow next."""
    rows = [i for i, state in enumerate(states) if state is not None]
    if not rows:
        return
    grammars = states[rows[0]].grammars
    xgr = grammars._xgr
    bitmask = xgr.allocate_token_bitmask(len(rows), grammars.vocab_size)
    for j, i in enumerate(rows):
        states[i].matcher.fill_next_token_bitmask(bitmask, j)
    vocab = min(logits.shape[1], grammars.vocab_size)
    sub = logits[rows, :vocab]  # (num_constrained, vocab)
    xgr.apply_token_bitmask_inplace(sub, bitmask)
    sub.masked_fill_(grammars.blocked[:vocab], float("-inf"))
    for j, i in enumerate(rows):
        plan = states[i].forced()
        if plan:  # a forced stretch: only its canonical next token
            keep = sub[j, plan[0]].clone()
            sub[j].fill_(float("-inf"))
            sub[j, plan[0]] = keep
    logits[rows, :vocab] = sub
    if logits.shape[1] > vocab:
        logits[rows, vocab:] = float("-inf")
