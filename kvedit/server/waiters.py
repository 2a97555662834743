"""Parked lookups: Lookup(wait_timeout > 0) replies held until their keys are ready.

A waiter sits under its first missing key only, so a commit wakes just the waiters it can
help (each then counts again and re-parks under its next missing key). Deadlines live in a
heap; the service answers a waiter when it is complete or when its deadline passes.

Bounded: at most `max_per_client` parked lookups per client (holder), `max_total` in all, and
`max_keys` keys over all parked lookups (their memory; `add` raises TooManyWaits, the service's
`too_many_waits`); a client whose last socket is
gone has its lookups dropped (`drop_client`), so a vanished peer holds nothing until its
deadlines. Every count is kept as waiters come and go (len() is O(1)).

A parked lookup keeps its keys packed in one buffer (`PackedKeys`), not as the decoded list
of small bytes objects: a million parked keys as objects spread over Python's small-object
arenas, and the few long-lived objects made meanwhile kept those arenas from ever going back
to the OS after the lookups ended (docs/protocol.md, "Observations behind the data path").
One buffer per lookup is freed whole.
"""
from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import msgspec

from kvedit import protocol as P
from kvedit.protocol import ErrorCode

Ident = tuple[str, int, bytes] | tuple[str, int, bytes, str]
STALE_ENTRIES = 64   # stale deadline entries kept before a compaction (each holds its keys)


def wait_key(model: str, tp_rank: int, key: bytes, kind: str = "kv") -> Ident:
    """What a waiter parks on: (model, tp_rank, key), plus the object kind for kinds other
    than "kv" (each kind is its own key space, see kvedit.protocol.ObjectKind)."""
    return (model, tp_rank, key) if kind == "kv" else (model, tp_rank, key, kind)


class TooManyWaits(Exception):
    code: ClassVar[ErrorCode] = "too_many_waits"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class PackedKeys(Sequence[bytes]):
    """A lookup's keys in one bytes buffer and an array of their ends (module doc)."""
    __slots__ = ("_buf", "_ends")

    def __init__(self, keys: list[bytes]):
        self._buf = b"".join(keys)
        self._ends = array("I", itertools.accumulate(map(len, keys)))

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        start = self._ends[i - 1] if i else 0
        return self._buf[start:self._ends[i]]

    def __iter__(self) -> Iterator[bytes]:
        start = 0
        for end in self._ends:
            yield self._buf[start:end]
            start = end


@dataclass(slots=True, eq=False)
class Waiter:
    ident: bytes          # ROUTER identity of the client socket (where the reply goes)
    rid: bytes            # its request id
    req: P.Lookup
    deadline: float
    holder: bytes = b""   # the client session (counted against max_per_client); "" = ident
    parked_on: Ident | None = None
    queued: bool = False  # has an entry in the deadline heap

    def __post_init__(self):
        if not self.holder:
            self.holder = self.ident
        if not isinstance(self.req.keys, PackedKeys):
            self.req = msgspec.structs.replace(self.req, keys=PackedKeys(self.req.keys))


class Waiters:
    def __init__(self, max_per_client: int = 1024, max_total: int = 16384,
                 max_keys: int = 1 << 22):
        self.max_per_client = max_per_client
        self.max_total = max_total
        self.max_keys = max_keys
        self.keys = 0   # keys of all parked lookups
        self._by_key: dict[Ident, list[Waiter]] = {}
        self._by_holder: dict[bytes, dict[Waiter, None]] = {}   # parked ones, per client
        self._n = 0
        self._deadlines: list[tuple[float, int, Waiter]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._n

    def count(self, holder: bytes) -> int:
        """Parked lookups of one client."""
        return len(self._by_holder.get(holder, ()))

    def add(self, w: Waiter, first_missing: int) -> None:
        """Park a new lookup under its first missing key; TooManyWaits past a bound."""
        mine = self.count(w.holder)
        if mine >= self.max_per_client:
            raise TooManyWaits(f"this client already has {mine} parked lookups (the server's "
                               f"--max-waits-per-client is {self.max_per_client}); wait for "
                               f"them or use wait_timeout=0")
        if self._n >= self.max_total:
            raise TooManyWaits(f"the server already holds {self._n} parked lookups "
                               f"(--max-waits-total {self.max_total}); retry later or use "
                               f"wait_timeout=0")
        if self.keys + len(w.req.keys) > self.max_keys:
            raise TooManyWaits(f"the server's parked lookups already hold {self.keys} keys and "
                               f"this one has {len(w.req.keys)} (--max-parked-keys "
                               f"{self.max_keys}); retry later or use wait_timeout=0")
        self.park(w, first_missing)

    def park(self, w: Waiter, first_missing: int) -> None:
        """(Re-)park a waiter taken by `take` under its next missing key (not bounded again:
        it was admitted by `add`)."""
        w.parked_on = wait_key(w.req.model, w.req.tp_rank, w.req.keys[first_missing],
                               w.req.kind)
        self._by_key.setdefault(w.parked_on, []).append(w)
        self._by_holder.setdefault(w.holder, {})[w] = None
        self._n += 1
        self.keys += len(w.req.keys)
        if not w.queued:   # a new waiter, or its entry was dropped while it was taken
            self._push(w)

    def take(self, ident: Ident) -> list[Waiter]:
        """The waiters parked on a key that just became ready (unparked: answer or re-park)."""
        ws = self._by_key.pop(ident, [])
        for w in ws:
            self._unpark(w)
        return ws

    def drop_client(self, holder: bytes) -> list[Waiter]:
        """Forget every parked lookup of a client that went away -> those lookups."""
        ws = list(self._by_holder.get(holder, ()))
        for w in ws:
            parked = self._by_key[w.parked_on]
            parked.remove(w)
            if not parked:
                del self._by_key[w.parked_on]
            self._unpark(w)
        self._compact()
        return ws

    def next_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0][2].parked_on is None:
            heapq.heappop(self._deadlines)[2].queued = False  # answered or dropped already
        return self._deadlines[0][0] if self._deadlines else None

    def expired(self, now: float) -> list[Waiter]:
        """Unpark and return the waiters whose deadline has passed."""
        out = []
        while (d := self.next_deadline()) is not None and d <= now:
            w = heapq.heappop(self._deadlines)[2]
            w.queued = False
            parked = self._by_key[w.parked_on]
            parked.remove(w)
            if not parked:
                del self._by_key[w.parked_on]
            self._unpark(w)
            out.append(w)
        return out

    def _unpark(self, w: Waiter) -> None:
        w.parked_on = None
        mine = self._by_holder[w.holder]
        del mine[w]
        if not mine:
            del self._by_holder[w.holder]
        self._n -= 1
        self.keys -= len(w.req.keys)

    def _push(self, w: Waiter) -> None:
        heapq.heappush(self._deadlines, (w.deadline, next(self._seq), w))
        w.queued = True
        self._compact()

    def _compact(self) -> None:
        """Answered and dropped waiters leave stale heap entries, and each keeps its lookup's
        keys alive: drop them once they outnumber the parked ones (plus a few)."""
        h = self._deadlines
        if len(h) <= 2 * self._n + STALE_ENTRIES:
            return
        keep = []
        for e in h:
            if e[2].parked_on is not None:
                keep.append(e)
            else:
                e[2].queued = False
        heapq.heapify(keep)
        self._deadlines = keep
