"""SGLang's ProgramState and fork group over flowlang's state: the same stream, SGLang's methods.

`SGLangState` is a flowlang ProgramState (every native method works on it too) that adds what
SGLang programs call: `s.user(expr)`, `s.fork(n)` returning a `ForkGroup`, `var_scope`,
`get_var`/`set_var`, `get_meta_info` (SGLang's meta_info shape), `error()`, `ret_value`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from flowlang.errors import FlowlangError, ProgramError
from flowlang.sglang.expr import Expr, role
from flowlang.state import ProgramState

JOIN_MODES = {"gather_variable": "gather", "concate_and_append": "concat"}


class SGLangState(ProgramState):
    """The `s` of an SGLang program run on flowlang (`import flowlang.sglang as sgl`)."""

    def __iadd__(self, other: Any) -> SGLangState:
        if other is None:
            raise ProgramError("Tried to append None to state.")
        super().__iadd__(other)
        return self

    def _role(self, name: str, expr: Any) -> Any:
        if expr is None:
            return self.role(name)  # `with s.user(): ...`
        message = role(name, expr)
        self += message
        return message

    def system(self, expr: Any = None) -> Any:
        """`s.system(expr)` appends a system message; `with s.system():` builds one."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        """`s.user(expr)` appends a user message; `with s.user():` builds one."""
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        """`s.assistant(expr)` appends an assistant message; `with s.assistant():` builds one."""
        return self._role("assistant", expr)

    def fork(self, size: int = 1, position_ids_offset: Sequence[int] | None = None) -> ForkGroup:
        """`size` branches from here as SGLang's fork group (the shared prefix is pinned).

        `position_ids_offset` (one int per branch) is checked and, as in SGLang's own frontend
        and runtime today, has no effect: every branch continues at its natural positions, and
        `join("concate_and_append")` appends the branches' text, which the next request
        prefills with ordinary attention (SGLang's text path; its KV-concatenating path is gone).
        """
        size = int(size)
        if position_ids_offset is not None:
            offsets = list(position_ids_offset)
            if len(offsets) != size or not all(
                isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets
            ):
                raise ProgramError(
                    f"fork({size}, position_ids_offset={offsets!r}): one int >= 0 per branch"
                )
        return ForkGroup(super().fork(size), self)

    @contextlib.contextmanager
    def copy(self, position_ids_offset: Sequence[int] | None = None) -> Iterator[SGLangState]:
        """`with s.copy() as c:` a single branch, joined (gathering its variables) at the end."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """The text appended inside the block goes into variable `name`. Differs from SGLang:
        the body waits here for the text so far (it does not run ahead past a scope)."""
        start = len(self.text())
        yield
        self[name] = self.text()[start:]

    def get_var(self, name: str) -> Any:
        """`s[name]`."""
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        """`s[name] = value`."""
        self[name] = value

    def get_meta_info(self, name: str) -> dict[str, Any] | list | None:
        """What the server reported for `name`, in SGLang's meta_info shape."""
        return sglang_meta(self.meta(name))

    def __contains__(self, name: str) -> bool:
        return name in self.variables()

    def error(self) -> BaseException | None:
        """The run's failure, or None (waits for the run)."""
        try:
            self.sync()
        except FlowlangError as err:
            return err.__cause__ or err
        return None

    @property
    def ret_value(self) -> Any:
        """What the SGLang function returned."""
        self.sync()
        return self.return_value

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """`text_iter` for `async for` loops. With `return_meta_data`, differs from SGLang: one
        (text, meta_info) pair once the gen has finished, not one per streamed piece."""
        if return_meta_data:
            if var_name is None:
                raise ProgramError("text_async_iter(return_meta_data=True) needs a var_name")
            text = await asyncio.to_thread(self.__getitem__, var_name)
            meta = self.get_meta_info(var_name) or {}
            meta["output_token_logprobs_length"] = len(meta.get("output_token_logprobs", []))
            yield text, meta
            return
        deltas = self.text_iter(var_name)
        while (delta := await asyncio.to_thread(next, deltas, None)) is not None:
            yield delta


class ForkGroup:
    """SGLang's fork group: `forks[i]`, `forks += ...` (one expr, a list, or `lambda i: ...`),
    `forks.join(mode=...)`."""

    def __init__(self, states: list[SGLangState], src: SGLangState) -> None:
        self.states = states
        self.src = src

    def join(self, mode: str = "gather_variable") -> None:
        """Gather the branches' variables into lists on the parent ("gather_variable"), or
        append each branch's text to it ("concate_and_append", variables gathered too)."""
        if mode not in JOIN_MODES:
            raise ProgramError(f"join mode must be one of {list(JOIN_MODES)}, got {mode!r}")
        self.src.join(self.states, mode=JOIN_MODES[mode])

    def __getitem__(self, index: int) -> SGLangState:
        return self.states[index]

    def __setitem__(self, index: int, value: SGLangState) -> None:
        if value is not self.states[index]:  # `forks[i] += x` assigns the same state back
            raise ProgramError("a fork group's branches cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[SGLangState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ForkGroup:
        if isinstance(other, Callable):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, list | tuple) and not isinstance(other, Expr):
            if len(other) != len(self.states):
                raise ProgramError(f"{len(other)} items for {len(self.states)} branches")
            for state, item in zip(self.states, other, strict=True):
                state += item
        else:
            for state in self.states:
                state += other
        return self


def sglang_meta(meta: dict[str, Any]) -> dict[str, Any] | list | None:
    """flowlang's meta of a gen, select or join, in SGLang's meta_info shape."""
    if "branches" in meta:  # a gathered variable: one meta per branch
        return [sglang_meta(m) if m else None for m in meta["branches"]]
    if "method" in meta:
        return _select_meta(meta)
    if "completion_tokens" not in meta:
        return None  # set with `s[name] = ...`
    reason = meta["finish_reason"]
    info: dict[str, Any] = {
        "id": meta.get("rid"),
        "prompt_tokens": meta["prompt_tokens"],
        "completion_tokens": meta["completion_tokens"],
        "cached_tokens": meta["cached_tokens"],
        "finish_reason": None if reason is None else {"type": reason},
    }
    if reason == "length":
        info["finish_reason"]["length"] = meta["completion_tokens"]
    elif reason is not None and meta.get("matched_stop") is not None:
        info["finish_reason"]["matched"] = meta["matched_stop"]
    logprobs = meta.get("logprobs")
    if logprobs is not None:
        info["output_token_logprobs"] = [[lp.logprob, lp.token_id, None] for lp in logprobs]
        if any(lp.top is not None for lp in logprobs):
            info["output_top_logprobs"] = [_top(lp.top) for lp in logprobs]
    if meta.get("prompt_logprobs") is not None:
        info.update(_input_logprobs(meta))
    return info


def _top(top: list[tuple[int, float]] | None) -> list | None:
    return None if top is None else [[v, t, None] for t, v in top]


def _input_logprobs(meta: dict[str, Any]) -> dict[str, list]:
    """SGLang's input logprobs: from the first position computed on; when that is position 1,
    from position 0 (which has none), as SGLang's logprob_start_len=0 gives them."""
    ids, lps = meta["prompt_ids"], meta["prompt_logprobs"]
    start = next((j for j, lp in enumerate(lps) if lp is not None), len(lps))
    start = 0 if start == 1 else start
    info = {"input_token_logprobs": [[lps[j], ids[j], None] for j in range(start, len(ids))]}
    tops = meta.get("prompt_top_logprobs")
    if tops is not None:
        info["input_top_logprobs"] = [_top(tops[j]) for j in range(start, len(ids))]
    return info


def _select_meta(meta: dict[str, Any]) -> dict[str, Any]:
    logprobs = meta["token_logprobs"]
    info = {
        "normalized_prompt_logprobs": [sum(lp) / len(lp) for lp in logprobs],
        "input_token_logprobs": [
            [[lp, token, None] for lp, token in zip(lps, ids, strict=True)]
            for lps, ids in zip(logprobs, meta["choice_ids"], strict=True)
        ],
        "output_token_logprobs": [[] for _ in logprobs],
    }
    for key in ("greedy_logprob_matrix", "unconditional_token_logprobs"):
        if key in meta:
            info[key] = meta[key]
    return info
