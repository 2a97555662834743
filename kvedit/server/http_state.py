"""What the HTTP API reads from and does to the service, in one place.

Each function is one narrow call on the service, which takes its lock itself for an O(1)
snapshot, the registered layouts (at most --max-models), an O(page) page or a clear; the
routes never touch the index, the arena or the lock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone

from kvedit.server.config import redacted
from kvedit.server.service import Service


class UnknownModel(LookupError):
    """GET or DELETE /cache?model=M for a model that is not registered."""


@dataclass(slots=True)
class CacheItem:
    key: str          # hex
    model: str
    tp_rank: int
    bytes: int
    age_s: float
    leases: int
    kind: str         # "kv" (a KV chunk) or "queries" (a request's captured queries)


@dataclass(slots=True)
class CachePage:
    items: list[CacheItem]
    next_after: int | None   # cursor for the next page; None on the last page
    total: int               # ready objects (of the model, when one was asked for)


def status(s: Service) -> dict:
    snap = s.snapshot()
    return {
        "version": s.info.version, "instance": s.instance,
        "transfer_mode": snap["transfer_mode"],
        "shm_name": s.cfg.shm_name, "shm_path": s.arena.path or None,
        "lazy": s.cfg.l1_use_lazy, "eviction_policy": s.cfg.eviction_policy,
        "chunk_size": s.cfg.chunk_size,
        "pool": {"bytes": snap["pool_bytes"], "used": snap["pool_used"],
                 "free": snap["pool_free"]},
        "objects": {k: snap[k] for k in ("ready", "writing", "leased")},
        # the captured-queries objects among the ready ones (kind "queries")
        "queries": {"objects": snap["query_objects"], "bytes": snap["query_bytes"]},
        "leases": snap["leases"], "pending_stores": snap["pending_stores"],
        "evictions": snap["evictions"], "uptime_s": snap["uptime_s"],
        # everything else the service counts (expirations, quarantine, waits, ...) as is
        "counters": {k: v for k, v in snap.items()
                     if isinstance(v, int | float) and not isinstance(v, bool)},
        "models": _models(s), "notes": list(s.arena.notes),
    } | ({"l2": _l2(s, snap)} if s.cfg.l2_url else {})


def config(s: Service) -> dict:
    return s.cfg.to_dict()


def metrics(s: Service) -> bytes:
    return s.metrics.render()   # its collector reads s.snapshot(), which takes the lock


def model_names(s: Service) -> list[str]:
    return list(s.models())


def page(s: Service, model: str | None, after: int | None, limit: int) -> CachePage:
    if model is not None and model not in model_names(s):
        raise UnknownModel(model)
    p = s.page(model, after, limit)
    now = time.time()
    items = [CacheItem(e.key.hex(), e.model, e.tp_rank, e.nbytes, round(now - e.created, 3),
                       e.leases, e.kind) for e in p.items]
    return CachePage(items, p.next_after, p.total)


def clear(s: Service, model: str | None) -> int:
    try:
        return s.clear(model)
    except LookupError:
        raise UnknownModel(model) from None


def _l2(s: Service, snap: dict) -> dict:
    """The second tier at a glance (its counters are also under "counters" as l2_*)."""
    c = s.cfg
    return {"url": redacted(c.l2_url), "up": bool(snap["l2_up"]), "write_on": c.l2_write_on,
            "queue": {"depth": snap["l2_queue_depth"], "bytes": snap["l2_queue_bytes"],
                      "max_bytes": c.l2_queue_bytes},
            **{k: snap["l2_" + k] for k in ("probes", "hits", "misses", "corrupt", "writes",
                                            "write_dropped", "write_skipped", "errors",
                                            "outages")},
            "writing": snap["l2_writing"], "promotions_queued": snap["l2_probes_queued"],
            # which nodes serve slots, and which failed during the current outage since when
            "masters": s.l2.masters(),
            "down_nodes": [{"node": n, "since": _iso(t), "for_s": round(time.time() - t, 3)}
                           for n, t in snap["l2_down_nodes"].items()]}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


def _models(s: Service) -> dict[str, list[dict]]:
    return {m: [_layout_dict(lay) for lay in lays] for m, lays in s.models().items()}


def _layout_dict(lay) -> dict:
    d = {f: getattr(lay, f) for f in lay.__struct_fields__ if f != "rope"}
    d["rope"] = None if lay.rope is None else {
        f: getattr(lay.rope, f) for f in lay.rope.__struct_fields__}
    d["chunk_bytes"] = lay.chunk_bytes
    return d
