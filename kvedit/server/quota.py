"""What each client session holds, and the caps on it.

Why a module of its own: a lease or a pending store costs the server memory (its id, its
deadline, its list of objects) and pins pool slots, and a client decides how many it opens.
Without a cap per session one client can grow the server's memory until the OOM killer takes
it (and every tenant's cache), or pin the whole pool so that every other store gets
`pool_full`. "A session holds at most ..." is one invariant, kept here, in one place:
pending.py asks `admit` before it opens a store or lease, and reports `take` / `give`.

What counts, per session (holder) and in total:
- leases and stores: one each while open, expired-but-quarantined included (a quarantined
  lease or store still pins its slots and still costs its entry), until the quarantine ends;
- leased keys: the objects a lease keeps (a key repeated in one retrieve counts once; a
  data-link retrieve keeps its key order for the GET, so there every key counts);
- pinned bytes: the slots of the session's pending stores and of the distinct objects its
  leases hold (an object in several leases of one session counts once: many requests
  loading one shared prefix pin it once), together (a session that could fill half the
  pool with stores and the other half with leases would pin all of it).
Pinned bytes are capped per session as a fraction of the pool; in total they are bounded by
the pool itself (every counted object sits in a slot; an object several sessions lease
counts once in the total). Counts are capped per session and in total, so the memory of all
leases and stores together is bounded whatever the number of sessions.
A share per session does not stop a few sessions: 8 sessions with an eighth each reached
the leased-keys total, and 2 with three quarters of the pool each pinned all of it. So the
last `reserve` of every total (the pool for pinned bytes) is kept for sessions that hold
little: past that line a request is admitted only when the session's holding stays within
its `share` of the reserve. The sessions holding the most are the ones refused first, and
even many newcomers take the reserve only a share at a time; a legitimate client that holds
little between its requests (a store, a retrieve and its release) is not refused by a few.
A refusal is `OverQuota` (protocol code `over_quota`): nothing was opened, allocated or
evicted. The server's own holders (L2 promotions) are `exempt` from the per-session caps
and the reserve.

`Held` also remembers whether the holder's last socket has gone (`gone`), so that a store or
lease of a session that already disconnected is not quarantined when it expires (pending.py):
nobody is left to touch its slots through a ZMQ session (docs/protocol.md, the fence).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvedit.server.index_types import Kind, Obj, OverQuota, Pending


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    leases_per_client: int = 4096
    leases_total: int = 65536
    stores_per_client: int = 4096
    stores_total: int = 65536
    lease_keys_per_client: int = 1 << 18
    lease_keys_total: int = 1 << 21
    bytes_per_client: int = 1 << 62   # leased + pending-store slot bytes (a pool fraction)
    pool_bytes: int | None = None     # what pinned bytes are a share of (the reserve's base)
    reserve: float = 0.0              # of each total: kept for sessions holding little
    share: float = 0.125              # ... of which one such session may hold this much


@dataclass(slots=True)
class Held:
    leases: int = 0
    stores: int = 0
    lease_keys: int = 0
    lease_bytes: int = 0     # slots of the distinct objects its leases hold
    store_bytes: int = 0
    gone: bool = False       # the holder's last socket disconnected since it last spoke
    leased: dict[Obj, int] = field(default_factory=dict)   # object -> its leases of it

    @property
    def pinned_bytes(self) -> int:
        return self.lease_bytes + self.store_bytes

    def empty(self) -> bool:
        return not (self.leases or self.stores)

    def new_lease_bytes(self, distinct: list[Obj]) -> int:
        """The slot bytes `distinct` (each object once) would add to what this holder's
        leases pin."""
        if not self.leased:
            return sum([o.slot for o in distinct])
        leased = self.leased
        return sum([o.slot for o in distinct if o not in leased])


_FLAG = {"leases": "--max-leases-per-client", "stores": "--max-stores-per-client",
         "lease_keys": "--max-leased-keys-per-client",
         "pinned_bytes": "--max-client-pool-fraction"}
_TOTAL_FLAG = {"leases": "--max-leases-total", "stores": "--max-stores-total",
               "lease_keys": "--max-leased-keys-total"}
_TOTAL_FLAG["pinned_bytes"] = "the pool"
_WHAT = {"leases": "lease(s)", "stores": "pending store(s)", "lease_keys": "leased key(s)",
         "pinned_bytes": "bytes of pool slots (leased and pending)"}


@dataclass(slots=True)
class Quotas:
    limits: QuotaLimits
    exempt: frozenset[bytes] = frozenset()
    total: Held = field(default_factory=Held)   # lease_bytes: each object once
    _by_holder: dict[bytes, Held] = field(default_factory=dict)
    _sessions_of: dict[Obj, int] = field(default_factory=dict)   # object -> sessions leasing

    def held(self, holder: bytes) -> Held | None:
        return self._by_holder.get(holder)

    def admit(self, kind: Kind, holder: bytes, objs: list[Obj], nbytes: int = 0,
              distinct: list[Obj] | None = None) -> None:
        """Raise OverQuota when opening a lease of `objs` (the entries it keeps; `distinct`:
        each once, when known), or a store of `nbytes` slot bytes, would take `holder` (or
        everyone) over a cap, or past the reserve line while `holder` holds much."""
        lim = self.limits
        mine = self._by_holder.get(holder) or Held()
        if kind == "lease":
            d = objs if distinct is None else distinct
            new = mine.new_lease_bytes(d)   # pinned anew by this session / by anyone:
            sessions = self._sessions_of
            added = sum([o.slot for o in d if o not in sessions]) if sessions else new
            want = {"leases": (1, 1, lim.leases_per_client, lim.leases_total),
                    "lease_keys": (len(objs), len(objs), lim.lease_keys_per_client,
                                   lim.lease_keys_total),
                    "pinned_bytes": (new, added, lim.bytes_per_client, None)}
        else:
            want = {"stores": (1, 1, lim.stores_per_client, lim.stores_total),
                    "pinned_bytes": (nbytes, nbytes, lim.bytes_per_client, None)}
        exempt = holder in self.exempt
        for name, (n, added, per_client, total) in want.items():
            have = getattr(mine, name)
            if not exempt and have + n > per_client:
                raise OverQuota(
                    f"this client session holds {have} {_WHAT[name]} and the {kind} would add "
                    f"{n}; at most {per_client} per session ({_FLAG[name]}; expired ones count "
                    f"until their quarantine ends): release or commit what it holds first")
            used = getattr(self.total, name)
            if total is not None and used + added > total:
                raise OverQuota(
                    f"all client sessions together hold {used} {_WHAT[name]} and the {kind} "
                    f"would add {added}; at most {total} ({_TOTAL_FLAG[name]}): retry later")
            if not exempt and added:   # (leasing what others pin takes nothing of it)
                self._reserve(name, kind, have, n, used + added,
                              total if total is not None else lim.pool_bytes)

    def _reserve(self, name: str, kind: Kind, have: int, n: int, after: int,
                 base: int | None) -> None:
        """Past the reserve line of `base`, a session is admitted only while it holds (with
        this request) at most its share of the reserve."""
        lim = self.limits
        if base is None or not lim.reserve:
            return
        kept = int(base * lim.reserve)
        small = max(1, int(kept * lim.share))
        if after <= base - kept or have + n <= small:
            return
        where = _TOTAL_FLAG[name]
        raise OverQuota(
            f"all client sessions together would hold {after} {_WHAT[name]} of {base} "
            f"({where}); the last {kept} (--quota-reserve) are kept for sessions that hold "
            f"little (at most {small} each, --max-client-total-share of it), and this one "
            f"would hold {have + n}: release or commit what it holds, then retry")

    def take(self, p: Pending, distinct: list[Obj]) -> None:
        """`p` (admitted) opened: it counts until `give`. A lease pins `distinct` (its
        objects, each once)."""
        h = self._by_holder.get(p.holder)
        if h is None:
            h = self._by_holder[p.holder] = Held()
        if p.kind == "store":
            for held in (h, self.total):
                held.stores += 1
                held.store_bytes += p.nbytes
            return
        added = first = 0
        leased, sessions = h.leased, self._sessions_of
        get = leased.get
        for o in distinct:
            n = get(o, 0)
            leased[o] = n + 1
            if not n:
                added += o.slot
                k = sessions.get(o, 0)
                sessions[o] = k + 1
                if not k:
                    first += o.slot
        h.lease_bytes += added
        self.total.lease_bytes += first
        for held in (h, self.total):
            held.leases += 1
            held.lease_keys += len(p.objs)

    def give(self, p: Pending) -> None:
        """`p` no longer counts (it left every table of pending.py)."""
        h = self._by_holder[p.holder]
        if p.kind == "store":
            for held in (h, self.total):
                held.stores -= 1
                held.store_bytes -= p.nbytes
        else:
            freed = last = 0
            leased, sessions = h.leased, self._sessions_of
            for o in (dict.fromkeys(p.objs) if p.repeats else p.objs):
                n = leased[o] - 1
                if n:
                    leased[o] = n
                    continue
                del leased[o]
                freed += o.slot
                k = sessions[o] - 1
                if k:
                    sessions[o] = k
                else:
                    del sessions[o]
                    last += o.slot
            h.lease_bytes -= freed
            self.total.lease_bytes -= last
            for held in (h, self.total):
                held.leases -= 1
                held.lease_keys -= len(p.objs)
        if h.empty():
            del self._by_holder[p.holder]

    def seen(self, holder: bytes) -> None:
        """The holder spoke: it has a socket again (a reconnect keeps its session)."""
        h = self._by_holder.get(holder)
        if h is not None:
            h.gone = False

    def session_gone(self, holder: bytes) -> None:
        h = self._by_holder.get(holder)
        if h is not None:
            h.gone = True

    def is_gone(self, holder: bytes) -> bool:
        h = self._by_holder.get(holder)
        return h is not None and h.gone

    def snapshot(self) -> dict:
        t = self.total
        return {"held_leases": t.leases, "held_stores": t.stores,
                "held_lease_keys": t.lease_keys, "held_lease_bytes": t.lease_bytes,
                "held_store_bytes": t.store_bytes, "holders": len(self._by_holder)}
