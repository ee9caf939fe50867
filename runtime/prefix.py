"""Prefix arithmetic over token sequences and KV sizes (pure Python, torch-free).

Shared by the engine (radix tree edges, trace replay) and the language (request-graph reports,
batch pins, cache reports), so both sides count shared prefixes and KV bytes the same way.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


def common_prefix_len(a: Sequence[int], b: Sequence[int], b_start: int = 0) -> int:
    """Length of the common prefix of a and b[b_start:] (same sequence type).

    The common case (all of `a` matches) is one C-level compare; otherwise gallop in doubling
    windows, then bisect the window holding the first difference: O(log n) Python steps.
    """
    limit = min(len(a), len(b) - b_start)
    if a[:limit] == b[b_start : b_start + limit]:
        return limit
    lo, step = 0, 8
    while True:
        hi = min(lo + step, limit)
        if a[lo:hi] != b[b_start + lo : b_start + hi]:
            break
        lo, step = hi, step * 2
    while hi - lo > 1:  # a[:lo] equal, a[lo:hi] differs
        mid = (lo + hi) // 2
        if a[lo:mid] == b[b_start + lo : b_start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


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
        shared = common_prefix_len(prev, seq) if ns == prev_ns else 0
        total += len(seq) - shared
        prev_ns, prev = ns, seq
    return total


def shared_prefixes(
    prompts: Sequence[Sequence[int] | None], min_tokens: int
) -> list[tuple[tuple[int, ...], set[int]]]:
    """The branching points of the prompts' prefix tree worth pinning, shortest first, each with
    the indices of the prompts that start with it: what a batch pins once and releases when the
    last of its readers is done. None (an unknown prompt) reads nothing.

    A branching point is the longest common prefix of two neighbours in sorted order; it is
    kept when it adds at least `min_tokens` to the longest kept point it extends (a branch that
    differs from its parent by a name's few tokens is not worth a pin of its own). Its readers
    are a run of neighbours in sorted order, so the whole is O(n log n + points * n)."""
    ordered = sorted((tuple(p), i) for i, p in enumerate(prompts) if p)
    lcp = [common_prefix_len(a, b) for (a, _), (b, _) in zip(ordered, ordered[1:], strict=False)]
    points = sorted({(n, k) for k, n in enumerate(lcp) if n >= min_tokens})
    kept_len = [0] * len(ordered)  # per sorted position: the longest kept point it reads
    found: dict[tuple[int, ...], set[int]] = {}
    for length, k in points:
        prefix = ordered[k][0][:length]
        if prefix in found or length - kept_len[k] < min_tokens:
            continue
        lo, hi = k, k + 1  # the run of neighbours sharing `length` tokens around k
        while lo > 0 and lcp[lo - 1] >= length:
            lo -= 1
        while hi < len(lcp) and lcp[hi] >= length:
            hi += 1
        kept_len[lo : hi + 1] = [length] * (hi + 1 - lo)
        found[prefix] = {ordered[j][1] for j in range(lo, hi + 1)}
    return sorted(found.items(), key=lambda item: len(item[0]))


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


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x element size of `dtype` (a name)."""
    dtype = dtype.removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r}; choose from {tuple(DTYPE_BYTES)}")
    return 2 * num_layers * num_kv_heads * head_dim * DTYPE_BYTES[dtype]


def kv_bytes_per_token_of(model_config: Any) -> int:
    """kv_bytes_per_token from a transformers config (or a dict with the same keys)."""
    get = (
        model_config.get
        if isinstance(model_config, Mapping)
        else (lambda key, default=None: getattr(model_config, key, default))
    )
    heads = get("num_attention_heads")
    return kv_bytes_per_token(
        get("num_hidden_layers"),
        get("num_key_value_heads") or heads,
        get("head_dim") or get("hidden_size") // heads,
        str(get("torch_dtype") or get("dtype") or "float32"),
    )
