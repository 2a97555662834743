"""The object index: keys -> slots, object states, read leases, pending stores, eviction, fence.

States: an object is WRITING from prepare-store until commit (invisible to lookups and
retrieves), then READY. A READY object with leases > 0 is read-leased and never evicted or
reused; deleting it only hides it, its memory is freed when the last lease goes. Prepared
stores and leases carry deadlines (write/lease TTL), so a crashed client cannot leak slots.

The index is the one owner of these invariants; the service and the data link call only the
methods below (results are dataclasses, refusals are `Refused` with a protocol error code):
- Holders: every store and lease records the client session (`holder`) that made it; commit,
  abort, release and the data-link begin_put/begin_get from anyone else are `not_holder`.
  Ids are `secrets.randbits(63)`: unguessable, unique among live and recently ended ids.
- Fence: a store or lease that expires, or whose data-link transfer fails or is cut, is
  remembered (a bounded table of recently ended ids), so a late commit/abort/release gets
  `store_expired`/`lease_expired`, not `unknown_*`. The objects of an expired store or lease
  go to quarantine: each gets a pin (`Obj.pins`) that keeps it out of the eviction order and
  its slot allocated (a delete only hides it, as under a lease) until the holder acknowledges
  (that late commit/abort/release), its session is gone (`session_gone`), or `quarantine_ttl`
  passes; then a live one goes back to the eviction order and a deleted one is freed. So a
  late shm writer scribbles only on memory nobody else owns, and a late shm reader reads the
  key's bytes or freed-but-unused memory, never another key's new bytes.
  `counters.quarantined_objects` counts the distinct objects with a pin (live or deleted, even
  if leased anew meanwhile), `quarantined_bytes` their slot bytes.
- Transfers: `begin_put`/`begin_get` mark a store/lease as moving bytes on the data link; it is
  not expired under the transfer, and commit/abort/release answer `busy`. When the transfer's
  own deadline passes, `expire` cuts it (the id is returned so the data link aborts the
  socket); `finish_put`/`finish_get` then free its slots.
- Eviction order (LRU or FIFO) holds only evictable objects (READY, live, not leased, not
  quarantined): a leased object leaves it at its first lease and re-enters at its place at its
  last release (or at the end of its quarantine, if that lease expired), and
  in-flight (WRITING) objects are never in it. So evicting is O(log n) whatever is leased.
  It is kept per slot size (one per layout): a store evicts the oldest object whose slot
  fits it, so a large chunk does not evict many small ones that free no large range. The
  index evicts only when the allocator has no free range that fits (best fit, pool.py).
- Kinds: KV chunks and captured-queries objects (issue 10) live in two tables (`table(kind)`),
  so each kind is its own key space; otherwise they share everything above (pool, states,
  leases, quarantine, eviction order, pages). A queries store replaces a ready object of its
  key (`prepare`); `query_objects`/`query_bytes` count the ready ones.
- Counters are kept as things change (`counters`, O(1) to read); ready objects are also kept
  in commit order, so a page of /cache costs O(page), not a scan.
Not thread-safe on its own: the service and the HTTP threads share it under one lock.
"""
from __future__ import annotations

import heapq
import itertools
import secrets
from bisect import bisect_left, insort
import time
from collections import OrderedDict
from dataclasses import fields

from kvedit.protocol import ObjectKind
from kvedit.server import index_types as T
from kvedit.server.index_types import (  # noqa: F401  (re-exported: the index's API)
    FINISH_GRACE, READY, WRITING, Busy, CacheEntry, Committed, Counters, Expiry, Gone, Ident,
    Kind, Leased, LeaseExpired, NotHolder, Obj, Page, Pending, PoolFull, Prepared, Quarantined,
    Refused, Released, Slot, StoreExpired, Transfer, UnknownLease, UnknownStore)
from kvedit.server.ordered import SortedInts
from kvedit.server.pool import Allocator

_COUNTER_FIELDS = tuple(f.name for f in fields(Counters))


# ---- the index --------------------------------------------------------------------------
class Index:
    def __init__(self, allocator: Allocator, policy: str, lease_ttl: float, write_ttl: float,
                 *, quarantine_ttl: float | None = None, transfer_timeout: float = 120.0,
                 clock=time.monotonic):
        self.alloc = allocator
        self.clock = clock   # monotonic seconds; tests pass a fake one
        self.policy = policy
        self.lease_ttl = lease_ttl
        self.write_ttl = write_ttl
        self.quarantine_ttl = (quarantine_ttl if quarantine_ttl is not None
                               else 4 * max(lease_ttl, write_ttl))
        self.transfer_timeout = transfer_timeout
        self.counters = Counters(pool_bytes=allocator.capacity, pool_used=allocator.used,
                                 pool_free=allocator.capacity - allocator.used)
        self.objects: dict[Ident, Obj] = {}               # live "kv" objects by key
        self.queries: dict[Ident, Obj] = {}               # live "queries" objects by key
        self.stores: dict[int, Pending] = {}
        self.leases: dict[int, Pending] = {}
        self._cut: dict[int, Pending] = {}                # cut transfers awaiting finish_*
        self._gone: OrderedDict[int, Gone] = OrderedDict()
        self._quarantine: dict[int, Quarantined] = {}     # by store/lease id
        self._q_by_holder: dict[bytes, set[int]] = {}
        self._deadlines: list[tuple[float, int, str, int]] = []  # (when, tiebreak, what, id)
        self._tiebreak = itertools.count()
        self._tick = 1                                    # next seq / LRU rank
        self._evict: dict[int, SortedInts] = {}           # slot size -> evictable ranks
        self._evict_sizes: list[int] = []                 # its keys, ascending
        self._by_rank: dict[int, Obj] = {}
        self._pages = SortedInts()                        # seqs of ready objects
        self._model_pages: dict[str, SortedInts] = {}
        self._by_seq: dict[int, Obj] = {}
        self.on_evict = None   # called with an object just before eviction frees it (L2)

    # ---- reads ------------------------------------------------------------------------
    def leading_ready(self, model: str, tp_rank: int, keys: list[bytes],
                      kind: ObjectKind = "kv") -> int:
        n, table = 0, self.table(kind)
        for k in keys:
            o = table.get((model, tp_rank, k))
            if o is None or o.state != READY:
                break
            n += 1
        return n

    def snapshot(self) -> dict:
        """The counters as a dict (O(1): a fixed number of fields)."""
        c = self.counters
        return {f: getattr(c, f) for f in _COUNTER_FIELDS}

    def page(self, model: str | None, after: int | None, limit: int) -> Page:
        """Up to `limit` ready objects (of `model`) in commit order after cursor `after`."""
        seqs = self._pages if model is None else self._model_pages.get(model)
        if seqs is None:
            return Page([], None, 0)
        items = []
        for s in seqs.after(after):
            if len(items) == limit:
                return Page(items, items[-1].seq, len(seqs))
            o = self._by_seq[s]
            items.append(CacheEntry(o.seq, o.model, o.tp_rank, o.key, o.nbytes, o.created,
                                    o.leases, o.kind))
        return Page(items, None, len(seqs))

    # ---- leases -----------------------------------------------------------------------
    def table(self, kind: ObjectKind) -> dict[Ident, Obj]:
        """The live objects of one kind (each kind is its own key space)."""
        return self.objects if kind == "kv" else self.queries

    def lease(self, model: str, tp_rank: int, keys: list[bytes], holder: bytes,
              kind: ObjectKind = "kv") -> Leased:
        objs, get = [], self.table(kind).get
        for k in keys:   # the leading ready objects
            o = get((model, tp_rank, k))
            if o is None or o.state != READY:
                break
            objs.append(o)
        first = []   # newly leased (a key may repeat in one request)
        for o in objs:
            if o.leases == 0:
                first.append(o)
            o.leases += 1
        self.counters.leased += len(first)
        self._leave_order(first)
        if self.policy == "LRU":   # touched: their place when their last lease goes
            base = self._ticks(len(objs))
            for j, o in enumerate(objs):
                o.rank = base + j
        p = self._new_pending("lease", holder, objs, self.lease_ttl)
        self.leases[p.id] = p
        self.counters.leases += 1
        return Leased(p.id, objs, [o.offset for o in objs], sum(o.nbytes for o in objs))

    def release(self, lease_id: int, holder: bytes) -> Released:
        p = self._pending("lease", lease_id, holder)
        if p.busy:
            raise Busy(f"lease {lease_id} is being sent on the data link; the data link "
                       f"releases it when the bytes are sent")
        self._end_lease(p)
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
        table = self.table(kind)
        if kind == "queries":
            for k in keys:
                o = table.get((model, tp_rank, k))
                if o is not None and o.state == READY:
                    self._forget(o)
        have = [table.get((model, tp_rank, k)) for k in keys]
        present = [o for o in have if o is not None]
        pinned = [o for o in present if o.evictable]
        self._leave_order(pinned)   # what we report present must survive our own evictions
        missing, seen = [], set()
        for i, k in enumerate(keys):
            if have[i] is None and k not in seen:   # not present, not a duplicate
                seen.add(k)
                missing.append(i)
        try:
            offsets = self._alloc(nbytes, len(missing))
        finally:
            if self.policy == "LRU":   # touched: LRU puts them at the most recently used end
                base = self._ticks(len(present))
                for j, o in enumerate(present):
                    o.rank = base + j
            self._enter_order(pinned)
        if offsets is None:
            a = self.alloc
            raise PoolFull(
                f"{len(missing)} chunk(s) of {nbytes} bytes do not fit: {a.used} of "
                f"{a.capacity} bytes in use (largest free range {a.largest_free()} bytes; "
                f"{self.counters.quarantined_bytes} bytes in quarantine) and nothing more is "
                f"evictable (eviction policy {self.policy}; leased and in-flight objects are "
                f"not evictable)")
        slot = self.alloc.rounded(nbytes)
        objs = [Obj(model, tp_rank, keys[i], off, nbytes, slot, kind=kind)
                for i, off in zip(missing, offsets)]
        for o in objs:
            table[o.ident] = o
        self.counters.objects += len(objs)
        self.counters.writing += len(objs)
        p = self._new_pending("store", holder, objs, self.write_ttl)
        self.stores[p.id] = p
        self.counters.pending_stores += 1
        return Prepared(p.id, missing, offsets, len(keys) - len(missing))

    def commit(self, store_id: int, holder: bytes) -> Committed:
        p = self._pending("store", store_id, holder)
        if p.busy:
            raise Busy(f"store {store_id} is still receiving its data on the data link")
        self._drop_store(p)
        objs = p.objs
        c = self.counters
        c.writing -= len(objs)
        c.ready += len(objs)
        base = self._ticks(len(objs))
        for j, o in enumerate(objs):
            o.state = READY
            o.seq = o.rank = base + j
            self._by_seq[o.seq] = o
            if o.kind == "queries":
                c.query_objects += 1
                c.query_bytes += o.nbytes
        seqs = list(range(base, base + len(objs)))   # one model per store; newest of all
        self._pages.update(seqs)
        if objs:
            self._model_pages.setdefault(objs[0].model, SortedInts()).update(seqs)
        self._enter_order(objs)
        return Committed(store_id, p.objs, sum(o.nbytes for o in p.objs), p.started)

    def abort(self, store_id: int, holder: bytes) -> None:
        p = self._pending("store", store_id, holder)
        if p.busy:
            raise Busy(f"store {store_id} is receiving data on the data link")
        self._drop_store(p)
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
        seqs = self._pages if model is None else self._model_pages.get(model)
        victims = [self._by_seq[s] for s in seqs.after(None)] if seqs else []
        for o in victims:
            self._forget(o)
        return len(victims)

    def drop_model(self, model: str, tp_rank: int) -> int:
        """Delete every object of (model, tp_rank) before Unregister; Busy if any is leased
        or being written (nothing is deleted then)."""
        writing = sum(1 for p in self.stores.values() for o in p.objs
                      if o.model == model and o.tp_rank == tp_rank)
        seqs = self._model_pages.get(model)
        mine = [o for o in (self._by_seq[s] for s in seqs.after(None))
                if o.tp_rank == tp_rank] if seqs else []
        leased = sum(1 for o in mine if o.leases)
        if writing or leased:
            raise Busy(f"model {model!r} tp_rank {tp_rank} has {leased} leased and {writing} "
                       f"in-flight object(s); release/commit them first")
        for o in mine:
            self._forget(o)
        return len(mine)

    # ---- data-link transfers ----------------------------------------------------------
    def begin_put(self, store_id: int, holder: bytes) -> Transfer:
        """The data link starts receiving a store's bytes: the slots to fill, in key order."""
        return self._begin("store", store_id, holder)

    def finish_put(self, store_id: int, ok: bool) -> bool:
        """The PUT ended -> True if the store now awaits its Commit (answer the PUT ok).
        ok=False (peer gone, timeout) or a cut store: the store is dropped and its slots
        freed; a later Commit gets store_expired."""
        p = self._finish("store", store_id)
        if p is None:
            return False
        if ok and p.id in self.stores:   # not cut: wait for the Commit
            p.deadline = max(p.deadline, self.clock() + FINISH_GRACE)
            self._push(p.deadline, "store", p.id)
            return True
        if p.id in self.stores:
            self._drop_store(p)
            self._remember(p.id, p.holder, "failed")
        for o in p.objs:   # only the server wrote them (the data link): nothing to fence
            self._forget(o)
        return False

    def begin_get(self, lease_id: int, holder: bytes) -> Transfer:
        """The data link starts sending a lease's bytes: the slots to send, in key order."""
        return self._begin("lease", lease_id, holder)

    def finish_get(self, lease_id: int, ok: bool = True) -> Released | None:
        """The GET ended (sent, failed or cut): the lease is released -> Released, or None
        when it had been cut (or was not in transfer). ok=False (peer gone, idle timeout):
        a later Release from the holder gets lease_expired, as for a cut GET. Nothing is
        quarantined: only the data-link thread read the slots, and it is done."""
        p = self._finish("lease", lease_id)
        if p is None:
            return None
        if p.id not in self.leases:   # cut: already counted as ended; only the objects' leases
            self._unlease_objs(p)
            return None
        self._end_lease(p)
        if not ok:
            self._remember(p.id, p.holder, "failed")
        return Released(lease_id, sum(o.nbytes for o in p.objs), p.started)

    # ---- clients ----------------------------------------------------------------------
    def session_gone(self, holder: bytes) -> int:
        """The holder's last socket went away: end its quarantines -> bytes freed (deleted
        objects; live ones go back to the eviction order)."""
        return sum(self._unquarantine(i) for i in list(self._q_by_holder.get(holder, ())))

    # ---- deadlines --------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        h = self._deadlines
        while h:
            when, _, what, pid = h[0]
            if self._due(what, pid) == when:
                return when
            heapq.heappop(h)   # stale: released, committed, finished, acknowledged
        return None

    def expire(self, now: float) -> Expiry:
        stores = leases = freed = 0
        cut = []
        while (d := self.next_deadline()) is not None and d <= now:
            _, _, what, pid = heapq.heappop(self._deadlines)
            if what == "quarantine":
                freed += self._unquarantine(pid)
                continue
            p = (self.stores if what == "store" else self.leases)[pid]
            if p.busy:
                self._cut_transfer(p)
                cut.append(pid)
            elif what == "store":
                self._expire_store(p, now)
                stores += 1
            else:
                self._expire_lease(p, now)
                leases += 1
        return Expiry(stores, leases, cut, freed)

    # ---- internals: pendings ----------------------------------------------------------
    def _new_id(self) -> int:
        while True:
            i = secrets.randbits(63)
            if i and i not in self.stores and i not in self.leases and i not in self._gone \
                    and i not in self._cut and i not in self._quarantine:
                return i

    def _new_pending(self, kind: Kind, holder: bytes, objs: list[Obj], ttl: float) -> Pending:
        now = self.clock()
        p = Pending(kind, self._new_id(), holder, objs, now + ttl, now)
        self._push(p.deadline, kind, p.id)
        return p

    def _pending(self, kind: Kind, pid: int, holder: bytes) -> Pending:
        """The live store/lease `pid` of `holder`, or the right refusal."""
        p = (self.stores if kind == "store" else self.leases).get(pid)
        if p is not None:
            if p.holder != holder:
                raise NotHolder(f"{kind} {pid} belongs to another client session")
            return p
        gone = self._gone.get(pid)
        if gone is None:
            if kind == "store":
                raise UnknownStore(f"store {pid} is unknown or already committed/aborted")
            raise UnknownLease(f"lease {pid} is unknown or already released")
        if gone.holder != holder:
            raise NotHolder(f"{kind} {pid} belonged to another client session")
        self._unquarantine(pid)   # the holder acknowledges: it no longer touches those slots
        why = {"expired": f"passed its TTL ({self.write_ttl if kind == 'store' else self.lease_ttl}"
                          f" s)",
               "cut": "its data-link transfer passed its deadline and was cut",
               "failed": "its data-link transfer failed"}[gone.reason]
        if kind == "store":
            raise StoreExpired(f"store {pid} {why}: its bytes were discarded; store again")
        raise LeaseExpired(f"lease {pid} {why}: bytes read under it may not be the keys' "
                           f"bytes; discard them and retrieve again")

    def _drop_store(self, p: Pending) -> None:
        del self.stores[p.id]
        self.counters.pending_stores -= 1

    def _end_lease(self, p: Pending) -> None:
        del self.leases[p.id]
        self.counters.leases -= 1
        self._unlease_objs(p)

    def _remember(self, pid: int, holder: bytes, reason: str) -> None:
        self._gone[pid] = Gone(holder, reason)
        if len(self._gone) > T.GONE_CAP:   # T.: tests lower it
            self._gone.popitem(last=False)

    def _expire_store(self, p: Pending, now: float) -> None:
        self._drop_store(p)
        self._remember(p.id, p.holder, "expired")
        self.counters.expired_stores += 1
        for o in p.objs:           # the holder may still be writing into them (shm)
            self._hide(o)
        self._quarantine_objs(p, p.objs, now)

    def _expire_lease(self, p: Pending, now: float) -> None:
        del self.leases[p.id]
        self.counters.leases -= 1
        self._remember(p.id, p.holder, "expired")
        self.counters.expired_leases += 1
        self._quarantine_objs(p, p.objs, now)   # the holder may still read them (shm)
        self._unlease_objs(p)

    def _cut_transfer(self, p: Pending) -> None:
        """The transfer passed its deadline: end the store/lease now (late Commit/Release get
        *_expired); its slots stay with the data-link thread until finish_*."""
        c = self.counters
        c.cut_transfers += 1
        self._remember(p.id, p.holder, "cut")
        if p.kind == "store":
            self._drop_store(p)
            c.expired_stores += 1
            for o in p.objs:
                self._hide(o)
        else:
            del self.leases[p.id]
            c.leases -= 1
            c.expired_leases += 1
        self._cut[p.id] = p

    def _begin(self, kind: Kind, pid: int, holder: bytes) -> Transfer:
        p = self._pending(kind, pid, holder)
        if p.busy:
            raise Busy(f"{kind} {pid} is already moving bytes on another data connection")
        p.transfer_deadline = self.clock() + self.transfer_timeout
        self.counters.transfers += 1
        self._push(p.transfer_deadline, kind, pid)
        slots = [Slot(o.offset, o.nbytes) for o in p.objs]
        return Transfer(pid, slots, sum(s.nbytes for s in slots), p.transfer_deadline,
                        p.started)

    def _finish(self, kind: Kind, pid: int) -> Pending | None:
        p = self._cut.get(pid) or (self.stores if kind == "store" else self.leases).get(pid)
        if p is None or p.kind != kind or not p.busy:
            return None   # a finish without a begin: nothing to do
        self._cut.pop(pid, None)
        p.transfer_deadline = None
        self.counters.transfers -= 1
        return p

    def _due(self, what: str, pid: int) -> float | None:
        if what == "quarantine":
            q = self._quarantine.get(pid)
            return None if q is None else q.deadline
        p = (self.stores if what == "store" else self.leases).get(pid)
        if p is None:
            return None
        return p.transfer_deadline if p.busy else p.deadline

    def _push(self, when: float, what: str, pid: int) -> None:
        h = self._deadlines
        heapq.heappush(h, (when, next(self._tiebreak), what, pid))
        live = len(self.stores) + len(self.leases) + len(self._quarantine)
        if len(h) > 4 * live + 4096:   # drop stale entries so the heap stays O(live)
            self._deadlines = [e for e in h if self._due(e[2], e[3]) == e[0]]
            heapq.heapify(self._deadlines)

    # ---- internals: quarantine --------------------------------------------------------
    def _quarantine_objs(self, p: Pending, objs: list[Obj], now: float) -> None:
        """Pin `objs` (one pin per entry) under `p`'s quarantine. Pinned objects are in no
        eviction order and their slots are not freed (see _enter_order, _forget)."""
        if not objs:
            return
        q = self._quarantine.get(p.id)
        if q is None:
            q = self._quarantine[p.id] = Quarantined(p.holder, [], now + self.quarantine_ttl)
            self._q_by_holder.setdefault(p.holder, set()).add(p.id)
            self._push(q.deadline, "quarantine", p.id)
        q.objs.extend(objs)
        c = self.counters
        for o in objs:
            if o.pins == 0:
                c.quarantined_objects += 1
                c.quarantined_bytes += self.alloc.rounded(o.nbytes)
            o.pins += 1

    def _unquarantine(self, pid: int) -> int:
        """End quarantine `pid`: unpin its objects -> bytes freed (the deleted ones no lease
        or other quarantine holds; the live ones go back to the eviction order)."""
        q = self._quarantine.pop(pid, None)
        if q is None:
            return 0
        ids = self._q_by_holder[q.holder]
        ids.discard(pid)
        if not ids:
            del self._q_by_holder[q.holder]
        c = self.counters
        freed, back = 0, []
        for o in q.objs:
            o.pins -= 1
            if o.pins:
                continue
            c.quarantined_objects -= 1
            c.quarantined_bytes -= self.alloc.rounded(o.nbytes)
            if o.leases == 0:
                if o.live:
                    back.append(o)
                else:
                    freed += self._free(o.offset, o.nbytes)
        self._enter_order(back)   # at its place (FIFO: commit; LRU: last lease)
        return freed

    # ---- internals: objects -----------------------------------------------------------
    def _unlease_objs(self, p: Pending) -> None:
        """Drop `p`'s lease on its objects: the ones no lease or quarantine holds any more
        go back to the eviction order (live) or are freed (deleted meanwhile)."""
        back = []
        for o in p.objs:
            o.leases -= 1
            if o.leases == 0:
                self.counters.leased -= 1
                if o.pins:
                    continue   # quarantined: _unquarantine decides
                if o.live:
                    back.append(o)
                else:
                    self._free(o.offset, o.nbytes)
        self._enter_order(back)   # at its place (FIFO: commit; LRU: last lease)

    def evictable(self) -> int:
        """Objects in the eviction order (READY, live, not leased, not quarantined)."""
        return len(self._by_rank)

    def _ticks(self, n: int) -> int:
        """n consecutive new ranks/seqs -> the first."""
        base = self._tick
        self._tick += n
        return base

    def _enter_order(self, objs: list[Obj]) -> None:
        """Put the evictable ones of `objs` (live, READY, unleased, unpinned) in the eviction order at
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
            order = self._evict.get(slot)
            if order is None:
                order = self._evict[slot] = SortedInts()
                insort(self._evict_sizes, slot)
            ranks.sort()
            order.update(ranks)

    def _leave_order(self, objs: list[Obj]) -> None:
        """Take `objs` out of the eviction order (those in it)."""
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
            order = self._evict[slot]
            ranks.sort()
            order.discard_many(ranks)
            if not order:
                del self._evict[slot]
                del self._evict_sizes[bisect_left(self._evict_sizes, slot)]

    def _alloc(self, nbytes: int, count: int) -> list[int] | None:
        """`count` slots, evicting only while no free range fits the next one (the allocator
        finds any range that does); None (nothing kept) if eviction cannot make room."""
        slot = self.alloc.rounded(nbytes)
        offsets = self.alloc.alloc_many(nbytes, count)
        while len(offsets) < count:
            if self.policy == "none" or not self._evict_one(slot):
                for off in offsets:
                    self.alloc.free(off, nbytes)
                return None
            offsets += self.alloc.alloc_many(nbytes, count - len(offsets))
        self.counters.pool_used += count * slot
        self.counters.pool_free -= count * slot
        return offsets

    def _free(self, offset: int, nbytes: int) -> int:
        self.alloc.free(offset, nbytes)
        n = self.alloc.rounded(nbytes)
        self.counters.pool_used -= n
        self.counters.pool_free += n
        return n

    def _evict_one(self, need: int) -> bool:
        """Evict the oldest (LRU: least recently used) evictable object whose own slot takes
        `need` bytes; if there is none, the oldest of all (the caller retries until a range
        fits). Several layouts share the pool: evicting the oldest object of any size could
        free many small slots, none adjacent, before one large range appears, so eviction
        order is kept per slot size (one per layout; few) and LRU/FIFO holds within a size.
        Leased and in-flight objects are in no order: nothing is walked past."""
        sizes = self._evict_sizes
        fitting = [self._evict[s].first() for s in sizes[bisect_left(sizes, need):]]
        rank = min(fitting, default=None)
        if rank is None:
            rank = min((self._evict[s].first() for s in sizes), default=None)
            if rank is None:
                return False
        o = self._by_rank[rank]
        if self.on_evict is not None:
            self.on_evict(o)
        self._forget(o)
        self.counters.evictions += 1
        return True

    def _hide(self, o: Obj) -> None:
        """Take the object out of every lookup, page and the eviction order (not its slot)."""
        if not o.live:
            return
        c = self.counters
        del self.table(o.kind)[o.ident]
        o.live = False
        c.objects -= 1
        if o.state == READY:
            c.ready -= 1
            if o.kind == "queries":
                c.query_objects -= 1
                c.query_bytes -= o.nbytes
            self._leave_order([o])
            self._pages.discard(o.seq)
            model_seqs = self._model_pages[o.model]
            model_seqs.discard(o.seq)
            if not model_seqs:
                del self._model_pages[o.model]
            del self._by_seq[o.seq]
        else:
            c.writing -= 1

    def _forget(self, o: Obj) -> None:
        """Hide the object; free its memory now, or when its last lease/quarantine ends."""
        self._hide(o)
        if o.leases == 0 and o.pins == 0:
            self._free(o.offset, o.nbytes)
