"""Prefix-tree arithmetic over token sequences (pure Python): what a radix cache must store."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence


def union_prefix_tokens(
    sequences: Iterable[Sequence[int]], namespaces: Iterable[Hashable] | None = None
) -> int:
    """Tokens in the union prefix tree of `sequences` (each shared prefix counted once).

    Sorted, every sequence adds its length minus its longest common prefix with its
    predecessor; sequences in different namespaces never share.
    """
    seqs = [tuple(s) for s in sequences]
    keys = list(namespaces) if namespaces is not None else [None] * len(seqs)
    ordered = sorted(zip(keys, seqs, strict=True), key=lambda kv: (repr(kv[0]), kv[1]))
    total, prev_ns, prev = 0, object(), ()
    for ns, seq in ordered:
        shared = _lcp(prev, seq) if ns == prev_ns else 0
        total += len(seq) - shared
        prev_ns, prev = ns, seq
    return total


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def prefill_lower_bound(
    prompts: Iterable[Sequence[int]],
    finished: Iterable[tuple[Sequence[int], Sequence[int]]] = (),
) -> int:
    """The least prefill work for `prompts`: their union prefix tree minus the tokens whose KV
    was already computed while decoding. `finished` holds (prompt, output) of requests whose
    decoding fed output[:-1] through the model (the last sampled token never is).
    """
    root: dict = {}
    in_prompt, by_decode = 1, 2
    marks: dict[int, int] = {}

    def walk(seq: Sequence[int], start: int, mark: int) -> None:
        node = root
        for i, token in enumerate(seq):
            node = node.setdefault(token, {})
            if i >= start:
                marks[id(node)] = marks.get(id(node), 0) | mark

    for seq in prompts:
        walk(seq, 0, in_prompt)
    for prompt, output in finished:
        walk([*prompt, *output[:-1]], len(prompt), by_decode)
    return sum(1 for m in marks.values() if m == in_prompt)
