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
the pool itself (every counted object sits in a slot). Counts are capped per session and in
total, so the memory of all leases and stores together is bounded whatever the number of
sessions. A refusal is `OverQuota` (protocol code `over_quota`): nothing was opened,
allocated or evicted. The server's own holders (L2 promotions) are `exempt` from the
per-session caps.

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
_WHAT = {"leases": "lease(s)", "stores": "pending store(s)", "lease_keys": "leased key(s)",
         "pinned_bytes": "bytes of pool slots (leased and pending)"}


@dataclass(slots=True)
class Quotas:
    limits: QuotaLimits
    exempt: frozenset[bytes] = frozenset()
    total: Held = field(default_factory=Held)
    _by_holder: dict[bytes, Held] = field(default_factory=dict)

    def held(self, holder: bytes) -> Held | None:
        return self._by_holder.get(holder)

    def admit(self, kind: Kind, holder: bytes, objs: list[Obj], nbytes: int = 0,
              distinct: list[Obj] | None = None) -> None:
        """Raise OverQuota when opening a lease of `objs` (the entries it keeps; `distinct`:
        each once, when known), or a store of `nbytes` slot bytes, would take `holder` (or
        everyone) over a cap."""
        lim, tot = self.limits, self.total
        mine = self._by_holder.get(holder) or Held()
        if kind == "lease":
            new = mine.new_lease_bytes(objs if distinct is None else distinct)
            want = {"leases": (1, lim.leases_per_client, lim.leases_total),
                    "lease_keys": (len(objs), lim.lease_keys_per_client,
                                   lim.lease_keys_total),
                    "pinned_bytes": (new, lim.bytes_per_client, None)}
        else:
            want = {"stores": (1, lim.stores_per_client, lim.stores_total),
                    "pinned_bytes": (nbytes, lim.bytes_per_client, None)}
        for name, (n, per_client, total) in want.items():
            if holder not in self.exempt and getattr(mine, name) + n > per_client:
                raise OverQuota(
                    f"this client session holds {getattr(mine, name)} {_WHAT[name]} and the "
                    f"{kind} would add {n}; at most {per_client} per session ({_FLAG[name]}; "
                    f"expired ones count until their quarantine ends): release or commit "
                    f"what it holds first")
            if total is not None and getattr(tot, name) + n > total:
                raise OverQuota(
                    f"all client sessions together hold {getattr(tot, name)} {_WHAT[name]} "
                    f"and the {kind} would add {n}; at most {total} ({_TOTAL_FLAG[name]}): "
                    f"retry later")

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
        added, leased = 0, h.leased
        get = leased.get
        for o in distinct:
            n = get(o, 0)
            leased[o] = n + 1
            if not n:
                added += o.slot
        for held in (h, self.total):
            held.leases += 1
            held.lease_keys += len(p.objs)
            held.lease_bytes += added

    def give(self, p: Pending) -> None:
        """`p` no longer counts (it left every table of pending.py)."""
        h = self._by_holder[p.holder]
        if p.kind == "store":
            for held in (h, self.total):
                held.stores -= 1
                held.store_bytes -= p.nbytes
        else:
            freed, leased = 0, h.leased
            for o in (dict.fromkeys(p.objs) if p.repeats else p.objs):
                n = leased[o] - 1
                if n:
                    leased[o] = n
                else:
                    del leased[o]
                    freed += o.slot
            for held in (h, self.total):
                held.leases -= 1
                held.lease_keys -= len(p.objs)
                held.lease_bytes -= freed
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
