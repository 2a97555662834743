"""A prepare-store in steps: the index's part of a store that is prepared a slice at a time.

Why: preparing a store of 8,192 new keys looks its keys up, keeps the ones present out of
the eviction order, makes 8,192 objects and their slots and, in a full pool, evicts as many
objects: 20-45 ms of the control loop in one go on a 2-core box, while every other client's
request waited (a Hello beside evicting stores in `kvedit bench soak`: 114 ms). The service
(slices.py) runs a large store as a job: `run` looks up a few hundred keys, then (once all
are looked up and the quota admitted the missing ones' bytes) makes a few dozen objects at a
time until a deadline, and `finish` opens the store and gives its slots. A small store is
the same calls in one go (Index.prepare).

What other requests may see between two steps, and why it is what they saw before:
- the objects made so far are WRITING (as every prepared store's are until its commit):
  lookups, retrieves, deletes, /cache pages and key watches do not see them; another store
  of the same key reports it present, as it would a store prepared before it; Unregister of
  the model answers busy (a WRITING object counts as in use);
- the slots it evicted are freed at once and the objects gone from every lookup at once (an
  eviction is one object's `_forget`, between requests), so a retrieve never sees one half
  evicted; the evicted keys' removals reach key watches after each step, before the reply;
- a key looked up as missing that another store made meanwhile is reported present, not
  made twice; a key reported present may be gone by the reply (deleted, evicted), as it may
  a moment after any reply.
Nothing is opened (no store id, no TTL, no quota held) until `finish`, which admits the
store's bytes against the quotas again (another store of the session may have opened
meanwhile) and undoes the objects on a refusal; `cancel` undoes them on any other end.
"""
from __future__ import annotations

import time

from kvedit.protocol import ObjectKind
from kvedit.server.index_types import READY, Obj, PoolFull, Prepared

CHUNK = 64   # objects made (and slots evicted for) between two looks at the deadline
SCAN = 512   # keys looked up between two looks at the deadline


class Preparing:
    def __init__(self, index, model: str, tp_rank: int, keys: list[bytes], nbytes: int,
                 holder: bytes, kind: ObjectKind = "kv"):
        self.ix, self.model, self.tp_rank, self.keys = index, model, tp_rank, keys
        self.nbytes, self.holder, self.kind = nbytes, holder, kind
        self.slot = index.alloc.rounded(nbytes)
        if kind == "queries":   # replaces: the ready object under the key goes first
            table = index.table(kind)
            for k in keys:
                o = table.get((model, tp_rank, k))
                if o is not None and o.state == READY:
                    index._forget(o)
        self.present: list[Obj] = []   # objects of keys found there (ready or in flight)
        self.pinned: list[Obj] = []    # ... of which were evictable: out of the order now
        self.missing: list[int] = []   # indices into keys to make (distinct keys)
        self._seen: set[bytes] | None = set()
        self.scanned = 0               # keys[:scanned] looked up
        self.admitted = False
        self.made: list[int] = []      # indices made, in the order of `objs` and `offsets`
        self.objs: list[Obj] = []
        self.offsets: list[int] = []
        self.pos = 0                   # missing[:pos] are made (or found made by another)
        self.paused = False            # a step ended early: others ran since
        self.open = True

    def run(self, deadline: float | None = None, clock=time.monotonic) -> bool:
        """Look the keys up, admit the missing ones' bytes (OverQuota: nothing made, nothing
        evicted), then make them (PoolFull when eviction cannot make room: every object of
        this store undone) -> True when all are made; with a `deadline`, a few dozen at a
        time until `clock()` passes it (at least one step) -> False."""
        n, keys = len(self.keys), self.keys
        while self.scanned < n:   # what we report present must survive our own evictions
            k0 = self.scanned
            k1 = n if deadline is None else min(n, k0 + SCAN)
            self._scan(k0, k1)
            self.scanned = k1
            if deadline is not None and k1 < n and clock() >= deadline:
                self.paused = True
                return False
        if not self.admitted:
            self._seen = None
            try:
                self.ix.pending.admit("store", self.holder, [],
                                      len(self.missing) * self.slot)   # OverQuota
            except Exception:
                self._let_present_go(touch=False)
                raise
            self.admitted = True
        ix, missing = self.ix, self.missing
        table = ix.table(self.kind)
        step = CHUNK if deadline is not None else max(1, len(missing))
        while self.pos < len(missing):
            idx = missing[self.pos:self.pos + step]
            if self.paused:   # another store may have made one of these keys meanwhile
                idx = self._still_missing(table, idx)
            offsets = ix._alloc(self.nbytes, len(idx)) if idx else []
            if offsets is None:
                self.cancel()
                raise self._full(len(missing))
            objs = [Obj(self.model, self.tp_rank, keys[i], off, self.nbytes, self.slot,
                        kind=self.kind) for i, off in zip(idx, offsets)]
            table.put(objs)
            c = ix.counters
            c.objects += len(objs)
            c.writing += len(objs)
            ix._use(self.model, self.tp_rank, len(objs))
            ix.made += len(objs)
            self.made += idx
            self.objs += objs
            self.offsets += offsets
            self.pos += step
            if deadline is not None and self.pos < len(missing) and clock() >= deadline:
                self.paused = True
                return False
        return True

    def _scan(self, k0: int, k1: int) -> None:
        keys, seen, missing = self.keys, self._seen, self.missing
        have = self.ix.table(self.kind).find(self.model, self.tp_rank, keys[k0:k1])
        pin = []
        for i, o in enumerate(have, k0):
            if o is not None:
                self.present.append(o)
                if o.evictable:
                    pin.append(o)
            elif keys[i] not in seen:   # not present, not a duplicate
                seen.add(keys[i])
                missing.append(i)
        if pin:
            self.ix.order.leave(pin)
            self.pinned += pin

    def finish(self) -> Prepared:
        """Open the store (its TTL starts) -> its id and slots. OverQuota (every object of
        this store undone) when the session took more meanwhile."""
        ix = self.ix
        if self.paused:
            try:
                ix.pending.admit("store", self.holder, [], len(self.objs) * self.slot)
            except Exception:
                self.cancel()
                raise
        self._let_present_go()
        p = ix.pending.open("store", self.holder, self.objs, len(self.objs) * self.slot)
        return Prepared(p.id, self.made, self.offsets, len(self.keys) - len(self.made))

    def cancel(self) -> None:
        """The store will not be opened: its objects go (slots freed), the present ones
        back to the eviction order. Idempotent."""
        if not self.open:
            return
        for o in self.objs:
            self.ix._forget(o)
        self.objs, self.made, self.offsets = [], [], []
        self._let_present_go()

    def _let_present_go(self, touch: bool = True) -> None:
        self.open = False
        order = self.ix.order
        back = [o for o in self.present if o.evictable]   # a lease ended, a commit came
        order.leave(back)
        if touch:
            order.touch(self.present)   # LRU: at the most recently used end
        order.enter(self.pinned + back)

    def _still_missing(self, table, idx: list[int]) -> list[int]:
        out = []
        for i in idx:
            o = table.get((self.model, self.tp_rank, self.keys[i]))
            if o is None:
                out.append(i)
            else:   # made by another store since we looked: present, and kept
                self.present.append(o)
                if o.evictable:
                    self.pinned.append(o)
                    self.ix.order.leave([o])
        return out

    def _full(self, n: int) -> PoolFull:
        a, ix = self.ix.alloc, self.ix
        return PoolFull(
            f"{n} chunk(s) of {self.nbytes} bytes do not fit: {a.used} of {a.capacity} bytes "
            f"in use (largest free range {a.largest_free()} bytes; "
            f"{ix.counters.quarantined_bytes} bytes in quarantine) and nothing more is "
            f"evictable (eviction policy {ix.policy}; leased and in-flight objects are not "
            f"evictable)")
