"""Parked lookups: Lookup(wait_timeout > 0) replies held until their keys are ready.

A waiter sits under its first missing key only, so a commit wakes just the waiters it can
help (each then counts again and re-parks under its next missing key). Deadlines live in a
heap; the service answers a waiter when it is complete or when its deadline passes.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from kvedit import protocol as P


@dataclass(slots=True, eq=False)
class Waiter:
    ident: bytes          # ROUTER identity of the client
    rid: bytes            # its request id
    req: P.Lookup
    deadline: float
    parked_on: tuple[str, int, bytes] | None = None


class Waiters:
    def __init__(self):
        self._by_key: dict[tuple[str, int, bytes], list[Waiter]] = {}
        self._deadlines: list[tuple[float, int, Waiter]] = []
        self._seq = itertools.count()

    def add(self, w: Waiter, first_missing: int) -> None:
        self.park(w, first_missing)
        heapq.heappush(self._deadlines, (w.deadline, next(self._seq), w))

    def park(self, w: Waiter, first_missing: int) -> None:
        w.parked_on = (w.req.model, w.req.tp_rank, w.req.keys[first_missing])
        self._by_key.setdefault(w.parked_on, []).append(w)

    def take(self, ident: tuple[str, int, bytes]) -> list[Waiter]:
        """The waiters parked on a key that just became ready (unparked)."""
        ws = self._by_key.pop(ident, [])
        for w in ws:
            w.parked_on = None
        return ws

    def next_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0][2].parked_on is None:
            heapq.heappop(self._deadlines)  # answered already
        return self._deadlines[0][0] if self._deadlines else None

    def expired(self, now: float) -> list[Waiter]:
        """Unpark and return the waiters whose deadline has passed."""
        out = []
        while (d := self.next_deadline()) is not None and d <= now:
            w = heapq.heappop(self._deadlines)[2]
            parked = self._by_key.get(w.parked_on, [])
            parked.remove(w)
            if not parked:
                self._by_key.pop(w.parked_on, None)
            w.parked_on = None
            out.append(w)
        return out

    def __len__(self) -> int:
        return sum(len(ws) for ws in self._by_key.values())
