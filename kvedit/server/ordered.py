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

    def update(self, xs: list[int]) -> None:
        """Insert every x of `xs` (ascending, none present): one bisect walk, not len(xs)
        separate searches; a run past the current largest is appended block by block."""
        if not xs:
            return
        blocks, maxes = self._blocks, self._maxes
        cut = bisect_right(xs, maxes[-1]) if maxes else 0
        i = 0
        for x in xs[:cut]:           # x < maxes[i] (not present): no maximum changes
            i = bisect_left(maxes, x, i)
            block = blocks[i]
            insort(block, x)
            if len(block) > 2 * _BLOCK:
                half = block[_BLOCK:]
                del block[_BLOCK:]
                blocks.insert(i + 1, half)
                maxes[i] = block[-1]
                maxes.insert(i + 1, half[-1])
        self._len += cut
        self._extend(xs[cut:])

    def _extend(self, xs: list[int]) -> None:
        if not xs:
            return
        self._len += len(xs)
        blocks, maxes = self._blocks, self._maxes
        if blocks and len(blocks[-1]) < _BLOCK:
            room = _BLOCK - len(blocks[-1])
            blocks[-1].extend(xs[:room])
            maxes[-1] = blocks[-1][-1]
            xs = xs[room:]
        for lo in range(0, len(xs), _BLOCK):
            block = list(xs[lo:lo + _BLOCK])
            blocks.append(block)
            maxes.append(block[-1])

    def discard_many(self, xs: list[int]) -> None:
        """Remove every x of `xs` (ascending, all present)."""
        blocks, maxes = self._blocks, self._maxes
        touched: list[int] = []
        i = 0
        for x in xs:   # a stale (larger) maximum still bounds its block: fix them after
            i = bisect_left(maxes, x, i)
            block = blocks[i]
            del block[bisect_left(block, x)]
            if not touched or touched[-1] != i:
                touched.append(i)
        self._len -= len(xs)
        for i in reversed(touched):
            if blocks[i]:
                maxes[i] = blocks[i][-1]
            else:
                del blocks[i]
                del maxes[i]

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

    def last(self) -> int | None:
        return self._maxes[-1] if self._maxes else None

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
