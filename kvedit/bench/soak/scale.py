"""`kvedit bench soak`'s scaling phase: the loop with a million objects in the index.

The index is filled with up to --scale-objects 4 KiB objects (prepared and committed, never
written: a lazy pool then costs no memory). Then, a Hello or a one-key lookup measuring the
loop throughout (a request waits behind whatever the loop is doing):
- lookups with nobody scraping, and while /metrics, /status and /cache pages are scraped;
- the key-watch phase on that server (watch.py);
- stores of 8,192 new keys into a full pool, each evicting as many objects;
- the Unregister of the million-object model (answered at once, deleted in slices).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from kvedit import auth
from kvedit import protocol as P
from kvedit.bench.soak import watch
from kvedit.bench.soak.common import RawPeer
from kvedit.bench.soak.summary import pct
from kvedit.bench.soak.watch import Prober, hello_stats
from kvedit.client import KVClient
from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout

TINY_KEYS = 8192   # keys of one store here: --max-keys-per-request's default


def rss_mb(pid: int, field: str = "own") -> float:
    """A resident-memory figure of /proc/PID/status in MiB: VmRSS (all resident pages, the
    pool's shared-memory pages the server touched included), RssAnon (the heap), or "own":
    VmRSS without RssShmem, the server's own memory whatever the pool holds (the pool's
    pages are bounded by --pool-mb by construction; a leak grows the rest)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssShmem"):
            fields[name] = int(rest.split()[0]) / 1024
    if field == "own":
        return fields.get("VmRSS", 0.0) - fields.get("RssShmem", 0.0)
    return fields.get(field, 0.0)


def scaling_phase(args, secret_file: str) -> dict:
    """Fill the index with up to --scale-objects 4 KiB objects (prepared and committed, never
    written: a lazy pool then costs no memory), then time a one-key lookup with nobody
    scraping (5 s), and while /metrics, /status and /cache pages are scraped back to back;
    then the key-watch phase, evicting stores into a full pool, and the Unregister of it
    all."""
    tiny = ModelLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16",
                       chunk_size=256)          # 2 x 1 x 256 x 4 x 2 bytes = 4 KiB
    n = args.scale_objects
    pool_gb = (n * tiny.chunk_bytes * 1.02 + (64 << 20)) / 2**30
    out: dict = {"objects_asked": n, "chunk_bytes": tiny.chunk_bytes}
    pool_gb += (args.watch_objects + 10 * 8192) * tiny.chunk_bytes * 1.02 / 2**30
    with start_server(pool_gb, lazy=True, extra_args=["--secret-file", secret_file]) as srv, \
            KVClient(srv.url, secret_file=secret_file, timeout=120) as c:
        c.register("scale", tiny)
        t0 = time.monotonic()
        filled, batch = 0, 8192
        while filled < n and time.monotonic() - t0 < args.scale_seconds:
            keys = [i.to_bytes(16, "little") for i in range(filled, min(n, filled + batch))]
            c.prepare_store("scale", keys).commit()
            filled += len(keys)
        out |= {"objects": filled, "fill_s": round(time.monotonic() - t0, 1)}
        out |= _probe(srv, secret_file)
        out["server_rss_mb"] = round(rss_mb(srv.pid), 1)
        if args.watch_phase:
            out["watch"] = _watch_phase(srv, c, secret_file, args.watch_objects)
        secret = auth.load_secret(None, secret_file)
        out["evicting_stores"] = _evicting_stores(srv, c, secret, tiny)
        out["unregister"] = _unregister(srv, c, secret)
    return out


def _loop(c) -> dict:
    """The server's own loop figures (metrics.py LoopTurns: CPU time per turn of the loop,
    which load on the box does not inflate)."""
    s = c.stats()
    return {k: v for k, v in s.items() if k.startswith("loop_turns")}


def loop_delta(before: dict, after: dict) -> dict:
    """Turns of the server's loop between two `_loop` readings, and those over 10 and 50 ms
    of CPU: the phase's load-proof twin of its Hello waits."""
    return {k.replace("loop_turns", "turns"): after[k] - before[k] for k in after
            if k in before}


def _keys(start: int, n: int, tag: bytes) -> list[bytes]:
    return [tag + i.to_bytes(15, "little") for i in range(start, start + n)]


def _evicting_stores(srv, c, secret: bytes | None, tiny, stores: int = 10) -> dict:
    """What is left of the pool filled by a model of its own; then stores of 8,192 new keys,
    each evicting as many (it is parked while the loop evicts a slice at a time)."""
    c.register("fill", tiny)
    t0, n = time.monotonic(), 0
    while c.stats()["pool_free"] >= TINY_KEYS * tiny.chunk_bytes and \
            time.monotonic() - t0 < 300:
        c.prepare_store("fill", _keys(n, TINY_KEYS, b"f")).commit()
        n += TINY_KEYS
    before = c.stats()["evictions"]
    with Prober(srv.url, secret) as probe:
        time.sleep(3)
        t_idle = time.monotonic()
        loop0 = _loop(c)
        for i in range(stores):
            c.prepare_store("scale", _keys(i * TINY_KEYS, TINY_KEYS, b"e")).commit()
        loop1 = _loop(c)
        t_end = time.monotonic()
        time.sleep(0.5)
    return {"filled": n, "stores": stores, "keys_each": TINY_KEYS,
            "evictions": c.stats()["evictions"] - before, "seconds": round(t_end - t_idle, 2),
            "server_loop": loop_delta(loop0, loop1),
            "hello_idle": hello_stats(probe.between(t_idle - 3, t_idle)),
            "hello_during": hello_stats(probe.between(t_idle, t_end + 0.1))}


def _unregister(srv, c, secret: bytes | None, model: str = "scale") -> dict:
    """Unregister the model of a million objects: answered at once, its objects deleted a
    slice at a time, the loop probed throughout."""
    peer = RawPeer({"url": srv.url})
    if secret is not None and peer.secret is None:
        peer.secret = secret
        peer.reset()
    ready = c.stats()["ready"]
    try:
        with Prober(srv.url, secret) as probe:
            time.sleep(3)
            loop0 = _loop(c)
            t0 = time.monotonic()
            r = peer.call(P.Unregister(model=model), 60.0)
            t_reply = time.monotonic()
            n = r.n if isinstance(r, P.Count) else 0
            while c.stats()["ready"] > ready - n and time.monotonic() < t0 + 600:
                time.sleep(0.05)
            t_gone = time.monotonic()
            loop1 = _loop(c)
            time.sleep(0.5)
    finally:
        peer.close()
    return {"objects": n, "reply": type(r).__name__ if r is not None else None,
            "server_loop": loop_delta(loop0, loop1),
            "reply_ms": round((t_reply - t0) * 1e3, 2), "deleted_s": round(t_gone - t0, 2),
            "hello_idle": hello_stats(probe.between(t0 - 3, t0)),
            "hello_during": hello_stats(probe.between(t0, t_gone + 0.1))}


def _watch_phase(srv, client, secret_file: str, objects: int) -> dict:
    secret = auth.load_secret(None, secret_file)

    def rss() -> float:
        return rss_mb(srv.pid)

    out = {"attacker": watch.watch_attack(srv, rss, secret, "scale")}
    with httpx.Client(base_url=srv.http_url, headers=auth.bearer_header(secret),
                      timeout=600) as http:
        out["delete"] = watch.watched_delete(srv, client, secret, rss, http, objects)
    out["loop_cpu"] = watch.loop_costs(objects)   # load-proof: thread CPU time
    return out


def _probe(srv, secret_file: str, idle_s: float = 5.0, busy_s: float = 10.0) -> dict:
    headers = auth.bearer_header(auth.load_secret(None, secret_file))
    http = httpx.Client(base_url=srv.http_url, headers=headers, timeout=60)
    ready = http.get("/status").json()["objects"]["ready"]
    peer = RawPeer({"url": srv.url, "secret_file": secret_file})
    probe = P.Lookup(model="scale", keys=[(7).to_bytes(16, "little")])

    def lookups(seconds: float) -> list[float]:
        lat, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            s0 = time.perf_counter()
            r = peer.call(probe, 5.0)
            lat.append((time.perf_counter() - s0) * 1e3 if r is not None else 5000.0)
            time.sleep(0.01)
        return lat

    idle = lookups(idle_s)   # the same-run baseline: nobody scraping
    stop = threading.Event()
    scrapes: dict[str, list[float]] = {"/metrics": [], "/status": [], "/cache": []}

    def scrape():
        for i in range(30_000):   # bounded; the event stops it long before
            if stop.is_set():
                return
            path = "/metrics" if i % 3 != 2 else ("/status", "/cache")[i // 3 % 2]
            s0 = time.perf_counter()
            http.get(path, params={"limit": 1000} if path == "/cache" else None
                     ).raise_for_status()
            scrapes[path].append((time.perf_counter() - s0) * 1e3)

    th = threading.Thread(target=scrape, daemon=True)
    th.start()
    busy = lookups(busy_s)
    stop.set()
    th.join(60)
    peer.close()
    http.close()
    return {"ready_in_status": ready, "lookups": len(busy),
            "scale_lookup_p50_ms": pct(busy, 0.5), "scale_lookup_p99_ms": pct(busy, 0.99),
            "scale_lookup_max_ms": pct(busy, 1.0),
            "idle_lookup_p50_ms": pct(idle, 0.5), "idle_lookup_p99_ms": pct(idle, 0.99),
            "idle_lookup_max_ms": pct(idle, 1.0),
            "scrapes": {p: {"n": len(v), "p50_ms": pct(v, 0.5), "max_ms": pct(v, 1.0)}
                        for p, v in scrapes.items()}}
