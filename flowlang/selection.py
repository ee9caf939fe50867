"""How `select` picks a choice: the engine scores, flowlang decides.

Each method is a strategy object that declares what it needs (as SGLang's choices methods do):
every method gets the per-token logprobs of each choice after the prompt; one that sets
`requires_unconditional_logprobs` also gets them after a content-free prefix, and
`score_choices` only asks the backend for those when the method needs them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from flowlang.backends.base import Backend
from flowlang.content import Content
from flowlang.ir import Select
from runtime.protocol import GraphHints, ScoreRequest


@dataclass(frozen=True)
class Decision:
    index: int  # the chosen choice
    scores: list[float]  # one per choice, higher is better
    extra: dict[str, Any] | None = None  # what the method adds to the select's meta


class ChoicesMethod(ABC):
    """A select method: picks one choice from per-token logprobs."""

    name: ClassVar[str]
    requires_unconditional_logprobs: ClassVar[bool] = False

    @abstractmethod
    def choose(
        self,
        choice_ids: list[list[int]],
        logprobs: list[list[float]],
        unconditional: list[list[float]] | None = None,
    ) -> Decision:
        """The decision for choices `choice_ids` with these per-token logprobs."""

    def __repr__(self) -> str:
        return self.name


def _first_best(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


class TokenLengthNormalized(ChoicesMethod):
    """The highest mean logprob per token (the default)."""

    name = "token_length_normalized"

    def choose(self, choice_ids, logprobs, unconditional=None) -> Decision:
        scores = [sum(lp) / len(lp) for lp in logprobs]
        return Decision(_first_best(scores), scores)


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """The highest mean of (logprob after the prompt - logprob after a content-free prefix):
    a choice the model likes everywhere gains nothing from being likely here."""

    name = "unconditional_likelihood_normalized"
    requires_unconditional_logprobs = True

    def choose(self, choice_ids, logprobs, unconditional=None) -> Decision:
        if unconditional is None:
            raise ValueError(f"{self.name} needs the unconditional logprobs")
        scores = [
            sum(c - u for c, u in zip(cond, unc, strict=True)) / len(cond)
            for cond, unc in zip(logprobs, unconditional, strict=True)
        ]
        return Decision(
            _first_best(scores), scores, {"unconditional_token_logprobs": unconditional}
        )


class Greedy(ChoicesMethod):
    """Greedy decoding restricted to the choices: at each position keep the choices whose token
    there is the most likely one; a choice that ends while still alive wins."""

    name = "greedy"

    def choose(self, choice_ids, logprobs, unconditional=None) -> Decision:
        alive = list(range(len(choice_ids)))
        position = 0
        while len(alive) > 1:
            ended = [i for i in alive if position >= len(choice_ids[i])]
            if ended:
                alive = ended[:1]
                break
            by_token: dict[int, list[int]] = {}
            for i in alive:  # choices with the same token here share this step's logprob
                by_token.setdefault(choice_ids[i][position], []).append(i)
            alive = max(by_token.values(), key=lambda group: logprobs[group[0]][position])
            position += 1
        scores = [lp[0] for lp in logprobs]  # the first-token logprob that greedy compares first
        return Decision(alive[0], scores)


class GreedyTokenSelection(ChoicesMethod):
    """SGLang's greedy rule: compare the choices position by position, keeping those with the
    best logprob there; a shorter choice continues with its own mean logprob (so a choice that
    is a prefix of another competes on its average, not by ending first)."""

    name = "greedy_token_selection"

    def choose(self, choice_ids, logprobs, unconditional=None) -> Decision:
        width = max(map(len, logprobs))
        means = [sum(lp) / len(lp) for lp in logprobs]
        matrix = [lp + [mean] * (width - len(lp)) for lp, mean in zip(logprobs, means, strict=True)]
        remaining = list(range(len(logprobs)))
        for column in range(width):
            best = max(matrix[i][column] for i in remaining)
            remaining = [i for i in remaining if matrix[i][column] == best]
            if len(remaining) == 1:
                break
        return Decision(remaining[0], means, {"greedy_logprob_matrix": matrix})


METHODS: dict[str, ChoicesMethod] = {
    m.name: m
    for m in (
        TokenLengthNormalized(),
        Greedy(),
        GreedyTokenSelection(),
        UnconditionalLikelihoodNormalized(),
    )
}


def method_name(method: str | ChoicesMethod) -> str | None:
    """The registered name of `method` (a name or one of the METHODS objects), else None."""
    if isinstance(method, ChoicesMethod):
        return method.name if METHODS.get(method.name) is method else None
    return method if method in METHODS else None


def score_choices(
    backend: Backend,
    content: Content,
    node: Select,
    hints: GraphHints,
    namespace: str | None,
) -> tuple[list[list[int]], Decision, dict[str, Any]]:
    """Score the select's choices after `content` (the prefix computed once) and decide by its
    method: (the choices' token ids, the decision, the select's meta)."""
    method = METHODS[node.method]
    choice_ids = [backend.tokenize(c) for c in node.choices]
    scored = backend.score(
        ScoreRequest(
            prefix=list(content.ids), continuations=choice_ids, hints=hints, namespace=namespace
        )
    )
    unconditional = None
    if method.requires_unconditional_logprobs:
        # content-free: the open message's role markup (or the first token) instead of the prompt
        base = content.open_role_prefix_ids or content.ids[:1]
        unconditional = backend.score(
            ScoreRequest(prefix=list(base), continuations=choice_ids, namespace=namespace)
        ).token_logprobs
    decision = method.choose(choice_ids, scored.token_logprobs, unconditional)
    meta = {
        "method": node.method,
        "scores": decision.scores,
        "choices": list(node.choices),
        "choice_ids": choice_ids,
        "token_logprobs": scored.token_logprobs,
        **(decision.extra or {}),
    }
    return choice_ids, decision, meta
