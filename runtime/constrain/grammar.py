"""Constrained decoding with xgrammar: compiled grammars (cached), per-request matchers, masks
for a whole batch of differently constrained rows, and jump-forward.

xgrammar is imported on first use. Its tokenizer info does not know SmolLM2's special tokens,
so every constrained row is also masked to allow no special token but EOS.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from runtime.constrain.check import (
    MAX_NESTING_DEPTH,
    GrammarSyntaxUnknown,
    endless_rules,
    nests_deeper,
)
from runtime.constrain.probe import GrammarProbe, ProbeVerdict, compile_constraint
from runtime.constrain.utf8_guard import Utf8Guard
from runtime.protocol import Constraint


class InvalidConstraintError(ValueError):
    """A regex, JSON schema, grammar or choice list that cannot be compiled."""


MAX_CONSTRAINT_BYTES = 64 << 10  # a regex, grammar, schema or choice list, serialized
COMPILE_BUDGET_S = 10.0
COMPILE_MEMORY_BYTES = 512 << 20  # what one trial compile may allocate (its child process)
MAX_COMPILED_BYTES = 32 << 20  # one compiled grammar, kept in the server
# per tenant: every compiled grammar one tenant keeps (its least recently used go first)
MAX_CACHED_BYTES = 256 << 20
MAX_CACHED_GRAMMARS = 1024  # per tenant, whatever their size
MAX_SCHEMA_DEPTH = MAX_NESTING_DEPTH  # nested objects and lists in a JSON schema
# a structural tag's own levels around the schemas it holds (format, elements, tag, content)
MAX_TAG_WRAPPING = 16


class GrammarCache:
    """Compiles each distinct constraint once per tenant (a trial in a memory-limited child
    process first, see probe.py, whose result is kept when it is small) and makes matchers for
    requests.

    Each tenant (the API key the server names; None in process) has a cache of its own: a
    constraint another tenant compiled is compiled again, so how long a compile takes says
    nothing about what other tenants sent.
    """

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
        # one thread: a compile in the server takes at most one core from the forward
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.blocked = torch.zeros(vocab_size, dtype=torch.bool)  # special tokens but EOS
        for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if token.special and token_id not in eos_token_ids and token_id < vocab_size:
                self.blocked[token_id] = True
        self.utf8 = Utf8Guard(self.info.decoded_vocab, vocab_size)  # what xgrammar lets by
        self.blocked |= self.utf8.never
        # tenant -> constraint_key -> compiled grammar, least recently used first
        self._compiled: dict[str | None, OrderedDict[str, Any]] = {}
        self._lock = threading.Lock()
        self.probe = GrammarProbe(self.info.serialize_json(), COMPILE_MEMORY_BYTES)
        self.probe.start()
        self.compile_seconds: dict[tuple[str | None, str], float] = {}
        self.num_trials_kept = 0  # grammars taken from the trial (no compile in this process)
        self.num_compiled_here = 0  # grammars compiled again in this process (large ones)

    def is_compiled(self, key: str, tenant: str | None = None) -> bool:
        """Whether the constraint of `key` (constraint_key) is in `tenant`'s cache: compile()
        would return at once."""
        with self._lock:
            return key in self._compiled.get(tenant, {})

    def compile(self, constraint: Constraint, tenant: str | None = None) -> Any:
        """`constraint` compiled, from `tenant`'s cache or now (InvalidConstraintError)."""
        key = constraint_key(constraint)
        with self._lock:
            cached = self._compiled.get(tenant, {})
            if key in cached:
                cached.move_to_end(key)
                return cached[key]
        kind = constraint.kind
        if len(key) > MAX_CONSTRAINT_BYTES:
            raise InvalidConstraintError(
                f"the {kind} is {len(key):,} bytes serialized; the limit is "
                f"{MAX_CONSTRAINT_BYTES:,}"
            )
        started = time.perf_counter()
        verdict = self.probe.trial(constraint, COMPILE_BUDGET_S)
        _check_trial(verdict, kind, self.probe.memory_limit_bytes)
        compiled = self._kept_or_compiled(constraint, verdict)
        _refuse_endless(compiled, kind)
        with self._lock:
            cached = self._compiled.setdefault(tenant, OrderedDict())
            cached[key] = compiled
            self.compile_seconds[tenant, key] = time.perf_counter() - started
            self._evict(tenant, cached)
        return compiled

    def _kept_or_compiled(self, constraint: Constraint, verdict: ProbeVerdict) -> Any:
        """The trial's grammar when it sent it (a small one), else compiled again here: on the
        compile queue's thread, one core at a lower priority (compile_queue.py)."""
        if verdict.grammar:
            self.num_trials_kept += 1
            return self._xgr.CompiledGrammar.deserialize_json(verdict.grammar, self.info)
        self.num_compiled_here += 1
        try:
            return compile_constraint(self.compiler, constraint)
        except (RuntimeError, ValueError, TypeError) as err:  # the trial passed: unexpected
            raise InvalidConstraintError(f"invalid {constraint.kind}: {err}") from err

    def _evict(self, tenant: str | None, cached: OrderedDict[str, Any]) -> None:
        """Drop `tenant`'s least recently used grammars past MAX_CACHED_BYTES or
        MAX_CACHED_GRAMMARS (requests that hold one keep it alive; a later request compiles it
        again). Only the tenant's own: another tenant's use never evicts them."""
        total = sum(c.memory_size_bytes for c in cached.values())
        while len(cached) > 1 and (total > MAX_CACHED_BYTES or len(cached) > MAX_CACHED_GRAMMARS):
            key, compiled = cached.popitem(last=False)
            self.compile_seconds.pop((tenant, key), None)
            total -= compiled.memory_size_bytes

    def new_state(self, compiled: Any) -> ConstraintState:
        """A request's matcher over a grammar compile() returned."""
        return ConstraintState(self, self._xgr.GrammarMatcher(compiled))


def constraint_key(constraint: Constraint) -> str:
    """What the cache knows a constraint by (check_nesting it first: this recurses)."""
    return json.dumps(constraint.model_dump(), sort_keys=True)  # ASCII: lone surrogates too


def check_nesting(constraint: Constraint) -> None:
    """Refuse a JSON schema (or a structural tag, the schemas it holds) nested deeper than
    MAX_SCHEMA_DEPTH, before anything recurses through it (serializing, hashing, converting to
    a grammar each recurse per level)."""
    if constraint.json_schema is not None and nests_deeper(constraint.json_schema):
        raise InvalidConstraintError(
            f"the json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels of objects and lists"
        )
    tag = constraint.structural_tag
    if tag is not None and nests_deeper(tag, MAX_SCHEMA_DEPTH + MAX_TAG_WRAPPING):
        raise InvalidConstraintError(
            f"the structural_tag nests deeper than {MAX_SCHEMA_DEPTH + MAX_TAG_WRAPPING} levels "
            f"of objects and lists (a schema in it: at most {MAX_SCHEMA_DEPTH})"
        )


def _check_trial(verdict: ProbeVerdict, kind: str, memory_limit_bytes: int) -> None:
    """Refuse a constraint whose trial compile failed or came out too large to keep."""
    if verdict.outcome == "invalid":
        raise InvalidConstraintError(f"invalid {kind}: {verdict.detail}")
    if verdict.outcome == "time":
        raise InvalidConstraintError(
            f"compiling the {kind} took over {COMPILE_BUDGET_S:g} s: simplify it"
        )
    if verdict.outcome == "crashed":  # the input broke the compiler: still the input's fault
        raise InvalidConstraintError(f"the {kind} crashed the compiler ({verdict.detail})")
    if verdict.outcome == "memory":
        raise InvalidConstraintError(
            f"compiling the {kind} needs over {memory_limit_bytes >> 20} MiB of memory "
            "(too many grammar states): simplify it"
        )
    if verdict.num_bytes > MAX_COMPILED_BYTES:
        raise InvalidConstraintError(
            f"the compiled {kind} takes {verdict.num_bytes / (1 << 20):.1f} MiB; the limit is "
            f"{MAX_COMPILED_BYTES >> 20} MiB (too many grammar states): simplify it"
        )


def _refuse_endless(compiled: Any, kind: str) -> None:
    """A grammar with a rule that can never end makes jump-forward force an endless string
    (xgrammar then runs out of memory); such a constraint has no valid finite output anyway."""
    try:
        endless = endless_rules(str(compiled.grammar))
    except GrammarSyntaxUnknown:
        return  # a form this reader does not know: xgrammar alone decides
    if endless:
        names = ", ".join(endless[:5]) + (", ..." if len(endless) > 5 else "")
        raise InvalidConstraintError(
            f"the {kind} can never end: no finite text satisfies rule(s) {names} (a required "
            "property or element that contains itself?)"
        )


class ConstraintState:
    """One request's position in its grammar, its mask of allowed next tokens, and the tokens
    the grammar forces next.

    Where the grammar admits exactly one continuation, its canonical tokenization (all but the
    last token, which may merge with what follows; and only if it joins the previous token
    canonically) is the plan: jump-forward appends it in one go, and without jump-forward the
    mask allows only the plan's next token. Both produce the very same tokens.

    The mask may be filled on another thread (masks.py: some grammars take seconds per mask
    over a large vocabulary): `fill_mask` and every move of the matcher take the state's lock,
    so a move waits for a fill in progress, and `num_moves` says which position a mask is for.
    """

    def __init__(self, grammars: GrammarCache, matcher: Any) -> None:
        self.grammars = grammars
        self.matcher = matcher
        self.last_token: int | None = None
        self.plan: list[int] = []
        self.num_forced = 0  # tokens appended by jump-forward
        self.num_moves = 0  # accepts and rollbacks so far: which position a mask is for
        self.mask = grammars._xgr.allocate_token_bitmask(1, grammars.vocab_size)  # (1, words)
        self.mask_at: int | None = None  # num_moves when `mask` was filled; None: never
        self.fill_s: float | None = None  # how long the last fill took; None: none yet
        self._planless_at: int | None = None  # num_moves where forced() found no plan
        self._lock = threading.Lock()

    @property
    def mask_ready(self) -> bool:
        """Whether `mask` is this position's (no fill needed before sampling)."""
        return self.mask_at == self.num_moves

    def fill_mask(self) -> None:
        """Fill `mask` for the current position, unless it is; times the fill (`fill_s`)."""
        with self._lock:
            if self.mask_ready:
                return
            started = time.perf_counter()
            self.matcher.fill_next_token_bitmask(self.mask, 0)
            self.fill_s = time.perf_counter() - started
            self.mask_at = self.num_moves

    def accept(self, token_id: int) -> bool:
        with self._lock:
            if not self.matcher.accept_token(token_id):
                return False
            self.num_moves += 1
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
        """The plan of forced tokens from here (computed once per forced stretch; where none
        is forced, once per position: masking and sampling both ask)."""
        if self.plan or self.last_token is None or self._planless_at == self.num_moves:
            return self.plan
        self._planless_at = self.num_moves  # (the plan found below makes this moot)
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

    def jump_forward(self, max_tokens: int) -> list[int]:
        """Accept the plan's first `max_tokens` now and return them (the caller appends them
        as forced tokens; the rest of the plan stays the plan)."""
        ids = self.forced()[:max_tokens]
        for count, token_id in enumerate(ids):
            if not self.accept(token_id):
                with self._lock:
                    self.matcher.rollback(count)
                    self.num_moves += 1
                self.plan = []
                return []
        self.num_forced += len(ids)
        return ids


def apply_constraints(logits: torch.Tensor, states: list[ConstraintState | None]) -> None:
    """Mask, in place, what each constrained row's grammar does not allow next (a row whose
    mask is not filled yet is filled here)."""
    rows = [i for i, state in enumerate(states) if state is not None]
    if not rows:
        return
    grammars = states[rows[0]].grammars
    xgr = grammars._xgr
    for i in rows:
        states[i].fill_mask()  # at once where it is filled already
    bitmask = torch.cat([states[i].mask for i in rows])  # (num_constrained, words)
    vocab = min(logits.shape[1], grammars.vocab_size)
    sub = logits[rows, :vocab]  # (num_constrained, vocab)
    xgr.apply_token_bitmask_inplace(sub, bitmask)
    sub.masked_fill_(grammars.blocked[:vocab], float("-inf"))
    for j, i in enumerate(rows):
        if grammars.utf8.ends_on_lead(states[i].last_token):  # no surrogate after it
            sub[j].masked_fill_(grammars.utf8.after_lead[:vocab], float("-inf"))
        plan = states[i].forced()
        if plan:  # a forced stretch: only its canonical next token
            keep = sub[j, plan[0]].clone()
            sub[j].fill_(float("-inf"))
            sub[j, plan[0]] = keep
    logits[rows, :vocab] = sub
    if logits.shape[1] > vocab:
        logits[rows, vocab:] = float("-inf")
