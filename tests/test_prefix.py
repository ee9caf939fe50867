"""Prefix-tree arithmetic against brute force (sets of prefixes)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.prefix import prefill_lower_bound, shared_prefixes, union_prefix_tokens

seqs = st.lists(st.lists(st.integers(0, 3), max_size=8), max_size=8)


def prefixes(seq, start=0):
    return {tuple(seq[: i + 1]) for i in range(start, len(seq))}


@settings(max_examples=200, deadline=None)
@given(seqs, st.lists(st.sampled_from([None, "a"]), min_size=8, max_size=8))
def test_union_is_the_number_of_distinct_prefixes(sequences, namespaces):
    namespaces = namespaces[: len(sequences)]
    expected = len(
        {(ns, p) for s, ns in zip(sequences, namespaces, strict=True) for p in prefixes(s)}
    )
    assert union_prefix_tokens(sequences, namespaces) == expected


@settings(max_examples=200, deadline=None)
@given(
    seqs,
    st.lists(
        st.tuples(st.lists(st.integers(0, 3), max_size=6), st.lists(st.integers(0, 3), max_size=4)),
        max_size=4,
    ),
)
def test_lower_bound_removes_kv_computed_while_decoding(prompts, finished):
    in_prompts = set().union(*(prefixes(p) for p in prompts))
    decoded = set().union(*(prefixes([*p, *o[:-1]], len(p)) for p, o in finished))
    assert prefill_lower_bound(prompts, finished) == len(in_prompts - decoded)


def test_chapter_example():
    system, fewshot, rag = range(512), range(1000, 2543), range(8000, 10112)
    r1 = [*system, *fewshot, *range(5000, 5096)]
    r2 = [*system, *fewshot, *range(6000, 6080)]
    r3 = [*system, *rag]
    assert union_prefix_tokens([r1, r2, r3]) == 4343


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.lists(st.integers(0, 2), max_size=10)), max_size=10),
    st.integers(1, 4),
)
def test_shared_prefixes_are_branching_points_with_exactly_their_readers(prompts, min_tokens):
    """Against brute force: each point is two prompts' longest common prefix, read by exactly
    the prompts that start with it, at least `min_tokens` past the longest point it extends;
    and every pair's common prefix that long past its kept ancestors is kept."""
    found = shared_prefixes(prompts, min_tokens)
    kept = [prefix for prefix, _ in found]
    assert [len(p) for p in kept] == sorted(len(p) for p in kept) and len(set(kept)) == len(kept)
    real = [(i, tuple(p)) for i, p in enumerate(prompts) if p]
    lcps = set()
    for i, a in real:
        for j, b in real:
            if i != j:
                n = 0
                while n < min(len(a), len(b)) and a[n] == b[n]:
                    n += 1
                lcps.add(a[:n])
    for prefix, readers in found:
        assert prefix in lcps and len(prefix) >= min_tokens
        assert readers == {i for i, p in real if p[: len(prefix)] == prefix}
        parents = [len(q) for q in kept if len(q) < len(prefix) and prefix[: len(q)] == q]
        assert len(prefix) - max(parents, default=0) >= min_tokens
    for lcp in lcps:
        parents = [len(q) for q in kept if len(q) <= len(lcp) and lcp[: len(q)] == q]
        if len(lcp) - max(parents, default=0) >= min_tokens:
            assert lcp in kept, (lcp, kept)
