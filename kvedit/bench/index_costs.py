"""In-process costs of the server's index and allocator (issue 9, item 10), as JSON.

  python -m kvedit.bench.index_costs [--leased 1000,10000,100000] [--holes 300000]
                                     [--objects 1000000]

- `store_256_ms[K]`: one 256-chunk store into a full pool whose K least recently used
  objects are leased (each chunk must evict one unleased object, past the K leased ones).
- `alloc_8k_us`: an 8 KiB allocation when the pool has `holes` isolated one-page free holes
  and one three-page hole (the only fit).
- `cache_page`: one /cache page of 100 (one model, from the middle) and `snapshot()` at
  `objects` ready objects.
No server process: this measures the data structures alone. `measure(index_cls, alloc_cls)`
takes the classes so an older implementation can be measured the same way.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import time

PAGE = 4096
HOLDER = b"bench-holder-000"


def _call(fn, *args):
    """Call an index method with a holder if this version of the index takes one."""
    if "holder" in inspect.signature(fn).parameters:
        return fn(*args, HOLDER)
    return fn(*args)


def _sid(prepared) -> int:
    return prepared.store_id if hasattr(prepared, "store_id") else prepared[0]


def store_with_leased_head(index_cls, alloc_cls, leased: int, chunks: int = 256) -> float:
    """Milliseconds of one `chunks`-chunk store that must evict past `leased` leased objects."""
    total = leased + chunks
    ix = index_cls(alloc_cls(PAGE, total * PAGE), "LRU", 300.0, 300.0)
    keys = [i.to_bytes(16, "big") for i in range(total)]

    def fill(ks):
        for lo in range(0, len(ks), 4096):
            _call(ix.commit, _sid(_call(ix.prepare, "m", 0, ks[lo:lo + 4096], PAGE)))
    fill(keys[:leased])
    _call(ix.lease, "m", 0, keys[:leased])        # leased first: the LRU head
    fill(keys[leased:])                           # then the pool fills up behind them
    new = [(total + i).to_bytes(16, "big") for i in range(chunks)]
    gc.collect()
    t = time.perf_counter()
    _call(ix.prepare, "m", 0, new, PAGE)
    return (time.perf_counter() - t) * 1e3


def alloc_with_holes(alloc_cls, holes: int, reps: int = 20) -> float:
    """Microseconds of an 8 KiB alloc (+ its free) among `holes` one-page holes."""
    n = 2 * holes + 3
    a = alloc_cls(PAGE, n * PAGE)
    offs = [a.alloc(PAGE) for _ in range(n)]
    for off in offs[0:2 * holes:2]:
        a.free(off, PAGE)
    for off in offs[-3:]:                         # one three-page hole, freed last: the only
        a.free(off, PAGE)                         # fit, and not of the exact size asked for
    gc.collect()
    t = time.perf_counter()
    for _ in range(reps):
        off = a.alloc(2 * PAGE)
        assert off == offs[-3], "the three-page hole is the only fit"
        a.free(off, 2 * PAGE)
    return (time.perf_counter() - t) / reps * 1e6


def page_at(index_cls, alloc_cls, objects: int, limit: int = 100) -> dict:
    """Microseconds of a /cache page (from the middle, one model of two) and of snapshot()
    at `objects` ready objects. Needs the issue-9 index (page/snapshot)."""
    ix = index_cls(alloc_cls(PAGE, objects * PAGE), "LRU", 300.0, 300.0)
    keys = [i.to_bytes(16, "big") for i in range(objects)]
    for lo in range(0, objects, 4096):
        model = "ab"[lo // 4096 % 2]
        _call(ix.commit, _sid(_call(ix.prepare, model, 0, keys[lo:lo + 4096], PAGE)))
    mid = ix.page(None, None, objects // 2).items[-1].seq
    gc.collect()
    t0 = time.perf_counter()
    p = ix.page("a", mid, limit)
    t1 = time.perf_counter()
    ix.snapshot()
    t2 = time.perf_counter()
    assert len(p.items) == limit
    return {"objects": objects, "page_us": round((t1 - t0) * 1e6, 1),
            "snapshot_us": round((t2 - t1) * 1e6, 1)}


def measure(index_cls, alloc_cls, leased: list[int], holes: int, reps: int = 3) -> dict:
    """The best of `reps` runs of each (the machine is shared: the minimum is the cost)."""
    return {"store_256_ms": {str(k): round(min(store_with_leased_head(index_cls, alloc_cls, k)
                                               for _ in range(reps)), 2) for k in leased},
            "alloc_8k_us": round(alloc_with_holes(alloc_cls, holes), 1), "holes": holes}


def main(argv: list[str] | None = None) -> None:
    from kvedit.server.index import Index
    from kvedit.server.pool import Allocator
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leased", default="1000,10000,100000")
    ap.add_argument("--holes", type=int, default=300_000)
    ap.add_argument("--objects", type=int, default=1_000_000, help="for the /cache page cost")
    args = ap.parse_args(argv)
    leased = [int(x) for x in args.leased.split(",")]
    out = measure(Index, Allocator, leased, args.holes)
    out["cache_page"] = page_at(Index, Allocator, args.objects)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
