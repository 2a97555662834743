"""What the index hands out and refuses with: refusals (each a protocol error code), the
state of objects and pending stores/leases, the counters, and the named results of index.py.
Shared by index.py, pending.py, eviction.py and pages.py; other modules import them from
kvedit.server.index (it re-exports every name here)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from kvedit.protocol import ErrorCode, ObjectKind

WRITING, READY = "writing", "ready"
Ident = tuple[str, int, bytes]          # (model, tp_rank, key)
Kind = Literal["store", "lease"]
GoneReason = Literal["expired", "cut", "failed"]   # how a store/lease ended early
GONE_CAP = 16384        # recently ended ids remembered for store_expired/lease_expired replies
FINISH_GRACE = 2.0      # seconds a store has left after its PUT finished, for the Commit to come


# ---- refusals ---------------------------------------------------------------------------
class Refused(Exception):
    """An operation the index refuses; `code` is the protocol error code of the reply."""
    code: ClassVar[ErrorCode] = "internal"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class PoolFull(Refused):
    code = "pool_full"


class UnknownStore(Refused):
    code = "unknown_store"


class UnknownLease(Refused):
    code = "unknown_lease"


class StoreExpired(Refused):
    code = "store_expired"


class LeaseExpired(Refused):
    code = "lease_expired"


class NotHolder(Refused):
    code = "not_holder"


class Busy(Refused):
    code = "busy"


class OverQuota(Refused):
    """The client session (or all of them) already holds as many leases, stores, leased keys
    or pinned bytes as the server allows (quota.py)."""
    code = "over_quota"


# ---- state ------------------------------------------------------------------------------
@dataclass(slots=True, eq=False)
class Obj:
    model: str
    tp_rank: int
    key: bytes
    offset: int
    nbytes: int
    slot: int = 0            # nbytes rounded to pages: the size class of the eviction order
    state: str = WRITING
    created: float = field(default_factory=time.time)
    leases: int = 0
    pins: int = 0            # quarantine pins: expired leases/stores whose holder may still
                             # touch the slot (not evictable, not freed while > 0)
    live: bool = True        # False once evicted/deleted/aborted: hidden, freed once neither
                             # leased nor pinned
    seq: int = 0             # commit order (the /cache cursor); 0 while WRITING
    rank: int = 0            # place in the eviction order (LRU: last use, FIFO: commit)
    hot: bool = False        # ARC: used again since it entered (its T2 queue), eviction.py
    evictable: bool = False  # in the eviction order right now
    kind: ObjectKind = "kv"  # which key space (Index table) it lives in

    @property
    def ident(self) -> Ident:
        return (self.model, self.tp_rank, self.key)


@dataclass(slots=True, eq=False)
class Pending:
    """A prepared store or a read lease: its objects, holder and deadlines, and what it counts
    against its holder's quota (quota.py) from open until it leaves every table (closed, or
    its quarantine ended)."""
    kind: Kind
    id: int
    holder: bytes
    objs: list[Obj]          # a lease: each object once (in key order for a data-link GET)
    deadline: float
    started: float
    transfer_deadline: float | None = None   # set while the data link moves its bytes
    nbytes: int = 0          # a store: the slot bytes it pins (quota.py)
    repeats: bool = False    # a lease whose objs list an object more than once (ordered)
    counted: bool = False    # still counted against its holder's quota (take, not yet give)

    @property
    def busy(self) -> bool:
        return self.transfer_deadline is not None


@dataclass(slots=True)
class Gone:
    """A store/lease id that ended other than by commit/abort/release (for late replies)."""
    holder: bytes
    reason: GoneReason


@dataclass(slots=True)
class Quarantined:
    """One expired store/lease whose objects are pinned (one pin per entry of its list, the
    list itself, not a copy) until the holder acknowledges, its session goes, or the
    deadline passes."""
    pending: Pending
    deadline: float

    @property
    def holder(self) -> bytes:
        return self.pending.holder

    @property
    def objs(self) -> list[Obj]:
        return self.pending.objs


@dataclass(slots=True)
class Counters:
    """Everything /status, /stats and /metrics show about the index, kept as things change.
    One writer per field: pending.py writes pending_stores, leases, transfers, expired_*,
    cut_transfers and quarantined_*; index.py writes the rest (objects, pool, evictions)."""
    objects: int = 0            # live objects (ready + writing)
    ready: int = 0
    writing: int = 0
    leased: int = 0             # objects with at least one lease (hidden ones too, until released)
    leases: int = 0
    pending_stores: int = 0
    transfers: int = 0          # data-link transfers in progress
    evictions: int = 0
    expired_leases: int = 0
    expired_stores: int = 0
    cut_transfers: int = 0
    quarantined_objects: int = 0  # distinct objects with a quarantine pin (deleted or live)
    quarantined_bytes: int = 0    # their slot bytes (a live one may also be leased anew)
    pool_bytes: int = 0
    pool_used: int = 0
    pool_free: int = 0
    query_objects: int = 0        # ready objects of kind "queries" (also counted in `ready`)
    query_bytes: int = 0          # their bytes (the objects' own size, not rounded slots)


# ---- results ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Prepared:
    store_id: int
    missing: list[int]       # indices (into the request's keys) this store must write
    offsets: list[int]       # their slots, same order
    present: int             # keys already ready or being written by another store


@dataclass(frozen=True, slots=True)
class Committed:
    store_id: int
    objs: list[Obj]          # now READY (wake the waiters parked on their idents)
    nbytes: int
    started: float           # monotonic time of prepare


@dataclass(frozen=True, slots=True)
class Leased:
    lease_id: int
    objs: list[Obj]          # the leading ready objects, leased (possibly none)
    offsets: list[int]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Released:
    lease_id: int
    nbytes: int
    started: float           # monotonic time of the retrieve


@dataclass(frozen=True, slots=True)
class Slot:
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """What a data-link PUT writes / GET sends: slots in key order, and until when."""
    id: int
    slots: list[Slot]
    nbytes: int
    deadline: float          # monotonic; past it the index cuts the transfer
    started: float           # monotonic time of the prepare-store / retrieve


@dataclass(frozen=True, slots=True)
class Expiry:
    stores: int = 0          # stores expired now
    leases: int = 0          # leases expired now
    cut: list[int] = field(default_factory=list)   # store/lease ids whose transfer is cut
    unquarantined: int = 0   # bytes freed as quarantine deadlines passed (deleted objects;
                             # live ones go back to the eviction order, not counted)


@dataclass(frozen=True, slots=True)
class CacheEntry:
    seq: int                 # the cursor: pass it as `after` for the next page
    model: str
    tp_rank: int
    key: bytes
    nbytes: int
    created: float           # time.time() at prepare
    leases: int
    kind: ObjectKind = "kv"


@dataclass(frozen=True, slots=True)
class Page:
    items: list[CacheEntry]
    next_after: int | None   # None: this was the last page
    total: int               # ready objects of that model (or all)
