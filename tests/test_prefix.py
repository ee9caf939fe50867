"""Prefix-tree arithmetic against brute force (sets of prefixes)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.prefix import prefill_lower_bound, union_prefix_tokens

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
