"""`kvedit bench modify`: SDK modify throughput against a same-run memcpy of the same bytes.

No vLLM: a kvedit server is started (or --server-url used), synthetic KV for N streams x T
tokens of a Qwen3-8B-shaped layout is stored straight through the client, then
BatchedStream.modify runs each arm's edit:
- `identity`: fn returns kv as it is;
- `drop_half`: keep the first and last quarter of the chunks, drop the middle (as
  DropMiddle(0.5) without re-rotation), compacted in place in kv;
- `new_tensor`: the same edit into a new tensor from `new_kv` (kvedit.sdk.output: the
  context's reused pages), the way an fn that builds its output should;
- `new_tensor_malloc`: the same with plain `torch.cat` (the process's malloc; fresh pages
  every modify unless `--tune-glibc-heap`), for comparison.
`identity_cold` is the first modify of the process.
`modify_vs_memcpy` = memcpy seconds / modify seconds for the same KV bytes (target >= 0.5):
each modify is paired with a memcpy (torch copy into touched memory, best of 3) timed just
before it, since other work on a shared host makes timings drift; the median of the
--repeats paired ratios is reported. `seconds`/`gbps` are the best modify.
Each arm first runs `--warmup` modifies that are reported (`warmup_vs_memcpy`) but not in the
median: they pay the first touch of server pool pages (a lazy pool takes its pages as data
lands, once per server lifetime) and of the client's mappings of them, a cost a running
server has already paid; the steady state is what the median measures.
With write tracking (the default) in shm mode, fn's kv is mapped copy-on-write from the
stored chunks (kvedit.sdk.chunkmap), so there is no retrieve copy; `--no-track-writes`
measures the copy path. connect() leaves the process's malloc alone by default;
`--tune-glibc-heap` measures connect(tune_glibc_heap=True) (kvedit.sdk.glibc_tuning;
process-wide: run the two variants in separate processes). The first repeat of an arm that
writes new pages pays their first touch (docs/sdk.md, "where the time goes").
No torch at module level (CLI start-up): `kvedit bench` imports this module to register it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field

from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout


def register(bsub) -> None:
    p = bsub.add_parser("modify", help="SDK modify (identity, drop-half, new tensor) vs memcpy",
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
    p.add_argument("--warmup", type=int, default=1,
                   help="modifies per arm before the paired runs (first touch of pool pages; "
                        "reported as warmup_vs_memcpy, not in the median)")
    p.add_argument("--no-track-writes", action="store_true",
                   help="copy the KV out and byte-compare reused chunks instead of "
                        "copy-on-write mapping and tracking")
    p.add_argument("--tune-glibc-heap", action="store_true",
                   help="connect(tune_glibc_heap=True): tune this process's malloc "
                        "(kvedit.sdk.glibc_tuning) so new_tensor_malloc reuses touched pages")
    p.add_argument("--arms", default="identity,drop_half,new_tensor,new_tensor_malloc",
                   help="comma-separated arms to run (identity_cold always runs first)")
    p.add_argument("--server-url",
                   help="use this running server (tcp://...) instead of starting one")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.set_defaults(func=run)


def _identity(kv, tokens):
    return kv, tokens


def _halves(tokens, layout) -> tuple[int, int]:
    """(q, tail): keep tokens [0, q) and [tail, T), the first and last quarter of the chunks."""
    c = layout.chunk_size
    quarter = len(tokens) // c // 4 * c
    return quarter, len(tokens) - quarter


def _drop_half(kv, tokens, layout):
    """Keep the first and last quarter of the chunks (chunk-granular DropMiddle, no RoPE),
    compacting in place: the kept tail moves next to the head, nothing is allocated."""
    q, tail = _halves(tokens, layout)
    kv[:, :, q:2 * q].copy_(kv[:, :, tail:])
    return kv[:, :, :2 * q], tokens[:q] + tokens[tail:]


def _new_tensor(kv, tokens, layout, new_kv):
    """The same edit into a new tensor on kvedit's reused output pages (new_kv)."""
    import torch

    q, tail = _halves(tokens, layout)
    out = new_kv((2, kv.shape[1], 2 * q, kv.shape[3]), kv.dtype)
    torch.cat([kv[:, :, :q], kv[:, :, tail:]], dim=2, out=out)
    return out, tokens[:q] + tokens[tail:]


def _new_tensor_malloc(kv, tokens, layout):
    """The same edit with plain torch.cat: its output comes from the process's malloc."""
    import torch

    q, tail = _halves(tokens, layout)
    return torch.cat([kv[:, :, :q], kv[:, :, tail:]], dim=2), tokens[:q] + tokens[tail:]


ARMS = {"identity": _identity, "drop_half": _drop_half, "new_tensor": _new_tensor,
        "new_tensor_malloc": _new_tensor_malloc}


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


@dataclass
class _Measured:
    """What the paired runs gave: each arm's best modify, its paired ratios (and those of its
    warm-up modifies), every memcpy baseline, and the session's settings as they ran."""
    results: dict = field(default_factory=dict)
    ratios: dict = field(default_factory=dict)
    warmups: dict = field(default_factory=dict)
    baselines: list = field(default_factory=list)
    transfer: str = ""
    track: bool = False
    pool: object = None
    fresh: float = 0.0


def _layout(args):
    """The arms asked for and the KV layout, checked before anything starts."""
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; expected some of {sorted(ARMS)}")
    lay = ModelLayout(num_layers=args.layers, num_kv_heads=args.kv_heads,
                      head_dim=args.head_dim, dtype=args.dtype, chunk_size=args.chunk_size)
    lay.validate()
    if args.tokens % args.chunk_size:
        raise SystemExit(f"--tokens {args.tokens} must be a multiple of --chunk-size")
    return arms, lay


def _paired_runs(ctx, client, args, arms, model: str, kv_bytes: int, got: _Measured) -> None:
    """identity_cold, then each arm's warm-up and paired runs: a memcpy timed just before
    each modify, since other work on a shared host makes timings drift."""
    memcpy = _Memcpy(kv_bytes)
    seed = 0
    edits = [("identity_cold", _identity, 0, 1)] + \
        [(name, ARMS[name], args.warmup, args.repeats) for name in arms]
    for name, fn, warm, repeats in edits:
        for i in range(warm + repeats):
            seed += 1
            batch = _streams(ctx, client, args.streams, args.tokens, seed)
            batch.modify_concurrency = args.modify_concurrency
            base = memcpy.warm()
            m = batch.modify(fn)
            client.delete(model, [k for s in batch for k in s.keys])
            if i < warm:
                got.warmups.setdefault(name, []).append(base / m.duration)
                continue
            got.baselines.append(base)
            got.ratios.setdefault(name, []).append(base / m.duration)
            if name not in got.results or m.duration < got.results[name].duration:
                got.results[name] = m
    got.transfer, got.track, got.pool = client.transfer_mode, ctx.pool.cow, ctx.fn_pool
    got.fresh = memcpy.fresh()


def _measure(args, arms, lay, kv_bytes: int) -> _Measured:
    """Start a server (or use --server-url), register the layout, connect, run the pairs."""
    from kvedit.client import KVClient
    from kvedit.sdk.context import connect

    server = None
    if args.server_url:
        url, http_url = args.server_url, None
    else:
        # one batch at a time (deleted after each modify) + drop-half output + slack
        server = start_server(kv_bytes * 1.5 / 2**30 + 0.25, chunk_size=args.chunk_size)
        url, http_url = server.url, server.http_url
    model = "bench-qwen3-8b-shape"
    got = _Measured()
    try:
        with KVClient(url) as client:
            client.register(model, lay)
            with connect(url, http_url, model, timeout=10,
                         track_writes=False if args.no_track_writes else None,
                         tune_glibc_heap=args.tune_glibc_heap) as ctx:
                _paired_runs(ctx, client, args, arms, model, kv_bytes, got)
    finally:
        if server is not None:
            server.stop()
    return got


def _report(args, lay, kv_bytes: int, got: _Measured) -> dict:
    """The JSON: the settings as they ran, the memcpy baselines, each arm's figures."""
    import torch

    from kvedit.sdk import glibc_tuning

    pool, warm, fresh = got.pool, statistics.median(got.baselines), got.fresh
    out = {
        "config": {"streams": args.streams, "tokens": args.tokens, "layout": "qwen3-8b-shape",
                   "num_layers": lay.num_layers, "num_kv_heads": lay.num_kv_heads,
                   "head_dim": lay.head_dim, "dtype": lay.dtype, "chunk_size": lay.chunk_size,
                   "modify_concurrency": args.modify_concurrency,
                   "transfer_mode": got.transfer, "track_writes": got.track,
                   "repeats": args.repeats, "warmup": args.warmup,
                   "tune_glibc_heap": glibc_tuning.tuned(),
                   "fn_pool": {"threads": pool.size, "main_arena": pool.main_arena,
                               "threads_started": pool.probes} if pool else None,
                   "torch_threads": torch.get_num_threads(),
                   "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"},
        "kv_bytes": kv_bytes,
        "target_modify_vs_memcpy": 0.5,
        "memcpy": {"seconds": warm, "gbps": kv_bytes / warm / 1e9,  # median of pairs
                   "seconds_all": got.baselines},
        "memcpy_fresh_alloc": {"seconds": fresh, "gbps": kv_bytes / fresh / 1e9},
    }
    for name, m in got.results.items():
        out[name] = {"seconds": m.duration, "gbps": kv_bytes / m.duration / 1e9,
                     "modify_vs_memcpy": statistics.median(got.ratios[name]),
                     "modify_vs_memcpy_all": got.ratios[name],
                     "warmup_vs_memcpy": got.warmups.get(name, []),
                     "bytes_stored": m.bytes_stored, "chunks_stored": m.chunks_stored,
                     "chunks_reused": m.chunks_reused, "chunks_deleted": m.chunks_deleted,
                     "chunks_compared": m.chunks_compared,
                     "salt_changes": m.salt_changes,
                     "profile_summed_s": {"retrieve": m.retrieve_s, "fn": m.fn_s,
                                          "store": m.store_s}}
    return out


def run(args) -> int:
    arms, lay = _layout(args)
    kv_bytes = args.streams * (args.tokens // args.chunk_size) * lay.chunk_bytes
    got = _measure(args, arms, lay, kv_bytes)
    print(json.dumps(_report(args, lay, kv_bytes, got), indent=2))
    if not args.json:
        for name, m in got.results.items():
            print(f"\n{name}:\n{m.table()}")
    return 0
