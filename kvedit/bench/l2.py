"""`kvedit bench l2`: the Redis second tier against plain redis-py on the same bytes, same run.

Qwen3-8B-shaped chunks (36 layers, 8 KV heads, head_dim 128, bf16, 256 tokens = 36 MiB),
--chunks of them (default 16: a 4096-token prompt), one redis-server started here:
- l2_store_vs_redis: bytes/s of the server's write-behind (the writer thread's own time for
  one commit of all chunks: live checks, hash, MULTI/EXEC; counted by the tier) / bytes/s of
  redis-py SETs of the same bytes. Target >= 0.8. store_until_in_l2_s: the client's store
  plus the write-behind, until the tier counts every chunk written.
- l2_fetch_vs_redis: chunks/s of promotion (a lookup on a second server with an empty L1
  that falls through to Redis and promotes every chunk into L1) / chunks/s of redis-py GETs
  of the same records. Target >= 0.8.
- promotion overhead per chunk: the same fall-through with small chunks (16 KiB), where the
  bytes cost little and the per-chunk work (probe, slot, GET, CRC, commit, wake) shows.
- write-behind on commit vs on eviction: the client's store time with an L1 of a quarter of
  the data (so most stores evict), in each mode, and how much of the data reached L2.
- with --vllm: l2_hit_ttft_vs_recompute: two tiny-model vLLMs, each with its own server,
  sharing the Redis; a 4096-token prompt prefilled on A is served to B from L2 (B's first
  sight of it) / a fresh prompt recomputed on B. Target <= 0.3.
Ratios divide paths run alternately in each round (noise hits both sides); the best round of
each side counts. No torch at module level (CLI start-up).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

MIB = 1 << 20


def register(bsub) -> None:
    p = bsub.add_parser("l2", help="Redis second tier: write-behind / promotion vs redis-py, "
                        "write on commit vs evict, L2-hit TTFT",
                        description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=16,
                   help="36 MiB chunks per round (default 16 = one 4096-token prompt)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per path; the best counts")
    p.add_argument("--vllm", action="store_true",
                   help="also l2_hit_ttft_vs_recompute with two tiny-model vLLMs (minutes)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvedit.launch.redis import RedisProcess

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


def _qwen3_8b():
    from kvedit.layout import ModelLayout
    return ModelLayout(num_layers=36, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                       chunk_size=256)


def _chunks(layout, n: int):
    import torch
    g = torch.Generator().manual_seed(0)
    return [torch.randint(-2**15, 2**15 - 1, layout.chunk_shape, generator=g,
                          dtype=torch.int16).view(torch.bfloat16) for _ in range(n)]


def _wait_counter(client, name: str, value: int, timeout: float = 300.0,
                  poll: float = 0.02) -> None:
    """Until the server's stats show counter `name` >= value (ZMQ Stats, an O(1) call, every
    `poll` s: rarely, as each one takes the server's GIL and lock from the writer thread)."""
    deadline = time.monotonic() + timeout
    while client.stats()[name] < value:
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench l2: {name} stayed below {value}: {client.stats()}")
        time.sleep(poll)


def throughput(url: str, n: int, rounds: int) -> dict:
    import redis

    from kvedit.client import KVClient
    from kvedit.launch.server import start_server
    from kvedit.server.l2_redis import layout_tag, redis_key

    layout = _qwen3_8b()
    data = _chunks(layout, n)
    views = [memoryview(t.view(-1).view(__import__("torch").uint8).numpy()) for t in data]
    pool_gb = (n * layout.chunk_bytes) / 2**30 + 0.25
    raw = redis.Redis.from_url(url)
    tag = layout_tag(layout)
    store_s, set_s, fetch_s, get_s, end_to_end_s = [], [], [], [], []
    args = ["--l2-url", url, "--l2-write-queue-mb", str(2 * n * 36 + 64),
            "--l2-lookup-wait", "60"]
    with start_server(pool_gb, extra_args=args) as a, start_server(pool_gb, extra_args=args) as b, \
            KVClient(a.url) as ca, KVClient(b.url, timeout=120) as cb:
        for c in (ca, cb):
            c.register("bench", layout)
        written = 0
        for r in range(rounds):
            keys = [os.urandom(16) for _ in range(n)]
            busy = ca.stats()["l2_write_seconds"]
            t0 = time.perf_counter()
            ca.store("bench", keys, data)          # one commit: the writer takes it from here
            written += n
            _wait_counter(ca, "l2_writes", written)
            end_to_end_s.append(time.perf_counter() - t0)
            store_s.append(ca.stats()["l2_write_seconds"] - busy)   # the writer's own time
            t0 = time.perf_counter()                # baseline: the same bytes, plain SETs
            for i, v in enumerate(views):
                raw.set(f"bench-raw:{i}", v)
            set_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()                # promotion: B's L1 is empty
            got = cb.lookup("bench", keys)
            fetch_s.append(time.perf_counter() - t0)
            if got != n:
                raise RuntimeError(f"bench l2: promoted {got} of {n} chunks")
            rkeys = [redis_key("kvedit", "bench", tag, 0, k) for k in keys]
            t0 = time.perf_counter()                # baseline: plain GETs of the same records
            for k in rkeys:
                raw.get(k)
            get_s.append(time.perf_counter() - t0)
            with cb.retrieve("bench", keys[:1]) as got1:   # spot check: byte-exact
                if not (got1.tensors[0].view(-1).view(__import__("torch").int16)
                        == data[0].view(-1).view(__import__("torch").int16)).all():
                    raise RuntimeError("bench l2: a promoted chunk differs from the stored one")
            ca.delete("bench", keys)
            cb.delete("bench", keys)
            raw.delete(*rkeys, *[k + b":m" for k in rkeys])
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
    from kvedit.client import KVClient
    from kvedit.layout import ModelLayout
    from kvedit.launch.server import start_server

    import torch
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
            _wait_counter(ca, "l2_writes", before + n)
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
    import redis

    from kvedit.client import KVClient
    from kvedit.launch.server import start_server

    layout = _qwen3_8b()
    data = _chunks(layout, n)
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


def ttft_two_engines(url: str, tokens: int = 4096, rounds: int = 4) -> dict:
    """Prompts prefilled on engine A (server A) are served to engine B (server B, empty
    memory) from L2, vs fresh prompts recomputed on B, in alternation. One vLLM at a time
    (A stops before B starts): the hand-off goes through Redis alone."""
    import random

    from kvedit.bench.connector import _complete
    from kvedit.client import KVClient
    from kvedit.harness.tiny_model import default_tiny_model
    from kvedit.launch.vllm import start_vllm
    from kvedit.launch.server import start_server

    model = default_tiny_model()
    rng = random.Random(0)

    def fresh() -> list[int]:
        return [rng.randrange(10, 8000) for _ in range(tokens)]

    kw = dict(max_model_len=max(8192, tokens + 16), dtype="float32", dev_mode=True,
              kv_cache_gib=0.5)
    args = ["--l2-url", url, "--l2-lookup-wait", "1.5"]
    prompts = [fresh() for _ in range(rounds)]
    hit, recompute, cached = [], [], []
    with start_server(1.0, extra_args=args) as sa, start_server(1.0, extra_args=args) as sb, \
            KVClient(sa.url) as ca, KVClient(sb.url) as cb:
        with start_vllm(model, server=sa, **kw) as va:
            for p in prompts:                      # prefill on A: stored, written behind
                _complete(va, p)
            _wait_counter(ca, "l2_writes", rounds * (tokens // 256))
        with start_vllm(model, server=sb, **kw) as vb:
            print("kvedit bench l2: engine B up, measuring", file=sys.stderr)
            _complete(vb, fresh())                 # warm-up
            for p in prompts:
                recompute.append(_complete(vb, fresh())[0])
                dt, usage = _complete(vb, p)       # B has never seen p: its chunks from L2
                hit.append(dt)
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            promoted = cb.stats()["l2_hits"]
    med = statistics.median
    return {"ttft_prompt_tokens": tokens, "ttft_model": "tiny-qwen3 (float32, CPU)",
            "l2_hit_ttft_median_s": med(hit), "recompute_ttft_median_s": med(recompute),
            "l2_hit_cached_tokens": min(cached), "l2_chunks_promoted_on_b": promoted,
            "l2_hit_ttft_vs_recompute": med(h / r for h, r in zip(hit, recompute))}
