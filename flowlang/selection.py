"""How `select` picks a choice from per-token logprobs (the engine scores, flowlang decides)."""

from __future__ import annotations


def choose(
    method: str,
    choice_ids: list[list[int]],
    logprobs: list[list[float]],
    unconditional: list[list[float]] | None = None,
) -> tuple[int, list[float]]:
    """(index of the chosen choice, one score per choice; higher is better)."""
    if method == "token_length_normalized":
        scores = [sum(lp) / len(lp) for lp in logprobs]
    elif method == "unconditional_likelihood_normalized":
        scores = [
            sum(c - u for c, u in zip(cond, unc, strict=True)) / len(cond)
            for cond, unc in zip(logprobs, unconditional, strict=True)
        ]
    elif method == "greedy":
        return _greedy(choice_ids, logprobs)
    else:
        raise ValueError(f"unknown select method {method!r}")
    return max(range(len(scores)), key=lambda i: (scores[i], -i)), scores


def _greedy(choice_ids: list[list[int]], logprobs: list[list[float]]) -> tuple[int, list[float]]:
    """Greedy decoding restricted to the choices: at each position keep the choices whose token
    there is the most likely one; a choice that ends while still alive wins."""
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
        best = max(by_token.values(), key=lambda group: logprobs[group[0]][position])
        alive = best
        position += 1
    scores = [lp[0] for lp in logprobs]  # the first-token logprob that greedy compares first
    return alive[0], scores
