"""SlotAllocator: whole-page allocation, never partial, loud on double or foreign frees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cache.allocator import DoubleFreeError, ForeignSlotError, SlotAllocator


def test_alloc_and_free_roundtrip():
    alloc = SlotAllocator(num_slots=8)
    first = alloc.alloc(5)
    assert first.dtype == torch.int64 and len(set(first.tolist())) == 5
    assert alloc.num_free_slots == 3
    assert alloc.alloc(4) is None, "never a partial allocation"
    assert alloc.num_free_slots == 3
    alloc.free(first[:2])
    assert alloc.num_free_slots == 5
    second = alloc.alloc(5)
    assert not set(second.tolist()) & set(first[2:].tolist())
    alloc.check_integrity()


def test_pages_are_whole_and_ordered():
    alloc = SlotAllocator(num_slots=64, page_size=16)
    slots = alloc.alloc(32)
    rows = slots.view(-1, 16)
    assert bool((rows[:, 0] % 16 == 0).all())
    assert torch.equal(rows - rows[:, :1], torch.arange(16).expand(2, 16))
    with pytest.raises(ValueError, match="multiple of page_size"):
        alloc.alloc(10)
    with pytest.raises(ForeignSlotError, match="whole pages"):
        alloc.free(slots[:8])
    with pytest.raises(ForeignSlotError, match="in order"):
        alloc.free(slots[:16].flip(0))
    alloc.free(slots[16:])
    assert alloc.num_free_slots == 48
    alloc.check_integrity()


def test_double_free_and_foreign_slots_raise_and_change_nothing():
    alloc = SlotAllocator(num_slots=8)
    slots = alloc.alloc(4)
    alloc.free(slots[:2])
    with pytest.raises(DoubleFreeError, match="already free"):
        alloc.free(slots[:3])
    with pytest.raises(DoubleFreeError, match="twice"):
        alloc.free(torch.tensor([slots[2], slots[2]]))
    with pytest.raises(ForeignSlotError, match="outside the pool"):
        alloc.free(torch.tensor([8]))
    with pytest.raises(ForeignSlotError, match="outside the pool"):
        alloc.free(torch.tensor([-1]))
    assert alloc.num_free_slots == 6
    alloc.free(slots[2:])
    assert alloc.num_free_slots == 8
    alloc.check_integrity()


def test_bad_construction():
    with pytest.raises(ValueError):
        SlotAllocator(num_slots=10, page_size=4)
    with pytest.raises(ValueError):
        SlotAllocator(num_slots=8, page_size=0)


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 4]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40),
)
def test_random_alloc_free_conserves_slots(page_size, ops):
    alloc = SlotAllocator(num_slots=32, page_size=page_size)
    held: list[torch.Tensor] = []
    for is_alloc, n in ops:
        if is_alloc:
            got = alloc.alloc(n * page_size)
            if got is None:
                assert n * page_size > alloc.num_free_slots
            else:
                assert got.numel() == n * page_size
                held.append(got)
        elif held:
            alloc.free(held.pop(n % len(held)))
        owned = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        assert torch.unique(owned).numel() == owned.numel(), "a slot handed out twice"
        assert alloc.num_free_slots + owned.numel() == alloc.num_slots
        assert alloc.all_allocated(owned)
        alloc.check_integrity()


def test_freed_slots_are_copied_not_aliased():
    """Freeing a view and then reusing its storage must not corrupt the free list."""
    alloc = SlotAllocator(num_slots=8)
    held = alloc.alloc(6)
    alloc.free(held[2:4])
    held[2:4] = torch.tensor([0, 1])  # the caller reuses its tensor
    alloc.check_integrity()
    assert sorted(alloc.alloc(4).tolist()) == [2, 3, 6, 7]
