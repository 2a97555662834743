"""Stores and leases in flight: ids, holders, deadlines, data-link transfers, the fence of
ended ids, and quarantine.

Why one module: a store or lease id lives one life, and every rule of that life is kept
here, against one deadline heap:
- open (prepare-store / retrieve), with a deadline (write/lease TTL), so a crashed client
  cannot hold slots; only its holder (the client session) may act on it (`not_holder`).
  Ids are `secrets.randbits(63)`: unguessable, unique among live and recently ended ids.
- maybe a data-link transfer (`begin_transfer`): while bytes move the TTL does not count,
  the transfer's own deadline does, and commit/abort/release answer `busy` (`idle`).
- closed by commit/abort/release/finish (`close`), or ended early: expired (`expire`), its
  transfer cut at the deadline (`cut_transfer`; the data-link thread still holds the slots
  until `finish_transfer`) or failed. An early end is remembered (a bounded table), so a late
  commit/abort/release gets `store_expired`/`lease_expired`, not `unknown_*`.
- quarantine: the objects of an expired store or lease get a pin each (`Obj.pins`) while the
  holder may still touch their slots through shm; the pin goes when the holder acknowledges
  (that late call), its session is gone, or `quarantine_ttl` passes. A pinned object is in
  no eviction order and keeps its slot (a delete only hides it, as under a lease). So a late
  shm writer scribbles only on memory nobody else owns, and a late shm reader reads the
  key's bytes or freed-but-unused memory, never another key's new bytes.
  A store or lease whose session had already disconnected when it expired is not
  quarantined (unless `fence_gone`): no ZMQ session of it is left to acknowledge, and a
  process that closed every socket is outside the fence anyway (docs/protocol.md).
- quota: every store and lease counts against its holder's caps (quota.py) from `open`
  until it leaves every table here (closed, cut and finished, or its quarantine ended);
  `admit` refuses one over a cap before anything is opened.
It never touches the object tables, the eviction order or the allocator: objects whose last
pin went are handed to the `let_go` callback (Index: back to the eviction order or freed),
and the object side of an early end (hide, unlease) is the Index's, driven by `pop_due`.
Of the counters it writes only its own fields: pending_stores, leases, transfers,
expired_stores, expired_leases, cut_transfers, quarantined_objects, quarantined_bytes.
"""
from __future__ import annotations

import heapq
import itertools
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvedit.server import index_types as T
from kvedit.server.index_types import (
    FINISH_GRACE, Busy, Counters, Gone, GoneReason, Kind, LeaseExpired, NotHolder, Obj, Pending,
    Quarantined, Slot, StoreExpired, Transfer, UnknownLease, UnknownStore)
from kvedit.server.quota import QuotaLimits, Quotas

Deadline = Literal["store", "lease", "quarantine"]      # whose deadline a heap entry is
DueWhat = Literal["store", "lease", "transfer", "quarantine"]


@dataclass(frozen=True, slots=True)
class Due:
    """A deadline that passed: a store's or lease's TTL, its transfer's deadline (the store
    or lease is in `pending`), or a quarantine's (`id` is the store/lease id it came from)."""
    what: DueWhat
    id: int
    pending: Pending | None = None


class Pendings:
    def __init__(self, counters: Counters, clock: Callable[[], float],
                 let_go: Callable[[list[Obj]], int], *, lease_ttl: float, write_ttl: float,
                 quarantine_ttl: float, transfer_timeout: float,
                 limits: QuotaLimits | None = None, exempt: frozenset[bytes] = frozenset(),
                 fence_gone: bool = False):
        self.counters = counters
        self.clock = clock
        self.let_go = let_go   # objects whose last quarantine pin went -> bytes freed
        self.lease_ttl = lease_ttl
        self.write_ttl = write_ttl
        self.quarantine_ttl = quarantine_ttl
        self.transfer_timeout = transfer_timeout
        self.fence_gone = fence_gone   # quarantine even what a gone session held
        self.quota = Quotas(limits or QuotaLimits(), exempt)
        self.stores: dict[int, Pending] = {}
        self.leases: dict[int, Pending] = {}
        self.cut: dict[int, Pending] = {}                 # cut transfers awaiting finish
        self.quarantined: dict[int, Quarantined] = {}     # by store/lease id
        self._gone: OrderedDict[int, Gone] = OrderedDict()
        self._q_by_holder: dict[bytes, set[int]] = {}
        # (when, tiebreak, what, id); entries go stale as stores/leases end (see _due)
        self._deadlines: list[tuple[float, int, Deadline, int]] = []
        self._tiebreak = itertools.count()

    # ---- life of a store/lease --------------------------------------------------------
    def admit(self, kind: Kind, holder: bytes, objs: list[Obj], nbytes: int = 0,
              distinct: list[Obj] | None = None) -> None:
        """OverQuota if a lease keeping `objs` (`distinct`: each once, when known), or a
        store of `nbytes` slot bytes, would take `holder` over a cap (quota.py). Call before
        allocating or leasing anything."""
        self.quota.admit(kind, holder, objs, nbytes, distinct)

    def open(self, kind: Kind, holder: bytes, objs: list[Obj], nbytes: int | None = None,
             distinct: list[Obj] | None = None) -> Pending:
        """A new store (prepared) or lease of `holder` over `objs` (admitted: `admit`), due
        at its TTL; a store pins `nbytes` slot bytes (None: its objects' slots); a lease
        pins its `distinct` objects (None: `objs` holds each once)."""
        if nbytes is None:
            nbytes = sum(o.slot for o in objs) if kind == "store" else 0
        now = self.clock()
        ttl = self.write_ttl if kind == "store" else self.lease_ttl
        p = Pending(kind, self._new_id(), holder, objs, now + ttl, now, nbytes=nbytes,
                    counted=True, repeats=distinct is not None and len(distinct) != len(objs))
        self.quota.take(p, objs if distinct is None else distinct)
        self._push(p.deadline, kind, p.id)
        if kind == "store":
            self.stores[p.id] = p
            self.counters.pending_stores += 1
        else:
            self.leases[p.id] = p
            self.counters.leases += 1
        return p

    def held(self, kind: Kind, pid: int, holder: bytes) -> Pending:
        """The live store/lease `pid` of `holder`, or the right refusal. A late call of the
        holder on an id that ended early acknowledges it: its quarantine ends."""
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
        self.unquarantine(pid)   # the holder acknowledges: it no longer touches those slots
        why = {"expired": f"passed its TTL ({self.write_ttl if kind == 'store' else self.lease_ttl}"
                          f" s)",
               "cut": "its data-link transfer passed its deadline and was cut",
               "failed": "its data-link transfer failed"}[gone.reason]
        if kind == "store":
            raise StoreExpired(f"store {pid} {why}: its bytes were discarded; store again")
        raise LeaseExpired(f"lease {pid} {why}: bytes read under it may not be the keys' "
                           f"bytes; discard them and retrieve again")

    def idle(self, kind: Kind, pid: int, holder: bytes, busy: str) -> Pending:
        """`held`, and not moving bytes on the data link (else Busy with message `busy`)."""
        p = self.held(kind, pid, holder)
        if p.busy:
            raise Busy(busy)
        return p

    def is_open(self, p: Pending) -> bool:
        """Not closed, expired or cut."""
        return p.id in self._table(p.kind)

    def close(self, p: Pending, failed: bool = False) -> None:
        """The store/lease ends (commit, abort, release, a finished transfer); `failed`: its
        data-link transfer failed, and a later call of the holder is told so."""
        self._drop(p)
        self._uncount(p)
        if failed:
            self._remember(p, "failed")

    def expire(self, p: Pending) -> None:
        """`p` passed its TTL: it ends (the caller then hides/unleases and quarantines)."""
        self._end_early(p, "expired")

    def await_commit(self, p: Pending) -> None:
        """A store's PUT finished: it has at least FINISH_GRACE more for its Commit."""
        p.deadline = max(p.deadline, self.clock() + FINISH_GRACE)
        self._push(p.deadline, "store", p.id)

    # ---- data-link transfers ----------------------------------------------------------
    def begin_transfer(self, kind: Kind, pid: int, holder: bytes) -> Transfer:
        """The data link starts moving the bytes of `holder`'s store/lease `pid`: its TTL is
        suspended and the transfer's own deadline counts."""
        p = self.idle(kind, pid, holder,
                      f"{kind} {pid} is already moving bytes on another data connection")
        p.transfer_deadline = self.clock() + self.transfer_timeout
        self.counters.transfers += 1
        self._push(p.transfer_deadline, kind, pid)
        slots = [Slot(o.offset, o.nbytes) for o in p.objs]
        return Transfer(pid, slots, sum(s.nbytes for s in slots), p.transfer_deadline,
                        p.started)

    def cut_transfer(self, p: Pending) -> None:
        """The transfer passed its deadline: the store/lease ends now (late Commit/Release get
        *_expired); its slots stay with the data-link thread until `finish_transfer`."""
        self.counters.cut_transfers += 1
        self._end_early(p, "cut")
        self.cut[p.id] = p

    def finish_transfer(self, kind: Kind, pid: int) -> Pending | None:
        """The transfer of store/lease `pid` ended (its store/lease may have been cut
        meanwhile: then `is_open` is False) -> it, or None without a transfer."""
        p = self.cut.get(pid) or self._table(kind).get(pid)
        if p is None or p.kind != kind or not p.busy:
            return None   # a finish without a begin: nothing to do
        if self.cut.pop(pid, None) is not None:   # the data link let go of its slots
            self._uncount(p)
        p.transfer_deadline = None
        self.counters.transfers -= 1
        return p

    # ---- quarantine -------------------------------------------------------------------
    def quarantine(self, p: Pending, now: float) -> int:
        """Pin expired `p`'s objects (one pin per entry) until its holder acknowledges, its
        session goes, or quarantine_ttl passes. The Index keeps pinned objects out of the
        eviction order and does not free their slots. Not for a holder whose session is
        already gone (unless fence_gone): then `p` ends here and its objects are let go
        -> bytes freed (hidden store objects; leased ones go with their last lease)."""
        if not p.objs or (self.quota.is_gone(p.holder) and not self.fence_gone):
            self._uncount(p)
            return self.let_go(p.objs)
        self.quarantined[p.id] = Quarantined(p, now + self.quarantine_ttl)
        self._q_by_holder.setdefault(p.holder, set()).add(p.id)
        self._push(now + self.quarantine_ttl, "quarantine", p.id)
        c = self.counters
        for o in p.objs:
            if o.pins == 0:
                c.quarantined_objects += 1
                c.quarantined_bytes += o.slot
            o.pins += 1
        return 0

    def unquarantine(self, pid: int) -> int:
        """End quarantine `pid`: unpin its objects; those whose last pin went are let go ->
        bytes freed (deleted objects no lease holds; live ones go back to the order)."""
        q = self.quarantined.pop(pid, None)
        if q is None:
            return 0
        ids = self._q_by_holder[q.holder]
        ids.discard(pid)
        if not ids:
            del self._q_by_holder[q.holder]
        c = self.counters
        unpinned = []
        for o in q.pending.objs:
            o.pins -= 1
            if o.pins == 0:
                c.quarantined_objects -= 1
                c.quarantined_bytes -= o.slot
                unpinned.append(o)
        self._uncount(q.pending)
        return self.let_go(unpinned)

    def session_gone(self, holder: bytes) -> int:
        """The holder's last socket went away: end its quarantines -> bytes freed; what it
        still holds will not be quarantined when it expires."""
        self.quota.session_gone(holder)
        return sum(self.unquarantine(i) for i in list(self._q_by_holder.get(holder, ())))

    def session_seen(self, holder: bytes) -> None:
        """The holder sent a request: it is connected (again)."""
        self.quota.seen(holder)

    # ---- deadlines --------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        h = self._deadlines
        while h:
            when, _, what, pid = h[0]
            if self._due(what, pid) == when:
                return when
            heapq.heappop(h)   # stale: released, committed, finished, acknowledged
        return None

    def pop_due(self, now: float) -> Due | None:
        """The next deadline at or before `now`, taken off the heap; None when there is none.
        The caller acts on it (a store/lease still in its table: `expire` or `cut_transfer`)
        before asking again."""
        d = self.next_deadline()
        if d is None or d > now:
            return None
        _, _, what, pid = heapq.heappop(self._deadlines)
        if what == "quarantine":
            return Due("quarantine", pid)
        p = self._table(what).get(pid)
        return Due("transfer" if p.busy else what, pid, p)

    # ---- internals --------------------------------------------------------------------
    def _table(self, kind: Kind) -> dict[int, Pending]:
        return self.stores if kind == "store" else self.leases

    def _new_id(self) -> int:
        while True:
            i = secrets.randbits(63)
            if i and i not in self.stores and i not in self.leases and i not in self._gone \
                    and i not in self.cut and i not in self.quarantined:
                return i

    def _drop(self, p: Pending) -> None:
        """Out of the open stores/leases (still counted against the quota)."""
        if p.kind == "store":
            del self.stores[p.id]
            self.counters.pending_stores -= 1
        else:
            del self.leases[p.id]
            self.counters.leases -= 1

    def _uncount(self, p: Pending) -> None:
        """`p` left every table: it no longer counts against its holder's quota."""
        if p.counted:
            p.counted = False
            self.quota.give(p)

    def _end_early(self, p: Pending, reason: GoneReason) -> None:
        """Expired or cut: counted as expired, remembered for the holder's late call. Still
        counted against the quota: the caller quarantines it (expired) or the data link
        still holds its slots (cut, until finish_transfer)."""
        self._drop(p)
        self._remember(p, reason)
        if p.kind == "store":
            self.counters.expired_stores += 1
        else:
            self.counters.expired_leases += 1

    def _remember(self, p: Pending, reason: GoneReason) -> None:
        self._gone[p.id] = Gone(p.holder, reason)
        if len(self._gone) > T.GONE_CAP:   # read at call time: tests lower it
            self._gone.popitem(last=False)

    def _due(self, what: Deadline, pid: int) -> float | None:
        if what == "quarantine":
            q = self.quarantined.get(pid)
            return None if q is None else q.deadline
        p = self._table(what).get(pid)
        if p is None:
            return None
        return p.transfer_deadline if p.busy else p.deadline

    def _push(self, when: float, what: Deadline, pid: int) -> None:
        h = self._deadlines
        heapq.heappush(h, (when, next(self._tiebreak), what, pid))
        live = len(self.stores) + len(self.leases) + len(self.quarantined)
        if len(h) > 4 * live + 4096:   # drop stale entries so the heap stays O(live)
            self._deadlines = [e for e in h if self._due(e[2], e[3]) == e[0]]
            heapq.heapify(self._deadlines)
