"""KV slot allocator: hands out indices into the KV pool, in whole pages."""

from __future__ import annotations

import torch


class AllocatorError(ValueError):
    """A free() that would corrupt the allocator (the allocator is left unchanged)."""


class DoubleFreeError(AllocatorError):
    """A slot was freed that is already free."""


class ForeignSlotError(AllocatorError):
    """A slot index outside the pool, or indices that do not form whole pages."""


class SlotAllocator:
    """Free-list allocator over `num_slots` KV slots grouped in pages of `page_size` slots.

    `alloc` returns whole pages (slot ids page_id * page_size + 0..page_size-1, in order) or None
    when too few are free; it never returns a partial allocation. `free` takes whole pages back.

    >>> alloc = SlotAllocator(num_slots=8, page_size=2)
    >>> alloc.alloc(4).tolist()
    [0, 1, 2, 3]
    >>> alloc.num_free_slots
    4
    """

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < page_size or num_slots % page_size:
            raise ValueError(
                f"num_slots must be a positive multiple of page_size={page_size}, got {num_slots}"
            )
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)
        self.reset()

    def reset(self) -> None:
        """Mark every slot free (callers must hold no slots)."""
        self._free_pages = torch.arange(self.num_pages, dtype=torch.int64)  # (num_free_pages,)
        self._released: list[torch.Tensor] = []  # freed page ids not yet merged into _free_pages
        self._num_released_pages = 0
        self._page_is_free = torch.ones(self.num_pages, dtype=torch.bool)

    @property
    def num_free_pages(self) -> int:
        """Pages available to alloc()."""
        return len(self._free_pages) + self._num_released_pages

    @property
    def num_free_slots(self) -> int:
        """Slots available to alloc()."""
        return self.num_free_pages * self.page_size

    @property
    def num_used_slots(self) -> int:
        """Slots handed out and not yet freed."""
        return self.num_slots - self.num_free_slots

    def can_alloc(self, num_tokens: int) -> bool:
        """Whether alloc(num_tokens) would succeed now."""
        return self._num_pages_for(num_tokens) <= self.num_free_pages

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slot indices for `num_tokens` tokens (a multiple of page_size), or None when short."""
        num_pages = self._num_pages_for(num_tokens)
        if num_pages > self.num_free_pages:
            return None
        if num_pages > len(self._free_pages):
            self._merge_released()
        pages = self._free_pages[:num_pages]
        self._free_pages = self._free_pages[num_pages:]
        self._page_is_free[pages] = False
        return self._pages_to_slots(pages)

    def free(self, indices: torch.Tensor) -> None:
        """Return slots to the pool; they must be whole pages that are currently allocated."""
        if indices.numel() == 0:
            return
        pages = self._slots_to_pages(indices)
        if torch.unique(pages).numel() != pages.numel():
            raise DoubleFreeError("free() got the same page twice in one call")
        already_free = self._page_is_free[pages]
        if bool(already_free.any()):
            slot = int(pages[already_free][0]) * self.page_size
            raise DoubleFreeError(f"slot {slot} is already free")
        self._page_is_free[pages] = True
        self._released.append(pages)
        self._num_released_pages += pages.numel()

    def all_allocated(self, indices: torch.Tensor) -> bool:
        """Whether every slot in `indices` is inside the pool and currently allocated."""
        if indices.numel() == 0:
            return True
        if int(indices.min()) < 0 or int(indices.max()) >= self.num_slots:
            return False
        return not bool(self._page_is_free[indices // self.page_size].any())

    def check_integrity(self) -> None:
        """Assert the free list and the free mask agree and hold each page at most once."""
        self._merge_released()
        free = self._free_pages
        assert free.numel() == 0 or (int(free.min()) >= 0 and int(free.max()) < self.num_pages)
        assert torch.unique(free).numel() == free.numel(), "a page is on the free list twice"
        mask = torch.zeros(self.num_pages, dtype=torch.bool)
        mask[free] = True
        assert torch.equal(mask, self._page_is_free), "free list and free mask disagree"

    def _num_pages_for(self, num_tokens: int) -> int:
        if num_tokens < 0 or num_tokens % self.page_size:
            raise ValueError(
                f"alloc needs a multiple of page_size={self.page_size} (>= 0), got {num_tokens}"
            )
        return num_tokens // self.page_size

    def _merge_released(self) -> None:
        if self._released:
            self._free_pages = torch.cat([self._free_pages, *self._released])
            self._released = []
            self._num_released_pages = 0

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages.clone()
        # (num_pages, page_size) -> (num_pages * page_size,)
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def _slots_to_pages(self, indices: torch.Tensor) -> torch.Tensor:
        indices = indices.reshape(-1).to(torch.int64)
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= self.num_slots:
            bad = low if low < 0 else high
            raise ForeignSlotError(f"slot {bad} is outside the pool of {self.num_slots} slots")
        if self.page_size == 1:
            return indices.clone()  # never alias the caller's tensor: it may be reused
        if indices.numel() % self.page_size:
            raise ForeignSlotError(
                f"free() needs whole pages of {self.page_size} slots, got {indices.numel()} slots"
            )
        rows = indices.view(-1, self.page_size)  # (num_pages, page_size)
        pages = rows[:, 0] // self.page_size
        if not torch.equal(rows, pages[:, None] * self.page_size + self._page_offsets):
            raise ForeignSlotError(f"free() needs whole pages of {self.page_size} slots in order")
        return pages
