"""The eviction order: which ready object a store may evict next (LRU, FIFO or ARC), per slot size.

Why a module of its own: "evicting is O(log n) whatever is leased" rests on one rule, kept
here and nowhere else: the order holds only evictable objects (READY, live, not leased, not
quarantined). A leased object leaves it at its first lease and re-enters at its place at its
last release (or at the end of its quarantine); in-flight (WRITING) objects never enter it.
So a store never walks past leased objects to find a victim.

Places are ranks from one clock (`stamp`): FIFO stamps an object once, at commit; LRU stamps
it again whenever it is used (leased, or reported present by a store). ARC (adaptive
replacement: Megiddo and Modha) keeps two queues, each in LRU order: objects used once since
they entered (T1, recency) and objects used again (T2, frequency); it remembers the keys it
evicted from each (ghosts B1, B2: keys only, bounded) and moves its target size for T1 up
when a key evicted from T1 is stored again (recency would have kept it) and down when one
evicted from T2 is. So one pass of many new prefixes (a scan) evicts other new prefixes, not
the shared prefixes that are hit again and again. The index reuses the commit stamp as the
object's /cache cursor (`Obj.seq`), so every order shares the clock.

Each queue is kept per slot size (one per layout; few): a store evicts the oldest object
whose slot fits it, so a large chunk does not evict many small ones that free no large range.
This module only orders and picks; the index decides when to evict (the allocator has no free
range that fits, pool.py), reports the victim it evicted (`evicted`: ARC's ghosts) and forgets
it (index.py). It writes `Obj.rank`, `Obj.hot` and `Obj.evictable`, and nothing else of an
object. Every operation is O(log n) (SortedInts) or O(1) (ghosts: ordered dicts).
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict

from kvedit.server.index_types import READY, Obj
from kvedit.server.ordered import SortedInts
from kvedit.server.shards import IntMap

MIN_GHOSTS = 1024   # ARC remembers at least this many evicted keys per ghost list


class _Queue:
    """Ranks of the evictable objects of one queue, one sorted set per slot size."""
    __slots__ = ("by_size", "sizes", "n")

    def __init__(self):
        self.by_size: dict[int, SortedInts] = {}   # slot size -> ranks
        self.sizes: list[int] = []                 # its keys, ascending
        self.n = 0

    def add(self, slot: int, ranks: list[int]) -> None:
        order = self.by_size.get(slot)
        if order is None:
            order = self.by_size[slot] = SortedInts()
            insort(self.sizes, slot)
        ranks.sort()
        order.update(ranks)
        self.n += len(ranks)

    def discard(self, slot: int, ranks: list[int]) -> None:
        order = self.by_size[slot]
        ranks.sort()
        order.discard_many(ranks)
        self.n -= len(ranks)
        if not order:
            del self.by_size[slot]
            del self.sizes[bisect_left(self.sizes, slot)]

    def oldest(self, need: int, fitting: bool) -> int | None:
        """The smallest rank among the sizes that take `need` bytes (fitting) or all."""
        sizes = self.sizes[bisect_left(self.sizes, need):] if fitting else self.sizes
        return min((self.by_size[s].first() for s in sizes), default=None)


class EvictionOrder:
    def __init__(self, policy: str):
        self.policy = policy                            # "LRU", "FIFO", "ARC" or "none"
        self._restamp = policy in ("LRU", "ARC")        # a use moves an object's place
        self._arc = policy == "ARC"
        self._tick = 1                                  # the next rank
        self._queues = (_Queue(), _Queue())             # T1 (used once), T2 (used again)
        self._by_rank = IntMap()   # sharded: one big dict rebuilt in one go (shards.py)
        # ARC: ghosts of evicted objects (key -> None, oldest first) and T1's target size
        self._ghosts: tuple[OrderedDict, OrderedDict] = (OrderedDict(), OrderedDict())
        self.target = 0.0
        self._high = 0                                  # most objects ever in the order

    def __len__(self) -> int:
        """Objects in the order (evictable now)."""
        t1, t2 = self._queues
        return t1.n + t2.n

    def stamp(self, objs: list[Obj]) -> None:
        """Give `objs` (none of them in the order; committed now) consecutive new ranks, in
        list order: the newest places of all. ARC: a key it evicted before comes back hot
        (T2) and moves T1's target (up for a T1 ghost, down for a T2 ghost)."""
        base = self._tick
        self._tick += len(objs)
        for j, o in enumerate(objs):
            o.rank = base + j
            if self._arc:
                self._unghost(o)

    def touch(self, objs: list[Obj]) -> None:
        """`objs` (none of them in the order) were just used: LRU and ARC move their place to
        the most recently used end (ARC: into T2); FIFO keeps it (their commit)."""
        if self._restamp:
            base = self._tick
            self._tick += len(objs)
            for j, o in enumerate(objs):
                o.rank = base + j
                o.hot = self._arc

    def enter(self, objs: list[Obj]) -> None:
        """Put the evictable ones of `objs` (live, READY, unleased, unpinned) in the order at
        their rank: one batch per queue and slot size (a store or a lease is one or few)."""
        batches: dict[tuple[bool, int], list[Obj]] = {}
        for o in objs:
            if o.live and o.state == READY and not o.leases and not o.pins \
                    and not o.evictable:
                o.evictable = True
                batches.setdefault((o.hot, o.slot), []).append(o)
        for batch in batches.values():
            self._by_rank.put(batch)
        for (hot, slot), batch in batches.items():
            self._queues[hot].add(slot, [o.rank for o in batch])
        self._high = max(self._high, len(self))

    def leave(self, objs: list[Obj]) -> None:
        """Take `objs` out of the order (those in it)."""
        batches: dict[tuple[bool, int], list[int]] = {}
        by_rank = self._by_rank
        for o in objs:
            if o.evictable:
                o.evictable = False
                del by_rank[o.rank]
                batches.setdefault((o.hot, o.slot), []).append(o.rank)
        for (hot, slot), ranks in batches.items():
            self._queues[hot].discard(slot, ranks)

    def victim(self, need: int) -> Obj | None:
        """The oldest (LRU: least recently used) object in the order whose own slot takes
        `need` bytes; if there is none, the oldest of all (the caller evicts it and retries
        until a range fits); None when the order is empty or the policy is "none". Several
        layouts share the pool: evicting the oldest object of any size could free many small
        slots, none adjacent, before one large range appears, hence one order per size.
        ARC looks in T1 first while T1 is over its target (else in T2), then in the other.
        Leased and in-flight objects are in no order: nothing is walked past."""
        if self.policy == "none":
            return None
        t1, t2 = self._queues
        first = 0 if t1.n and (t1.n > self.target or not t2.n) else 1
        queues = (self._queues[first], self._queues[1 - first])
        for fitting in (True, False):
            for q in queues:
                rank = q.oldest(need, fitting)
                if rank is not None:
                    return self._by_rank[rank]
        return None

    def evicted(self, o: Obj) -> None:
        """The index evicts `o` (the victim, still in the order): ARC remembers its key."""
        if not self._arc:
            return
        ghosts = self._ghosts[o.hot]
        ghosts[(o.kind, o.ident)] = None
        while len(ghosts) > max(MIN_GHOSTS, self._high):
            ghosts.popitem(last=False)

    def _unghost(self, o: Obj) -> None:
        """A committed object whose key ARC evicted before: hot, and T1's target adapts."""
        g = (o.kind, o.ident)
        b1, b2 = self._ghosts
        if g in b1:   # (the ratios are taken before the ghost goes, as ARC's are)
            self.target = min(float(self._high), self.target + max(1.0, len(b2) / len(b1)))
            del b1[g]
            o.hot = True
        elif g in b2:
            self.target = max(0.0, self.target - max(1.0, len(b1) / len(b2)))
            del b2[g]
            o.hot = True
