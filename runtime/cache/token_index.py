"""TokenIndex: where each token the radix tree holds sits, found by the tokens before it.

Speculative decoding guesses a request's next tokens by finding its last few tokens somewhere
the engine has seen them and reading on. The radix tree already holds every cached prompt and
every finished continuation, token by token; this index makes them searchable by content:

- per slot (a token the tree holds): its token, the slot before it on its path, the slot
  after it most recently inserted, its namespace;
- per trigram (namespace, three tokens): the last few slots it ends at.

It listens to the tree (tree_events.py): the tree tells it what it inserts (`inserted`, the
new edge's tokens and slots) and what it frees (`released`): insertion costs O(new tokens),
eviction O(evicted tokens), a split nothing (slots never move), and nothing is ever
rescanned. A namespace is part of every key and is checked on every slot read, so a guess
never comes from another tenant's tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from runtime.cache.tree_events import EdgeStored, TreeListener

if TYPE_CHECKING:
    import torch

    from runtime.cache.radix import RadixCache

NGRAM = 3  # tokens a key holds: the shortest context a guess starts from
ANCHORS_PER_GRAM = 4  # most recent slots kept per trigram
MAX_MATCH = 12  # how far back a candidate's context is compared (longer wins)

_NONE = -1


class TokenIndex(TreeListener):
    """Trigram -> slots, and per-slot links along the tree's paths."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._token = [_NONE] * num_slots
        self._prev = [_NONE] * num_slots
        self._next = [_NONE] * num_slots
        self._space = [_NONE] * num_slots  # namespace id; _NONE: not in the tree
        self._gram: list[tuple | None] = [None] * num_slots  # the key listing this slot
        self._grams: dict[tuple, list[int]] = {}
        self._space_ids: dict[Hashable, int] = {}
        # per space id: its namespace and how many slots it holds; a space that holds none is
        # forgotten, so the ids of namespaces that came and went do not pile up
        self._space_names: dict[int, Hashable] = {}
        self._space_len: dict[int, int] = {}
        self._next_space = 0

    # ------------------------------------------------------------------ the tree's side
    def edge_stored(self, event: EdgeStored) -> None:
        slots = event.slots.tolist()
        self.inserted(event.namespace, event.key, event.start, slots, event.prev_slot)

    def slots_freed(self, slots: torch.Tensor) -> None:
        self.released(slots.tolist())

    def cleared(self) -> None:
        self.reset()

    def space_id(self, namespace: Hashable) -> int:
        """`namespace`'s id, a new one (never reused) if it holds no slot now."""
        ident = self._space_ids.get(namespace)
        if ident is None:
            ident = self._space_ids[namespace] = self._next_space
            self._space_names[ident], self._space_len[ident] = namespace, 0
            self._next_space += 1
        return ident

    @property
    def num_spaces(self) -> int:
        """Namespaces that hold at least one indexed slot."""
        return len(self._space_ids)

    def inserted(
        self,
        namespace: Hashable,
        key: Sequence[int],
        start: int,
        slots: Sequence[int],
        prev_slot: int,
    ) -> None:
        """The tree added the edge key[start:] -> slots after the path whose last slot is
        `prev_slot` (_NONE at a root); key[:start] is that path's tail (for trigrams)."""
        if not slots:
            return
        space = self.space_id(namespace)
        self._space_len[space] += len(slots)
        token, prev, nxt, spaces, gram_of, grams = (
            self._token,
            self._prev,
            self._next,
            self._space,
            self._gram,
            self._grams,
        )
        for i, slot in enumerate(slots):
            pos = start + i
            token[slot] = key[pos]
            prev[slot] = prev_slot
            spaces[slot] = space
            if prev_slot != _NONE:
                nxt[prev_slot] = slot  # the latest continuation is the one read on
            nxt[slot] = _NONE
            if pos >= NGRAM - 1:
                gram = (space, key[pos - 2], key[pos - 1], key[pos])
                anchors = grams.get(gram)
                if anchors is None:
                    grams[gram] = [slot]
                else:
                    anchors.append(slot)
                    if len(anchors) > ANCHORS_PER_GRAM:
                        gram_of[anchors.pop(0)] = None
                gram_of[slot] = gram
            prev_slot = slot

    def released(self, slots: Sequence[int]) -> None:
        """The tree freed these slots (evicted): forget them."""
        gram_of, grams = self._gram, self._grams
        for slot in slots:
            gram = gram_of[slot]
            if gram is not None:
                anchors = grams[gram]
                anchors.remove(slot)
                if not anchors:
                    del grams[gram]
                gram_of[slot] = None
            space = self._space[slot]
            if space != _NONE:
                self._forget_slot_of(space)
            self._space[slot] = _NONE
            self._token[slot] = _NONE

    def _forget_slot_of(self, space: int) -> None:
        """One slot of `space` left the tree; the space itself goes with its last slot."""
        self._space_len[space] -= 1
        if not self._space_len[space]:
            del self._space_len[space]
            del self._space_ids[self._space_names.pop(space)]

    def reset(self) -> None:
        self.__init__(self.num_slots)

    # ------------------------------------------------------------------ guesses
    def continuation(
        self, namespace: Hashable, context: Sequence[int], max_tokens: int
    ) -> tuple[int, list[int]]:
        """The best guess of what follows `context` (its last tokens matter): tokens read on
        from the tree position whose preceding tokens match the longest tail of `context`.
        Returns (tokens matched, guess); (0, []) when no matching position has a continuation."""
        space, anchors = self._anchors(namespace, context, max_tokens)
        best_len, best = 0, []
        for anchor in reversed(anchors):  # the most recent first: it wins ties
            matched = self._matched_before(space, anchor, context)
            if matched < best_len:
                continue
            guess = self._read_on(space, anchor, max_tokens)
            if guess and (matched > best_len or len(guess) > len(best)):
                best_len, best = matched, guess
        return best_len, best

    def guesses(
        self, namespace: Hashable, context: Sequence[int], max_tokens: int, limit: int
    ) -> list[tuple[int, list[int]]]:
        """Every guess of what follows `context`, not only the best: (tokens matched, guess)
        from the `limit` most recent tree positions whose last three tokens match it (what a
        token tree of guesses would verify; examples/benchmarks/spec_tree_potential.py)."""
        space, anchors = self._anchors(namespace, context, max_tokens)
        found = []
        for anchor in list(anchors)[::-1][:limit]:
            guess = self._read_on(space, anchor, max_tokens)
            if guess:
                found.append((self._matched_before(space, anchor, context), guess))
        return found

    def _anchors(
        self, namespace: Hashable, context: Sequence[int], max_tokens: int
    ) -> tuple[int, Sequence[int]]:
        """(the namespace's space, the tree positions ending `context`'s last trigram), oldest
        first; no positions when there is nothing to look up."""
        space = self._space_ids.get(namespace)
        if len(context) < NGRAM or max_tokens <= 0 or space is None:
            return -1, ()
        return space, self._grams.get((space, context[-3], context[-2], context[-1])) or ()

    def _matched_before(self, space: int, slot: int, context: Sequence[int]) -> int:
        """How many tokens of `context`'s tail the path ending at `slot` repeats."""
        token, prev, spaces = self._token, self._prev, self._space
        matched, limit = 0, min(len(context), MAX_MATCH)
        while matched < limit and slot != _NONE and spaces[slot] == space:
            if token[slot] != context[-1 - matched]:
                break
            matched += 1
            slot = prev[slot]
        return matched

    def _read_on(self, space: int, slot: int, max_tokens: int) -> list[int]:
        token, prev, nxt, spaces = self._token, self._prev, self._next, self._space
        out: list[int] = []
        while len(out) < max_tokens:
            following = nxt[slot]
            # a freed and reused slot is no longer this path's continuation
            if following == _NONE or spaces[following] != space or prev[following] != slot:
                break
            out.append(token[following])
            slot = following
        return out

    # ------------------------------------------------------------------ checks
    def check_integrity(self, cache: RadixCache | None = None) -> None:
        """Every listed slot is indexed under its own key; with the tree it listens to, the
        index knows exactly the tree's slots and their tokens."""
        tree_slots = _slot_tokens(cache) if cache is not None else None
        for gram, anchors in self._grams.items():
            assert anchors and len(anchors) <= ANCHORS_PER_GRAM, gram
            for slot in anchors:
                assert self._gram[slot] == gram, (slot, gram)
                assert self._space[slot] == gram[0] and self._token[slot] == gram[3], slot
                if tree_slots is not None:
                    assert slot in tree_slots, f"slot {slot} indexed but not in the tree"
        held = Counter(s for s in self._space if s != _NONE)
        assert held == Counter({k: n for k, n in self._space_len.items() if n}), "space counts"
        assert set(self._space_len) == set(self._space_names) == set(self._space_ids.values())
        if tree_slots is not None:
            listed = {s: self._token[s] for s in range(self.num_slots) if self._space[s] != _NONE}
            assert listed == tree_slots, "the index and the tree disagree on their tokens"


def _slot_tokens(cache: RadixCache) -> dict[int, int]:
    """Every slot the tree holds -> its token."""
    held: dict[int, int] = {}
    stack = list(cache.roots().values())
    while stack:
        node = stack.pop()
        held.update(zip(node.value.tolist(), node.key, strict=True))
        stack.extend(node.children.values())
    return held
