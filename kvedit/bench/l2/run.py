"""`kvedit bench l2` in its single-Redis mode (the package docstring says what it measures):
write-behind and promotion against redis-py on the same bytes, the fixed cost of a promoted
chunk, write on commit vs on eviction, and with --vllm the L2-hit TTFT; `--cluster` hands
over to cluster.py."""
from __future__ import annotations

import json
import os
import statistics
import time

import redis
import torch

from kvedit.bench.l2.cluster import run_cluster
from kvedit.bench.l2.paths import (ServerPair, qwen3_8b_layout, random_chunks, ttft_two_engines,
                                   wait_counter)
from kvedit.client import KVClient
from kvedit.launch.redis import RedisProcess
from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout

MIB = 1 << 20


def run(args) -> int:
    if args.cluster:
        print(json.dumps(run_cluster(args), indent=None if args.json else 2))
        return 0
    with RedisProcess() as redis_proc:
        out = {"chunks": args.chunks, "rounds": args.rounds}
        out |= throughput(redis_proc.url, args.chunks, args.rounds)
        out |= promotion_overhead(redis_proc.url)
        out |= write_modes(redis_proc, args.chunks)
        if args.vllm:
            out |= ttft_two_engines(redis_proc.url)
    out["targets"] = {"l2_store_vs_redis": ">= 0.8", "l2_fetch_vs_redis": ">= 0.8",
                      "l2_hit_ttft_vs_recompute": "<= 0.3"}
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


def throughput(url: str, n: int, rounds: int) -> dict:
    layout = qwen3_8b_layout()
    data = random_chunks(layout, n)
    views = [memoryview(t.view(-1).view(torch.uint8).numpy()) for t in data]
    raw = redis.Redis.from_url(url)
    store_s, set_s, fetch_s, get_s, end_to_end_s = [], [], [], [], []
    with ServerPair(url, layout, n) as pair:
        for _ in range(rounds):
            r = pair.round(data)
            store_s.append(r["store_s"])
            end_to_end_s.append(r["until_in_l2_s"])
            fetch_s.append(r["fetch_s"])
            t0 = time.perf_counter()                # baseline: the same bytes, plain SETs
            for i, v in enumerate(views):
                raw.set(f"bench-raw:{i}", v)
            set_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()                # baseline: plain GETs of the same records
            for k in r["rkeys"]:
                raw.get(k)
            get_s.append(time.perf_counter() - t0)
            pair.forget(r)
        raw.delete(*[f"bench-raw:{i}" for i in range(n)])
    raw.close()
    gb = n * layout.chunk_bytes / 1e9
    return {"chunk_bytes": layout.chunk_bytes,
            "l2_write_GBps": gb / min(store_s), "redis_set_GBps": gb / min(set_s),
            "store_until_in_l2_s": min(end_to_end_s),
            "l2_promote_GBps": gb / min(fetch_s), "redis_get_GBps": gb / min(get_s),
            "l2_store_vs_redis": min(set_s) / min(store_s),
            "l2_fetch_vs_redis": min(get_s) / min(fetch_s),
            "promote_ms_per_36MiB_chunk": 1e3 * min(fetch_s) / n,
            "redis_get_ms_per_36MiB_chunk": 1e3 * min(get_s) / n}


def promotion_overhead(url: str, n: int = 256) -> dict:
    """Fixed cost per promoted chunk: 16 KiB chunks, so the bytes are cheap."""
    small = ModelLayout(num_layers=2, num_kv_heads=1, head_dim=32, dtype="bfloat16",
                        chunk_size=256)
    chunk = torch.zeros(small.chunk_shape, dtype=torch.bfloat16)
    args = ["--l2-url", url, "--l2-lookup-wait", "60"]
    with start_server(0.1, extra_args=args) as a, start_server(0.1, extra_args=args) as b, \
            KVClient(a.url) as ca, KVClient(b.url, timeout=120) as cb:
        for c in (ca, cb):
            c.register("small", small)
        best = float("inf")
        for r in range(3):
            keys = [os.urandom(16) for _ in range(n)]
            before = ca.stats()["l2_writes"]
            ca.store("small", keys, [chunk] * n)
            wait_counter(ca, "l2_writes", before + n)
            t0 = time.perf_counter()
            if cb.lookup("small", keys) != n:
                raise RuntimeError("bench l2: small chunks not all promoted")
            best = min(best, time.perf_counter() - t0)
            cb.delete("small", keys)
    return {"promotion_overhead_ms_per_chunk": 1e3 * best / n,
            "promotion_overhead_chunk_bytes": small.chunk_bytes}


def write_modes(redis_proc, n: int) -> dict:
    """Store 2n chunks (n at a time) into an L1 of n/2 chunks, in each write mode: the
    client's store time, and what reached L2 (commit: everything; evict: only the evicted)."""
    layout = qwen3_8b_layout()
    data = random_chunks(layout, n)
    pool_gb = max(1, n // 2) * layout.chunk_bytes / 2**30
    out = {}
    raw = redis.Redis.from_url(redis_proc.url)
    for mode in ("commit", "evict"):
        raw.flushall()
        args = ["--l2-url", redis_proc.url, "--l2-write-on", mode,
                "--l2-write-queue-mb", str(4 * n * 36)]
        with start_server(pool_gb, extra_args=args) as s, KVClient(s.url) as c:
            c.register("bench", layout)
            times = []
            for r in range(4):
                keys = [os.urandom(16) for _ in range(n)]
                t0 = time.perf_counter()
                for i in range(0, n, 4):           # stores of 4 chunks, as a connector step
                    c.store("bench", keys[i:i + 4], data[i:i + 4])
                times.append(time.perf_counter() - t0)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and \
                    (lambda x: x["l2_queue_depth"] or x["l2_writing"])(c.stats()):
                time.sleep(0.01)
            st = c.stats()
            out[f"store_s_per_{n}_chunks_write_on_{mode}"] = statistics.median(times[1:])
            out[f"l2_chunks_written_of_{4 * n}_write_on_{mode}"] = st["l2_writes"]
            out[f"l1_evictions_write_on_{mode}"] = st["evictions"]
    raw.flushall()
    raw.close()
    out["store_time_evict_vs_commit"] = (out[f"store_s_per_{n}_chunks_write_on_evict"]
                                         / out[f"store_s_per_{n}_chunks_write_on_commit"])
    return out
