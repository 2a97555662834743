"""`kvedit bench modify`: SDK modify throughput against a same-run memcpy of the same bytes.

No vLLM: a kvedit server is started (or --server-url used), synthetic KV for N streams × T
tokens of a Qwen3-8B-shaped layout is stored straight through the client, then
BatchedStream.modify runs with the identity edit and with a drop-half edit (keep the first
and last quarter of the chunks, drop the middle, as DropMiddle(0.5) without re-rotation),
written in place (`drop_half`) and with torch.cat (`drop_half_cat`, which pays for fresh
memory inside fn).
`modify_vs_memcpy` = memcpy seconds / modify seconds for the same KV bytes (target >= 0.5):
each modify is paired with a memcpy (torch copy into touched memory, best of 3) timed just
before it, since other work on a shared host makes timings drift; the median of the
--repeats paired ratios is reported. `seconds`/`gbps` are the best modify.
`identity_cold` is the first modify of the process. With write tracking (the default) in shm
mode, fn's kv is mapped copy-on-write from the stored chunks (kvedit.sdk.chunkmap), so there
is no retrieve copy; `--no-track-writes` measures the copy path (one copy into the context's
reused buffers, byte-compare of reused chunks). connect() keeps large freed blocks for
reuse by default (kvedit.sdk.alloc) and fn runs in the SDK's fn pool, whose threads
allocate from the main malloc arena, so drop_half_cat's torch.cat reuses the previous
output's pages once the heap has room for the outputs in flight; `--no-keep-freed-memory`
measures malloc's default (process-wide: run the two variants in separate processes). Use
--repeats 5 or more: the first repeats pay fresh pages (heap growth for the first outputs,
and the lazy server pool's first touch of new slots; docs/sdk.md, "where the time goes").

Where fn runs. The arms above call the synchronous `batch.modify` from the main thread;
`drop_half_cat_async` runs the same edit through the async API
(`asyncio.run(batch.amodify(fn))`, no waiting caller). Both run a synchronous fn in the fn
pool (kvedit.sdk.alloc.pool_reuses_memory; two streams' fns side by side), so the two arms
differ only in the caller and in order: drop_half_cat is the first arm whose fn allocates,
so its first repeats pay the heap's growth. With `--no-keep-freed-memory` there is no pool:
the sync arm runs fn in the calling thread (main arena, one fn at a time), the async arm in
the context's I/O threads (each with its own arena, fresh pages every time).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time


def register(bsub) -> None:
    p = bsub.add_parser("modify", help="SDK modify (identity, drop-half) vs memcpy",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per stream")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--modify-concurrency", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="paired runs per edit")
    p.add_argument("--no-track-writes", action="store_true",
                   help="copy the KV out and byte-compare reused chunks instead of "
                        "copy-on-write mapping and tracking")
    p.add_argument("--no-keep-freed-memory", action="store_true",
                   help="connect(keep_freed_memory=False): leave malloc alone, so fn's fresh "
                        "allocations fault in new pages on every modify")
    p.add_argument("--server-url",
                   help="use this running server (tcp://...) instead of starting one")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.set_defaults(func=run)


def _identity(kv, tokens):
    return kv, tokens


def _drop_half(kv, tokens, layout):
    """Keep the first and last quarter of the chunks (chunk-granular DropMiddle, no RoPE),
    compacting in place: the kept tail moves next to the head, nothing is allocated."""
    c = layout.chunk_size
    quarter = len(tokens) // c // 4 * c
    tail = len(tokens) - quarter
    kv[:, :, quarter:2 * quarter].copy_(kv[:, :, tail:])
    return kv[:, :, :2 * quarter], tokens[:quarter] + tokens[tail:]


def _drop_half_cat(kv, tokens, layout):
    """The same edit written with torch.cat: a new tensor (fresh memory, page faults)."""
    import torch

    c = layout.chunk_size
    quarter = len(tokens) // c // 4 * c
    tail = len(tokens) - quarter
    return torch.cat([kv[:, :, :quarter], kv[:, :, tail:]], dim=2), \
        tokens[:quarter] + tokens[tail:]


def _modify(batch, fn, how: str):
    """batch.modify from this (main) thread, or the async API (no waiting caller)."""
    return batch.modify(fn) if how == "sync" else asyncio.run(batch.amodify(fn))


class _Memcpy:
    """Torch copies of nbytes: warm (touched destination, the baseline) and into fresh memory."""

    def __init__(self, nbytes: int):
        import torch

        self.src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        self.dst = torch.empty(nbytes, dtype=torch.uint8).fill_(2)

    def warm(self, repeats: int = 3) -> float:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            self.dst.copy_(self.src)
            best = min(best, time.perf_counter() - t)
        return best

    def fresh(self, repeats: int = 3) -> float:
        import torch

        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            torch.empty_like(self.src).copy_(self.src)
            best = min(best, time.perf_counter() - t)
        return best


def _streams(ctx, client, n: int, tokens: int, seed: int):
    """n streams whose full chunks are stored with synthetic KV (distinct prompts)."""
    import torch

    from kvedit.sdk.batch import BatchedStream
    from kvedit.sdk.stream import create_request

    def no_engine(*_):
        raise RuntimeError("bench modify never calls the engine")

    lay = ctx.layout
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(lay.chunk_shape, generator=g).to(getattr(torch, lay.dtype))
    batch = BatchedStream(progress=False)
    for i in range(n):
        prompt = torch.randint(0, 150_000, (tokens,), generator=g).tolist()
        s = batch.add(create_request(ctx, no_engine, prompt, name=f"bench-{seed}-{i}"))
        with client.prepare_store(ctx.model, s.keys) as h:
            for j, buf in enumerate(h.buffers):
                buf.copy_(base)
                buf.view(-1)[:8] = i * 1000 + j  # distinct chunks, same bytes moved
    return batch


def run(args) -> int:
    import torch

    from kvedit.layout import ModelLayout
    from kvedit.sdk.alloc import fn_pool, keep_freed_memory
    from kvedit.sdk.context import connect

    lay = ModelLayout(num_layers=args.layers, num_kv_heads=args.kv_heads,
                      head_dim=args.head_dim, dtype=args.dtype, chunk_size=args.chunk_size)
    lay.validate()
    if args.tokens % args.chunk_size:
        raise SystemExit(f"--tokens {args.tokens} must be a multiple of --chunk-size")
    kv_bytes = args.streams * (args.tokens // args.chunk_size) * lay.chunk_bytes
    server = None
    if args.server_url:
        url, http_url = args.server_url, None
    else:
        from kvedit.launch.server import start_server

        # one batch at a time (deleted after each modify) + drop-half output + slack
        server = start_server(kv_bytes * 1.5 / 2**30 + 0.25, chunk_size=args.chunk_size)
        url, http_url = server.url, server.http_url
    model = "bench-qwen3-8b-shape"
    try:
        from kvedit.client import KVClient

        with KVClient(url) as client:
            client.register(model, lay)
            with connect(url, http_url, model, timeout=10,
                         track_writes=False if args.no_track_writes else None,
                         keep_freed_memory=not args.no_keep_freed_memory) as ctx:
                memcpy = _Memcpy(kv_bytes)
                results, ratios, baselines, seed = {}, {}, [], 0
                edits = (("identity_cold", _identity, 1, "sync"),
                         ("identity", _identity, args.repeats, "sync"),
                         ("drop_half", _drop_half, args.repeats, "sync"),
                         ("drop_half_cat", _drop_half_cat, args.repeats, "sync"),
                         ("drop_half_cat_async", _drop_half_cat, args.repeats, "async"))
                for name, fn, repeats, how in edits:
                    for _ in range(repeats):  # other work on a shared host drifts: pair
                        seed += 1             # each modify with a memcpy timed just before
                        batch = _streams(ctx, client, args.streams, args.tokens, seed)
                        batch.modify_concurrency = args.modify_concurrency
                        baselines.append(memcpy.warm())
                        m = _modify(batch, fn, how)
                        ratios.setdefault(name, []).append(baselines[-1] / m.duration)
                        if name not in results or m.duration < results[name].duration:
                            results[name] = m
                        client.delete(model, [k for s in batch for k in s.keys])
                transfer, track = client.transfer_mode, ctx.pool.cow
                keep_freed = not args.no_keep_freed_memory and keep_freed_memory()
                pool = fn_pool()
                warm, fresh = statistics.median(baselines), memcpy.fresh()
    finally:
        if server is not None:
            server.stop()
    out = {
        "config": {"streams": args.streams, "tokens": args.tokens, "layout": "qwen3-8b-shape",
                   "num_layers": lay.num_layers, "num_kv_heads": lay.num_kv_heads,
                   "head_dim": lay.head_dim, "dtype": lay.dtype, "chunk_size": lay.chunk_size,
                   "modify_concurrency": args.modify_concurrency, "transfer_mode": transfer,
                   "track_writes": track,
                   "keep_freed_memory": keep_freed,
                   "fn_pool": {"threads": pool.size, "main_arena": pool.main_arena,
                               "threads_started": pool.probes} if pool else None,
                   "torch_threads": torch.get_num_threads(),
                   "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"},
        "kv_bytes": kv_bytes,
        "target_modify_vs_memcpy": 0.5,
        "memcpy": {"seconds": warm, "gbps": kv_bytes / warm / 1e9,  # median of pairs
                   "seconds_all": baselines},
        "memcpy_fresh_alloc": {"seconds": fresh, "gbps": kv_bytes / fresh / 1e9},
    }
    for name, m in results.items():
        out[name] = {"seconds": m.duration, "gbps": kv_bytes / m.duration / 1e9,
                     "modify_vs_memcpy": statistics.median(ratios[name]),
                     "modify_vs_memcpy_all": ratios[name],
                     "bytes_stored": m.bytes_stored, "chunks_stored": m.chunks_stored,
                     "chunks_reused": m.chunks_reused, "chunks_deleted": m.chunks_deleted,
                     "chunks_compared": m.chunks_compared,
                     "salt_changes": m.salt_changes,
                     "profile_summed_s": {"retrieve": m.retrieve_s, "fn": m.fn_s,
                                          "store": m.store_s}}
    print(json.dumps(out, indent=2))
    if not args.json:
        for name, m in results.items():
            print(f"\n{name}:\n{m.table()}")
    return 0
