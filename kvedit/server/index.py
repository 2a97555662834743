"""The object index: keys -> slots, object states, read leases, pending stores and eviction.

States: an object is WRITING from prepare-store until commit (invisible to lookups and
retrieves), then READY. A READY object with leases > 0 is read-leased and never evicted or
reused; deleting it only hides it, its memory is freed when the last lease goes. Prepared
stores and leases carry deadlines (write/lease TTL), so a crashed client cannot leak slots.
Not thread-safe on its own: the service and the HTTP threads share it under one lock.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvedit.server.pool import Allocator

WRITING, READY = "writing", "ready"


@dataclass(slots=True, eq=False)
class Obj:
    model: str
    tp_rank: int
    key: bytes
    offset: int
    nbytes: int
    state: str = WRITING
    created: float = field(default_factory=time.time)
    leases: int = 0
    live: bool = True        # False once evicted/deleted/aborted: hidden, freed at last lease

    @property
    def ident(self) -> tuple[str, int, bytes]:
        return (self.model, self.tp_rank, self.key)


@dataclass(slots=True)
class Pending:
    """A prepared store or a read lease: objects plus deadline."""
    objs: list[Obj]
    deadline: float
    started: float
    busy: bool = False   # bytes moving on the data link: expiry waits for it


class PoolFull(Exception):
    pass


class Index:
    def __init__(self, allocator: Allocator, policy: str, lease_ttl: float, write_ttl: float):
        self.alloc = allocator
        self.policy = policy
        self.lease_ttl = lease_ttl
        self.write_ttl = write_ttl
        self.objects: dict[tuple[str, int, bytes], Obj] = {}
        self.ready: OrderedDict[tuple[str, int, bytes], Obj] = OrderedDict()  # eviction order
        self.stores: dict[int, Pending] = {}
        self.leases: dict[int, Pending] = {}
        self._deadlines: list[tuple[float, int, bool]] = []  # (deadline, id, is_lease)
        self._ids = itertools.count(1)
        self.evictions = 0
        self.expired_leases = 0
        self.expired_stores = 0

    # ---- reads ------------------------------------------------------------------------
    def leading_ready(self, model: str, tp_rank: int, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            o = self.objects.get((model, tp_rank, k))
            if o is None or o.state != READY:
                break
            n += 1
        return n

    def lease(self, model: str, tp_rank: int, keys: list[bytes]) -> tuple[int, list[Obj]]:
        objs = [self.objects[(model, tp_rank, k)]
                for k in keys[: self.leading_ready(model, tp_rank, keys)]]
        for o in objs:
            o.leases += 1
            self._touch(o)
        lid = next(self._ids)
        now = time.monotonic()
        self.leases[lid] = Pending(objs, now + self.lease_ttl, now)
        heapq.heappush(self._deadlines, (now + self.lease_ttl, lid, True))
        return lid, objs

    def release(self, lease_id: int) -> Pending:
        p = self.leases.pop(lease_id)  # KeyError: unknown or expired
        for o in p.objs:
            o.leases -= 1
            if not o.live and o.leases == 0:
                self.alloc.free(o.offset, o.nbytes)
        return p

    # ---- writes -----------------------------------------------------------------------
    def prepare(self, model: str, tp_rank: int, keys: list[bytes], nbytes: int
                ) -> tuple[int, list[int], list[int], int]:
        """Allocate WRITING objects for missing keys -> (store_id, missing, offsets, present).

        Keys already present (ready, or being written by another store) are not written again.
        Raises PoolFull (nothing allocated) when the missing ones do not fit.
        """
        have = [self.objects.get((model, tp_rank, k)) for k in keys]
        pinned = [o for o in have if o is not None]
        for o in pinned:  # what we report present must survive this store's own evictions
            o.leases += 1
            self._touch(o)
        missing, objs = [], []
        try:
            for i, k in enumerate(keys):
                if have[i] is not None or (model, tp_rank, k) in self.objects:  # or a duplicate
                    continue
                off = self._alloc(nbytes)
                if off is None:
                    for o in objs:
                        self._forget(o)
                    raise PoolFull(
                        f"{len(keys) - len(pinned) - len(objs)} more chunk(s) of {nbytes} bytes "
                        f"do not fit: {self.alloc.used} of {self.alloc.capacity} bytes in use "
                        f"and nothing evictable (eviction policy {self.policy}; leased and "
                        f"in-flight objects are not evictable)")
                o = Obj(model, tp_rank, k, off, nbytes)
                self.objects[o.ident] = o
                objs.append(o)
                missing.append(i)
        finally:
            for o in pinned:  # nothing can have deleted them meanwhile (we hold the lock)
                o.leases -= 1
        present = len(keys) - len(missing)
        sid = next(self._ids)
        now = time.monotonic()
        self.stores[sid] = Pending(objs, now + self.write_ttl, now)
        heapq.heappush(self._deadlines, (now + self.write_ttl, sid, False))
        return sid, missing, [o.offset for o in objs], present

    def commit(self, store_id: int) -> Pending:
        p = self.stores.pop(store_id)  # KeyError: unknown or expired
        for o in p.objs:
            o.state = READY
            self.ready[o.ident] = o
        return p

    def abort(self, store_id: int) -> None:
        for o in self.stores.pop(store_id).objs:  # KeyError: unknown or expired
            self._forget(o)

    def delete(self, model: str, tp_rank: int, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            o = self.objects.get((model, tp_rank, k))
            if o is not None and o.state == READY:
                self._forget(o)
                n += 1
        return n

    def clear(self, model: str | None = None) -> int:
        """Delete every ready object (of one model): DELETE /cache."""
        victims = [o for o in self.ready.values() if model is None or o.model == model]
        for o in victims:
            self._forget(o)
        return len(victims)

    # ---- deadlines --------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        while self._deadlines:
            deadline, pid, is_lease = self._deadlines[0]
            if pid in (self.leases if is_lease else self.stores):
                return deadline
            heapq.heappop(self._deadlines)  # already released / committed
        return None

    def expire(self, now: float) -> None:
        while (d := self.next_deadline()) is not None and d <= now:
            _, pid, is_lease = heapq.heappop(self._deadlines)
            p = (self.leases if is_lease else self.stores)[pid]
            if p.busy:  # look again in a second; freeing slots mid-transfer would tear them
                heapq.heappush(self._deadlines, (now + 1.0, pid, is_lease))
                continue
            if is_lease:
                self.release(pid)
                self.expired_leases += 1
            else:
                self.abort(pid)
                self.expired_stores += 1

    # ---- internals --------------------------------------------------------------------
    def _touch(self, o: Obj) -> None:
        if self.policy == "LRU" and o.state == READY:
            self.ready.move_to_end(o.ident)

    def _alloc(self, nbytes: int) -> int | None:
        while (off := self.alloc.alloc(nbytes)) is None:
            if self.policy == "none" or not self._evict_one():
                return None
        return off

    def _evict_one(self) -> bool:
        for o in self.ready.values():   # oldest first (LRU: least recently used)
            if o.leases == 0:
                self._forget(o)
                self.evictions += 1
                return True
        return False

    def _forget(self, o: Obj) -> None:
        """Hide the object; free its memory now, or when its last lease is released."""
        self.objects.pop(o.ident, None)
        self.ready.pop(o.ident, None)
        o.live = False
        if o.leases == 0:
            self.alloc.free(o.offset, o.nbytes)

    def counts(self) -> dict[str, int]:
        ready = len(self.ready)
        return {"objects": len(self.objects), "ready": ready,
                "writing": len(self.objects) - ready,
                "leased": sum(1 for o in self.ready.values() if o.leases),
                "leases": len(self.leases), "pending_stores": len(self.stores)}
