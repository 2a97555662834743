"""SortedInts: a sorted set of ints in blocks (the index's eviction order and cache pages).

Why not a heap or an OrderedDict: the index needs, in O(log n), the smallest member (the
next eviction victim), removal of any member (an object leased or deleted), insertion at
its place (a FIFO object re-entering the eviction order when its last lease goes) and
iteration from the first member after a cursor (a page of /cache). A list of sorted blocks
with a list of block maxima does all four: bisect over the maxima, then over one block.
Most inserts are appends (sequence numbers only grow), which only touch the last block.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator

_BLOCK = 512   # split a block at twice this; small enough that insort/del inside it is cheap


class SortedInts:
    __slots__ = ("_blocks", "_maxes", "_len")

    def __init__(self):
        self._blocks: list[list[int]] = []
        self._maxes: list[int] = []        # _maxes[i] == _blocks[i][-1]; no block is empty
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def add(self, x: int) -> None:
        """Insert x (not already present)."""
        self._len += 1
        if not self._maxes or x > self._maxes[-1]:   # the common case: a new largest number
            if self._blocks and len(self._blocks[-1]) < _BLOCK:
                self._blocks[-1].append(x)
                self._maxes[-1] = x
            else:
                self._blocks.append([x])
                self._maxes.append(x)
            return
        i = bisect_left(self._maxes, x)
        block = self._blocks[i]
        insort(block, x)
        if len(block) > 2 * _BLOCK:
            half = block[_BLOCK:]
            del block[_BLOCK:]
            self._blocks.insert(i + 1, half)
            self._maxes[i] = block[-1]
            self._maxes.insert(i + 1, half[-1])

    def discard(self, x: int) -> bool:
        """Remove x if present; True if it was."""
        i = bisect_left(self._maxes, x)
        if i == len(self._maxes):
            return False
        block = self._blocks[i]
        j = bisect_left(block, x)
        if block[j] != x:
            return False
        del block[j]
        self._len -= 1
        if not block:
            del self._blocks[i]
            del self._maxes[i]
        elif j == len(block):
            self._maxes[i] = block[-1]
        return True

    def first(self) -> int | None:
        return self._blocks[0][0] if self._blocks else None

    def after(self, cursor: int | None) -> Iterator[int]:
        """Members greater than `cursor` (all members when None), ascending.

        Do not add or discard while iterating (collect first): blocks may split or vanish.
        """
        if cursor is None:
            i, j = 0, 0
        else:
            i = bisect_right(self._maxes, cursor)
            if i == len(self._maxes):
                return
            j = bisect_right(self._blocks[i], cursor)
        while i < len(self._blocks):
            block = self._blocks[i]
            yield from block[j:]
            i, j = i + 1, 0
