"""The object index: keys -> slots, object states and read leases, on one allocator.

States: an object is WRITING from prepare-store until commit (invisible to lookups and
retrieves), then READY. A READY object with leases > 0 is read-leased and never evicted or
reused; deleting it only hides it, its memory is freed when the last lease goes.

`Index` is the facade the service and the data link call (results are dataclasses,
refusals are `Refused` with a protocol error code, index_types.py). Behind it, one owner per
concern:
- here: the object tables and every change to an object's life (allocate, commit, lease,
  hide, free) and the slot invariant: a slot is freed once, when its object is neither live,
  leased nor quarantined (`_let_go`), and never given to two objects;
- pending.py: stores and leases in flight (holders, TTLs, the deadline heap, data-link
  transfers and `busy`, the fence of ended ids, quarantine pins);
- eviction.py: the LRU/FIFO/ARC order of the evictable objects, per slot size, and the victim;
- pages.py: ready objects in commit order (/cache pages, clear, drop_model), counted per
  (model, tp_rank).
The index evicts only when the allocator has no free range that fits (best fit, pool.py):
`_alloc` evicts the victim eviction.py names until one fits.
Kinds: KV chunks and captured-queries objects live in two tables (`table(kind)`),
so each kind is its own key space; otherwise they share everything (pool, states, leases,
quarantine, eviction order, pages). A queries store replaces a ready object of its key
(`prepare`); `query_objects`/`query_bytes` count the ready ones.
Counters are kept as things change (`counters`, O(1) to read; this module writes the object
and pool fields, pending.py the store/lease/quarantine fields).
Not thread-safe on its own: the service and the HTTP threads share it under one lock.
"""
from __future__ import annotations

import time
from dataclasses import fields

from kvedit.protocol import ObjectKind
from kvedit.server.eviction import EvictionOrder
from kvedit.server.index_types import (  # noqa: F401  (re-exported: the index's API)
    FINISH_GRACE, READY, WRITING, Busy, CacheEntry, Committed, Counters, Expiry, Gone, Ident,
    Kind, Leased, LeaseExpired, NotHolder, Obj, OverQuota, Page, Pending, PoolFull, Prepared,
    Quarantined, Refused, Released, Slot, StoreExpired, Transfer, UnknownLease, UnknownStore)
from kvedit.server.pages import CommitOrder
from kvedit.server.pending import Pendings
from kvedit.server.preparing import Preparing
from kvedit.server.pool import Allocator
from kvedit.server.quota import QuotaLimits
from kvedit.server.shards import KeyTable

_COUNTER_FIELDS = tuple(f.name for f in fields(Counters))


class Index:
    def __init__(self, allocator: Allocator, policy: str, lease_ttl: float, write_ttl: float,
                 *, quarantine_ttl: float | None = None, transfer_timeout: float = 120.0,
                 limits: QuotaLimits | None = None, exempt: frozenset[bytes] = frozenset(),
                 fence_gone: bool = False, clock=time.monotonic):
        self.alloc = allocator
        self.clock = clock   # monotonic seconds; tests pass a fake one
        self.policy = policy
        self.counters = Counters(pool_bytes=allocator.capacity, pool_used=allocator.used,
                                 pool_free=allocator.capacity - allocator.used)
        self.objects = KeyTable()     # live "kv" objects by key (sharded: shards.py)
        self.queries = KeyTable()     # live "queries" objects by key
        self.pending = Pendings(
            self.counters, clock, self._let_go, lease_ttl=lease_ttl, write_ttl=write_ttl,
            quarantine_ttl=(quarantine_ttl if quarantine_ttl is not None
                            else 4 * max(lease_ttl, write_ttl)),
            transfer_timeout=transfer_timeout, limits=limits, exempt=exempt,
            fence_gone=fence_gone)
        self.order = EvictionOrder(policy)
        self.pages = CommitOrder()
        self.on_evict = None   # called with an object just before eviction frees it (L2)
        self.feed = None       # told of keys that become ready or go (key_feed.py)
        # live objects of each (model, tp_rank) being written or leased: Unregister is busy
        # while any is, and asking must not walk a million objects (`droppable`)
        self._in_use: dict[tuple[str, int], int] = {}
        self.made = 0   # objects made since the start (the service's GC freezes read it)

    @property
    def stores(self) -> dict[int, Pending]:
        """Prepared stores awaiting commit, by id (read only: pending.py owns them)."""
        return self.pending.stores

    @property
    def leases(self) -> dict[int, Pending]:
        """Read leases, by id (read only: pending.py owns them)."""
        return self.pending.leases

    # ---- reads ------------------------------------------------------------------------
    def table(self, kind: ObjectKind) -> KeyTable:
        """The live objects of one kind (each kind is its own key space)."""
        return self.objects if kind == "kv" else self.queries

    def leading_ready(self, model: str, tp_rank: int, keys: list[bytes],
                      kind: ObjectKind = "kv") -> int:
        n, get = 0, self.table(kind).first(model, tp_rank, keys)
        for k in keys:
            o = get(k)
            if o is None or o.state != READY:
                break
            n += 1
        return n

    def snapshot(self) -> dict:
        """The counters and what all sessions hold (quota.py) as a dict (O(1))."""
        c = self.counters
        return {f: getattr(c, f) for f in _COUNTER_FIELDS} | self.pending.quota.snapshot()

    def page(self, model: str | None, after: int | None, limit: int) -> Page:
        """Up to `limit` ready objects (of `model`) in commit order after cursor `after`."""
        return self.pages.page(model, after, limit)

    def leased_keys(self) -> int:
        """Objects kept by all leases (quota.py's total): what leases cost in memory."""
        return self.pending.quota.total.lease_keys

    def evictable(self) -> int:
        """Objects in the eviction order (READY, live, not leased, not quarantined)."""
        return len(self.order)

    def missing(self, model: str, tp_rank: int, keys: list[bytes],
                kind: ObjectKind = "kv") -> int:
        """How many distinct keys of `keys` are neither ready nor being written: the slots a
        store of them would need."""
        have = self.table(kind).find(model, tp_rank, keys)
        return len({k for k, o in zip(keys, have) if o is None})

    def slot_bytes(self, nbytes: int) -> int:
        """The slot an object of `nbytes` takes (whole pages)."""
        return self.alloc.rounded(nbytes)

    # ---- leases -----------------------------------------------------------------------
    def lease(self, model: str, tp_rank: int, keys: list[bytes], holder: bytes,
              kind: ObjectKind = "kv", ordered: bool = False) -> Leased:
        """Lease the leading ready objects of `keys`. The lease keeps each object once (a key
        repeated in the request costs nothing more); `ordered` (a data-link retrieve) keeps
        them in key order for the GET that sends them, and ends at the first repeated key
        (the GET never needs a chunk twice, so a repeat is never counted twice).
        OverQuota (nothing leased) past the holder's or the total caps (quota.py)."""
        self.pending.admit("lease", holder, [])   # a session at its lease cap: refused cheaply
        objs, get = [], self.table(kind).first(model, tp_rank, keys)
        seen: set[Obj] | None = set() if ordered else None
        for k in keys:   # the leading ready objects
            o = get(k)
            if o is None or o.state != READY:
                break
            if seen is not None:   # a data-link GET needs no chunk twice: counted once
                if o in seen:
                    break
                seen.add(o)
            objs.append(o)
        distinct = list(dict.fromkeys(objs)) if len(objs) > 1 else objs
        kept = objs if ordered else distinct
        self.pending.admit("lease", holder, kept, distinct=distinct)   # OverQuota
        first = []   # newly leased
        for o in kept:
            if o.leases == 0:
                first.append(o)
            o.leases += 1
        self.counters.leased += len(first)
        self._use(model, tp_rank, len(first))
        self.order.leave(first)
        self.order.touch(distinct)   # LRU: their place when their last lease goes
        p = self.pending.open("lease", holder, kept, distinct=distinct)
        return Leased(p.id, objs, [o.offset for o in objs], sum(o.nbytes for o in objs))

    def release(self, lease_id: int, holder: bytes) -> Released:
        p = self.pending.idle("lease", lease_id, holder,
                              f"lease {lease_id} is being sent on the data link; the data "
                              f"link releases it when the bytes are sent")
        self.pending.close(p)
        self._unlease(p.objs)
        return Released(lease_id, sum(o.nbytes for o in p.objs), p.started)

    # ---- stores -----------------------------------------------------------------------
    def prepare(self, model: str, tp_rank: int, keys: list[bytes], nbytes: int,
                holder: bytes, kind: ObjectKind = "kv") -> Prepared:
        """Allocate WRITING objects for missing keys.

        Keys already present (ready, or being written by another store) are not written again.
        Raises PoolFull (nothing allocated) when the missing ones do not fit.
        Kind "queries" replaces: a READY object under a key is deleted first (hidden until
        its leases end, like `delete`), so the new bytes (maybe of another size) win; one
        being written by another store is still reported present.
        """
        st = self.preparing(model, tp_rank, keys, nbytes, holder, kind)
        st.run()
        return st.finish()

    def preparing(self, model: str, tp_rank: int, keys: list[bytes], nbytes: int,
                  holder: bytes, kind: ObjectKind = "kv") -> Preparing:
        """`prepare` in steps (preparing.py): `run(deadline)` until it returns True (it looks
        the keys up, admits the quota, makes the objects; OverQuota, PoolFull), then
        `finish()` (opens the store)."""
        return Preparing(self, model, tp_rank, keys, nbytes, holder, kind)

    def commit(self, store_id: int, holder: bytes) -> Committed:
        p = self.pending.idle("store", store_id, holder,
                              f"store {store_id} is still receiving its data on the data link")
        self.pending.close(p)
        objs = p.objs
        c = self.counters
        c.writing -= len(objs)
        c.ready += len(objs)
        if objs:
            self._use(objs[0].model, objs[0].tp_rank, -len(objs))
        self.order.stamp(objs)   # newest of all; FIFO keeps this place, /cache this cursor
        for o in objs:
            o.state = READY
            o.seq = o.rank
            if o.kind == "queries":
                c.query_objects += 1
                c.query_bytes += o.nbytes
        self.pages.add(objs)
        self.order.enter(objs)
        if self.feed is not None:
            self.feed.ready(objs)
        return Committed(store_id, p.objs, sum(o.nbytes for o in p.objs), p.started)

    def abort(self, store_id: int, holder: bytes) -> None:
        p = self.pending.idle("store", store_id, holder,
                              f"store {store_id} is receiving data on the data link")
        self.pending.close(p)
        for o in p.objs:
            self._forget(o)

    def delete(self, model: str, tp_rank: int, keys: list[bytes],
               kind: ObjectKind = "kv") -> int:
        n, table = 0, self.table(kind)
        for k in keys:
            o = table.get((model, tp_rank, k))
            if o is not None and o.state == READY:
                self._forget(o)
                n += 1
        return n

    def clear(self, model: str | None = None) -> int:
        """Delete every ready object (of one model): DELETE /cache. O(objects deleted)."""
        victims = self.pages.ready(model)
        for o in victims:
            self._forget(o)
        return len(victims)

    def newest_ready(self, model: str | None = None) -> int | None:
        """The commit stamp of the newest ready object (of one model); None if none."""
        return self.pages.newest(model)

    def clear_some(self, model: str | None, upto: int, limit: int, tp_rank: int | None = None,
                   cursor: int | None = None) -> tuple[int, int | None]:
        """Delete the ready objects (of `model`, of `tp_rank`) committed at or before stamp
        `upto`, looking at no more than `limit` of them after stamp `cursor` -> (how many were
        deleted, the stamp to go on from; None when none are left): DELETE /cache and
        Unregister, a slice at a time (kvedit/server/slices.py)."""
        objs, last = self.pages.after(model, cursor, limit)
        n = 0
        for o in objs:
            if o.seq > upto:
                return n, None
            if tp_rank is None or o.tp_rank == tp_rank:
                self._forget(o)
                n += 1
        return n, (last if len(objs) == limit else None)

    def droppable(self, model: str, tp_rank: int) -> int:
        """The ready objects of (model, tp_rank) (O(1)); Busy if any of its objects is leased
        or being written: Unregister waits for them."""
        busy = self._in_use.get((model, tp_rank), 0)
        if busy:
            raise Busy(f"model {model!r} tp_rank {tp_rank} has {busy} leased or in-flight "
                       f"object(s); release/commit them first")
        return self.pages.count(model, tp_rank)

    def drop_model(self, model: str, tp_rank: int) -> int:
        """Delete every object of (model, tp_rank) at once -> how many (Busy, as droppable).
        The server drops a large model a slice at a time instead (clear_some)."""
        self.droppable(model, tp_rank)
        upto, n = self.pages.newest(model), 0
        cursor: int | None = None
        while upto is not None:
            k, cursor = self.clear_some(model, upto, 4096, tp_rank, cursor)
            n += k
            if cursor is None:
                break
        return n

    # ---- data-link transfers ----------------------------------------------------------
    def begin_put(self, store_id: int, holder: bytes) -> Transfer:
        """The data link starts receiving a store's bytes: the slots to fill, in key order."""
        return self.pending.begin_transfer("store", store_id, holder)

    def finish_put(self, store_id: int, ok: bool) -> bool:
        """The PUT ended -> True if the store now awaits its Commit (answer the PUT ok).
        ok=False (peer gone, timeout) or a cut store: the store is dropped and its slots
        freed; a later Commit gets store_expired."""
        p = self.pending.finish_transfer("store", store_id)
        if p is None:
            return False
        if ok and self.pending.is_open(p):   # not cut: wait for the Commit
            self.pending.await_commit(p)
            return True
        if self.pending.is_open(p):
            self.pending.close(p, failed=True)
        for o in p.objs:   # only the server wrote them (the data link): nothing to fence
            self._forget(o)
        return False

    def begin_get(self, lease_id: int, holder: bytes) -> Transfer:
        """The data link starts sending a lease's bytes: the slots to send, in key order."""
        return self.pending.begin_transfer("lease", lease_id, holder)

    def finish_get(self, lease_id: int, ok: bool = True) -> Released | None:
        """The GET ended (sent, failed or cut): the lease is released -> Released, or None
        when it had been cut (or was not in transfer). ok=False (peer gone, idle timeout):
        a later Release from the holder gets lease_expired, as for a cut GET. Nothing is
        quarantined: only the data-link thread read the slots, and it is done."""
        p = self.pending.finish_transfer("lease", lease_id)
        if p is None:
            return None
        if not self.pending.is_open(p):   # cut: already counted as ended; only the leases
            self._unlease(p.objs)
            return None
        self.pending.close(p, failed=not ok)
        self._unlease(p.objs)
        return Released(lease_id, sum(o.nbytes for o in p.objs), p.started)

    # ---- clients and deadlines --------------------------------------------------------
    def session_gone(self, holder: bytes) -> int:
        """The holder's last socket went away: end its quarantines -> bytes freed (deleted
        objects; live ones go back to the eviction order). What it still holds is not
        quarantined when it expires."""
        return self.pending.session_gone(holder)

    def session_seen(self, holder: bytes) -> None:
        """The holder sent a request (it is connected again, if it had gone)."""
        self.pending.session_seen(holder)

    def next_deadline(self) -> float | None:
        return self.pending.next_deadline()

    def expire(self, now: float) -> Expiry:
        """Act on every deadline passed by `now`: expire stores and leases (their objects go
        to quarantine), cut transfers (their ids are returned so the data link aborts the
        socket), end quarantines."""
        stores = leases = freed = 0
        cut = []
        while (due := self.pending.pop_due(now)) is not None:
            p = due.pending
            if due.what == "quarantine":
                freed += self.pending.unquarantine(due.id)
            elif due.what == "transfer":
                self.pending.cut_transfer(p)
                if p.kind == "store":
                    for o in p.objs:
                        self._hide(o)
                cut.append(due.id)
            elif due.what == "store":
                self.pending.expire(p)
                for o in p.objs:   # the holder may still be writing into them (shm)
                    self._hide(o)
                freed += self.pending.quarantine(p, now)
                stores += 1
            else:
                self.pending.expire(p)
                freed += self.pending.quarantine(p, now)   # the holder may still read (shm)
                self._unlease(p.objs)
                leases += 1
        return Expiry(stores, leases, cut, freed)

    # ---- internals: an object's life --------------------------------------------------
    def _use(self, model: str, tp_rank: int, n: int) -> None:
        key = (model, tp_rank)
        left = self._in_use.get(key, 0) + n
        if left:
            self._in_use[key] = left
        else:
            self._in_use.pop(key, None)

    def _unlease(self, objs: list[Obj]) -> None:
        """Drop one lease on each entry of `objs` (an ordered lease may list an object more
        than once); the ones no lease holds any more are let go."""
        last = []
        for o in objs:
            o.leases -= 1
            if o.leases == 0:
                self.counters.leased -= 1
                last.append(o)
                if o.live:
                    self._use(o.model, o.tp_rank, -1)
        self._let_go(last)

    def _let_go(self, objs: list[Obj]) -> int:
        """`objs` just lost their last lease, quarantine pin or liveness: the ones neither
        leased nor pinned go back to the eviction order at their place (live) or have their
        slot freed (deleted) -> bytes freed. The one place a deleted object's slot is freed."""
        freed, back = 0, []
        for o in objs:
            if o.leases or o.pins:
                continue   # the last lease or pin to go lets it go
            if o.live:
                back.append(o)
            else:
                freed += self._free(o.offset, o.nbytes)
        if back:
            self.order.enter(back)   # at its place (FIFO: commit; LRU: last use)
        return freed

    def _hide(self, o: Obj) -> None:
        """Take the object out of every lookup, page and the eviction order (not its slot)."""
        if not o.live:
            return
        c = self.counters
        del self.table(o.kind)[o.ident]
        o.live = False
        c.objects -= 1
        if o.state != READY or o.leases:
            self._use(o.model, o.tp_rank, -1)   # a writing or leased one no longer counts
        if o.state == READY:
            c.ready -= 1
            if o.kind == "queries":
                c.query_objects -= 1
                c.query_bytes -= o.nbytes
            self.order.leave([o])
            self.pages.remove(o)
            if self.feed is not None:
                self.feed.gone(o)
        else:
            c.writing -= 1

    def _forget(self, o: Obj) -> None:
        """Hide the object; free its memory now, or when its last lease/quarantine ends."""
        self._hide(o)
        self._let_go([o])

    # ---- internals: slots -------------------------------------------------------------
    def _alloc(self, nbytes: int, count: int) -> list[int] | None:
        """`count` slots, evicting only while no free range fits the next one (the allocator
        finds any range that does); None (nothing kept) if eviction cannot make room."""
        slot = self.alloc.rounded(nbytes)
        offsets = self.alloc.alloc_many(nbytes, count)
        while len(offsets) < count:
            if not self._evict_one(slot):
                for off in offsets:
                    self.alloc.free(off, nbytes)
                return None
            offsets += self.alloc.alloc_many(nbytes, count - len(offsets))
        self.counters.pool_used += count * slot
        self.counters.pool_free -= count * slot
        return offsets

    def _evict_one(self, need: int) -> bool:
        """Evict the victim the eviction order names for a slot of `need` bytes (False: none,
        or policy "none")."""
        o = self.order.victim(need)
        if o is None:
            return False
        if self.on_evict is not None:
            self.on_evict(o)
        self.order.evicted(o)
        self._forget(o)
        self.counters.evictions += 1
        return True

    def _free(self, offset: int, nbytes: int) -> int:
        self.alloc.free(offset, nbytes)
        n = self.alloc.rounded(nbytes)
        self.counters.pool_used -= n
        self.counters.pool_free += n
        return n
