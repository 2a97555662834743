"""What the HTTP API reads from and does to the service, in one place.

Every function here is a narrow read or action on the service; the HTTP routes never touch
the index, the arena or the lock. /status and /metrics must stay O(1) in the number of
objects and /cache O(page): the service's snapshot() / page() / clear() give that.
TEMPORARY: until those land (A1/A2, issue 9 item 10), `_Scan` below reads the index under
the lock with full scans, as the stdlib server did; it goes away when they exist.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvedit.server.service import Service


class UnknownModel(LookupError):
    """DELETE /cache?model=M or GET /cache?model=M for a model that is not registered."""


@dataclass(slots=True)
class CacheItem:
    key: str          # hex
    model: str
    tp_rank: int
    bytes: int
    age_s: float
    leases: int


@dataclass(slots=True)
class CachePage:
    items: list[CacheItem]
    next_after: str | None   # opaque cursor for the next page; None on the last page
    total: int               # ready objects (of the model, when one was asked for)


def _cursor(model: str, tp_rank: int, key: bytes) -> str:
    return f"{key.hex()}.{tp_rank}.{model}"


def status(s: Service) -> dict:
    snap = _snapshot(s)
    return {
        "version": s.info.version, "instance": s.instance,
        "transfer_mode": snap["transfer_mode"],
        "shm_name": s.cfg.shm_name, "shm_path": s.arena.path or None,
        "lazy": s.cfg.l1_use_lazy, "eviction_policy": s.cfg.eviction_policy,
        "chunk_size": s.cfg.chunk_size,
        "pool": {"bytes": snap["pool_bytes"], "used": snap["pool_used"],
                 "free": snap["pool_free"]},
        "objects": {k: snap[k] for k in ("ready", "writing", "leased")},
        "leases": snap["leases"], "pending_stores": snap["pending_stores"],
        "evictions": snap["evictions"], "uptime_s": snap["uptime_s"],
        # everything else the service counts (expirations, quarantine, waits...) as is
        "counters": {k: v for k, v in snap.items() if isinstance(v, int | float)},
        "models": _models(s), "notes": list(s.arena.notes),
    }


def config(s: Service) -> dict:
    return s.cfg.to_dict()


def metrics(s: Service) -> bytes:
    with s.lock:
        return s.metrics.render()


def model_names(s: Service) -> set[str]:
    with s.lock:
        return {m for m, _ in s.layouts}


def page(s: Service, model: str | None, after: str | None, limit: int) -> CachePage:
    if model is not None and model not in model_names(s):
        raise UnknownModel(model)
    now = time.time()
    with s.lock:  # TEMPORARY full scan (see the module docstring)
        objs = sorted((_cursor(o.model, o.tp_rank, o.key), o) for o in s.index.ready.values()
                      if model is None or o.model == model)
        total = len(objs)
        start = 0
        if after is not None:
            import bisect
            start = bisect.bisect_right([c for c, _ in objs], after)
        chunk = objs[start:start + limit]
        items = [CacheItem(o.key.hex(), o.model, o.tp_rank, o.nbytes,
                           round(now - o.created, 3), o.leases) for _, o in chunk]
    nxt = chunk[-1][0] if chunk and start + limit < total else None
    return CachePage(items, nxt, total)


def clear(s: Service, model: str | None) -> int:
    with s.lock:
        if model is not None and model not in {m for m, _ in s.layouts}:
            raise UnknownModel(model)
        return s.index.clear(model)


def _snapshot(s: Service) -> dict:
    with s.lock:
        return s.state()


def _models(s: Service) -> dict[str, list[dict]]:
    with s.lock:
        layouts = sorted(s.layouts.items())
    models: dict[str, list[dict]] = {}
    for (m, _), lay in layouts:
        d = {f: getattr(lay, f) for f in lay.__struct_fields__ if f != "rope"}
        d["rope"] = None if lay.rope is None else {
            f: getattr(lay.rope, f) for f in lay.rope.__struct_fields__}
        d["chunk_bytes"] = lay.chunk_bytes
        models.setdefault(m, []).append(d)
    return models
