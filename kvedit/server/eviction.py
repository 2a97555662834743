"""The eviction order: which ready object a store may evict next (LRU or FIFO), per slot size.

Why a module of its own: "evicting is O(log n) whatever is leased" rests on one rule, kept
here and nowhere else: the order holds only evictable objects (READY, live, not leased, not
quarantined). A leased object leaves it at its first lease and re-enters at its place at its
last release (or at the end of its quarantine); in-flight (WRITING) objects never enter it.
So a store never walks past leased objects to find a victim.

Places are ranks from one clock (`stamp`): FIFO stamps an object once, at commit; LRU stamps
it again whenever it is used (leased, or reported present by a store). The index reuses the
commit stamp as the object's /cache cursor (`Obj.seq`), so both orders share the clock.

The order is kept per slot size (one per layout; few): a store evicts the oldest object
whose slot fits it, so a large chunk does not evict many small ones that free no large range.
This module only orders and picks; the index decides when to evict (the allocator has no free
range that fits, pool.py) and forgets the victim (index.py). It writes `Obj.rank` and
`Obj.evictable`, and nothing else of an object.
"""
from __future__ import annotations

from bisect import bisect_left, insort

from kvedit.server.index_types import READY, Obj
from kvedit.server.ordered import SortedInts


class EvictionOrder:
    def __init__(self, policy: str):
        self.policy = policy                            # "LRU", "FIFO" or "none" (config.py)
        self._lru = policy == "LRU"
        self._tick = 1                                  # the next rank
        self._by_size: dict[int, SortedInts] = {}       # slot size -> ranks in the order
        self._sizes: list[int] = []                     # its keys, ascending
        self._by_rank: dict[int, Obj] = {}

    def __len__(self) -> int:
        """Objects in the order (evictable now)."""
        return len(self._by_rank)

    def stamp(self, objs: list[Obj]) -> None:
        """Give `objs` (none of them in the order) consecutive new ranks, in list order: the
        newest places of all."""
        base = self._tick
        self._tick += len(objs)
        for j, o in enumerate(objs):
            o.rank = base + j

    def touch(self, objs: list[Obj]) -> None:
        """`objs` (none of them in the order) were just used: LRU moves their place to the
        most recently used end; FIFO keeps it (their commit)."""
        if self._lru:
            self.stamp(objs)

    def enter(self, objs: list[Obj]) -> None:
        """Put the evictable ones of `objs` (live, READY, unleased, unpinned) in the order at
        their rank: one batch per slot size (a store or a lease is one or few sizes)."""
        by_slot: dict[int, list[int]] = {}
        by_rank = self._by_rank
        last, ranks = -1, []
        for o in objs:
            if o.live and o.state == READY and not o.leases and not o.pins \
                    and not o.evictable:
                o.evictable = True
                by_rank[o.rank] = o
                if o.slot != last:   # objects of one store/lease share a slot size
                    last = o.slot
                    ranks = by_slot.setdefault(last, [])
                ranks.append(o.rank)
        for slot, ranks in by_slot.items():
            order = self._by_size.get(slot)
            if order is None:
                order = self._by_size[slot] = SortedInts()
                insort(self._sizes, slot)
            ranks.sort()
            order.update(ranks)

    def leave(self, objs: list[Obj]) -> None:
        """Take `objs` out of the order (those in it)."""
        by_slot: dict[int, list[int]] = {}
        by_rank = self._by_rank
        last, ranks = -1, []
        for o in objs:
            if o.evictable:
                o.evictable = False
                del by_rank[o.rank]
                if o.slot != last:   # objects of one store/lease share a slot size
                    last = o.slot
                    ranks = by_slot.setdefault(last, [])
                ranks.append(o.rank)
        for slot, ranks in by_slot.items():
            order = self._by_size[slot]
            ranks.sort()
            order.discard_many(ranks)
            if not order:
                del self._by_size[slot]
                del self._sizes[bisect_left(self._sizes, slot)]

    def victim(self, need: int) -> Obj | None:
        """The oldest (LRU: least recently used) object in the order whose own slot takes
        `need` bytes; if there is none, the oldest of all (the caller evicts it and retries
        until a range fits); None when the order is empty or the policy is "none". Several
        layouts share the pool: evicting the oldest object of any size could free many small
        slots, none adjacent, before one large range appears, hence one order per size.
        Leased and in-flight objects are in no order: nothing is walked past."""
        if self.policy == "none":
            return None
        sizes = self._sizes
        fitting = [self._by_size[s].first() for s in sizes[bisect_left(sizes, need):]]
        rank = min(fitting, default=None)
        if rank is None:
            rank = min((self._by_size[s].first() for s in sizes), default=None)
            if rank is None:
                return None
        return self._by_rank[rank]
