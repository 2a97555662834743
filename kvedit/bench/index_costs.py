"""Index costs that must not grow with the work: ratios vs a small baseline.

  kvedit bench index [--leased 100000] [--holes 300000] [--objects 1000000] [--json]
  (or python -m kvedit.bench.index_costs ...)

- `store_256_ms[K]`: one 256-chunk store into a full pool whose K least recently used
  objects are leased (each chunk must evict one unleased object, past the K leased ones).
- `alloc_8k_us`: an 8 KiB allocation when the pool has `holes` isolated one-page free holes
  and one three-page hole (the only fit).
- `cache_page`: one /cache page of 100 (one model, from the middle) and `snapshot()` at
  `objects` ready objects.
Each is also measured at a small baseline in the same run (K=0 leased, 0 holes, 10k objects)
and reported as a ratio: ~1 means the cost does not grow with K / holes / objects.
No server process: this measures the data structures alone. `measure(index_cls, alloc_cls)`
takes the classes so an older implementation can be measured the same way.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import time

from kvedit.server.index import Index
from kvedit.server.pool import Allocator

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


def page_at(index_cls, alloc_cls, objects: int, limit: int = 100) -> tuple[float, float]:
    """Microseconds of a /cache page (from the middle, one model of two) and of snapshot()
    at `objects` ready objects. Needs an index with page() and snapshot()."""
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
    return (t1 - t0) * 1e6, (t2 - t1) * 1e6


def _best(fn, reps: int) -> float:
    """The best of `reps` runs (the machine is shared: the minimum is the cost)."""
    return min(fn() for _ in range(reps))


def measure(index_cls, alloc_cls, leased: list[int], holes: int, objects: int | None = None,
            reps: int = 3) -> dict:
    base_store = _best(lambda: store_with_leased_head(index_cls, alloc_cls, 0), reps)
    store = {k: _best(lambda: store_with_leased_head(index_cls, alloc_cls, k), reps)
             for k in leased}
    base_alloc = _best(lambda: alloc_with_holes(alloc_cls, 0), reps)
    alloc = _best(lambda: alloc_with_holes(alloc_cls, holes), reps)
    out = {
        "store_256_ms": {"0": round(base_store, 2)} | {str(k): round(v, 2)
                                                       for k, v in store.items()},
        "store_256_ratio_vs_0_leased": {str(k): round(v / base_store, 2)
                                        for k, v in store.items()},
        "alloc_8k_us": {"0": round(base_alloc, 1), str(holes): round(alloc, 1)},
        "alloc_8k_ratio_vs_0_holes": round(alloc / base_alloc, 2),
    }
    if objects:
        small = [page_at(index_cls, alloc_cls, 10_000) for _ in range(reps)]
        large = [page_at(index_cls, alloc_cls, objects) for _ in range(reps)]
        page0, snap0 = min(p for p, _ in small), min(s for _, s in small)
        page1, snap1 = min(p for p, _ in large), min(s for _, s in large)
        out |= {"cache_page_us": {"10000": round(page0, 1), str(objects): round(page1, 1)},
                "cache_page_ratio_vs_10k": round(page1 / page0, 2),
                "snapshot_us": {"10000": round(snap0, 1), str(objects): round(snap1, 1)},
                "snapshot_ratio_vs_10k": round(snap1 / snap0, 2)}
    return out


def run(args) -> None:
    leased = [int(x) for x in args.leased.split(",")]
    res = measure(Index, Allocator, leased, args.holes, args.objects, args.reps)
    print(json.dumps(res) if args.json else json.dumps(res, indent=2))


def _arguments(p) -> None:
    p.add_argument("--leased", default="100000",
                   help="comma-separated counts of leased objects at the LRU head")
    p.add_argument("--holes", type=int, default=300_000, help="free one-page holes")
    p.add_argument("--objects", type=int, default=1_000_000,
                   help="ready objects for the /cache page cost (0: skip; ~0.6 GB at 1M)")
    p.add_argument("--reps", type=int, default=3, help="runs of each; the best counts")
    p.add_argument("--json", action="store_true", help="print only the JSON object")


def register(bsub) -> None:
    p = bsub.add_parser("index", help="index/allocator costs vs leased objects, holes, objects",
                        description=__doc__.splitlines()[0])
    _arguments(p)
    p.set_defaults(func=run)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _arguments(ap)
    run(ap.parse_args())
