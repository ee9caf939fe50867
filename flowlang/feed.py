"""TextFeed: the text a state appends, piece by piece, for readers that stream all of it.

A gen's deltas are fed as the engine produces them, so `s.text_iter()` shows a reply growing
before the node that generates it has finished.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator


class TextFeed:
    """Append-only pieces of text; any number of readers iterate them from the start."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._closed = False
        self._changed = threading.Condition()

    def put(self, text: str) -> None:
        """Add a piece (empty ones are dropped)."""
        if text:
            with self._changed:
                self._pieces.append(text)
                self._changed.notify_all()

    def close(self) -> None:
        """No more pieces: readers end once they have read the last one."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def __iter__(self) -> Iterator[str]:
        read = 0
        while True:
            with self._changed:
                while read >= len(self._pieces) and not self._closed:
                    self._changed.wait()
                new = self._pieces[read:]
                closed = self._closed
            read += len(new)
            if new:
                yield "".join(new)
            elif closed:
                return
