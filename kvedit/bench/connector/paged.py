"""`kvedit bench connector --paged`: only the copies (GB/s), on CUDA when there is a GPU.

Paged gather/scatter of Qwen3-8B-shaped bf16 chunks, and the connector's own store/load code
(kvedit.vllm.transfer.copier.PagedCopier) through a real kvedit server, with the pinned host
copy of the same bytes as the baseline and a breakdown (server round trips without copies,
gathers alone).
"""
from __future__ import annotations

import json
import mmap
import os
import time

import torch

from kvedit.client import KVClient
from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout
from kvedit.vllm.paged import PagedKV
from kvedit.vllm.transfer.copier import PagedCopier
from kvedit.vllm.transfer.gpu_memory import pin_host
from kvedit.vllm.transfer.plan import ChunkRun


def run(args) -> int:
    print(json.dumps(paged_bench(chunks=args.chunks, separate_layers=args.separate_layers),
                     indent=None if args.json else 2))
    return 0


def paged_bench(num_layers: int = 36, kv_heads: int = 8, head_dim: int = 128,
                chunk: int = 256, chunks: int = 16, device: str | None = None,
                separate_layers: bool = False) -> dict:
    """GB/s of PagedKV.gather / scatter for Qwen3-8B-shaped bf16 chunks (36 MiB each).

    Block 16 and FlashAttention's NHD order on CUDA, block 128 and the CPU backend's layout
    on CPU; `separate_layers`: one allocation per layer (vLLM's own allocation: one index
    op per layer), else one buffer for all layers (one op per K/V). On CUDA the host copies
    are timed too: device <-> pageable host memory and pinned host memory; gathers in 16-byte
    elements (what the connector uses) and in bf16 elements.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind, block = ("cuda", 16) if device == "cuda" else ("cpu", 128)
    tokens = chunk * chunks
    nblocks = 2 * tokens // block
    layers = _paged_layers(kind, (num_layers, nblocks, kv_heads, block, 2 * head_dim), device,
                           separate_layers)
    paged = PagedKV(layers, kind, head_dim, block)
    narrow = PagedKV(layers, kind, head_dim, block, wide=False)
    block_ids = torch.randperm(nblocks)[: tokens // block].tolist()
    slots = [paged.slots(block_ids, c * chunk, (c + 1) * chunk) for c in range(chunks)]
    batch = paged.chunk_slots([(block_ids, c) for c in range(chunks)], chunk)
    shape = (2, num_layers, chunk, kv_heads * head_dim)
    staged = torch.empty((chunks, *shape), dtype=torch.bfloat16, device=device)
    dev = list(staged.unbind(0))
    nbytes = staged.numel() * staged.element_size()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    timed = _rate_timer(nbytes, sync)
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "layout": kind, "block_size": block, "chunk_bytes": nbytes // chunks,
           "chunks": chunks, "separate_layers": separate_layers,
           "layer_groups": len(paged.groups), "wide_ratio": paged.ratio,
           "gather_GBps": timed(lambda: [paged.gather(s, d) for s, d in zip(slots, dev)]),
           "scatter_GBps": timed(lambda: [paged.scatter(s, d) for s, d in zip(slots, dev)]),
           "gather_narrow_GBps": timed(lambda: [narrow.gather(s, d)
                                                for s, d in zip(slots, dev)]),
           "gather_batch_GBps": timed(lambda: paged.gather_chunks(batch, staged)),
           "scatter_batch_GBps": timed(lambda: paged.scatter_chunks(batch, staged))}
    # Baseline: a plain contiguous copy of the same bytes on the same device.
    src = [torch.empty_like(d) for d in dev]
    out["memcpy_GBps"] = timed(lambda: [d.copy_(s) for s, d in zip(src, dev)])
    if device == "cuda":
        out.update(_host_copies(paged, slots, dev, shape, timed))
    for async_store in (True, False):
        res = _through_server(paged, block_ids, shape, chunk, chunks, sync, nbytes,
                              async_store=async_store)
        out.update(res if async_store else
                   {"store_via_server_sync_GBps": res["store_via_server_GBps"],
                    "breakdown_sync_ms": res["breakdown_ms"]})
    if device == "cuda":
        out["store_via_server_vs_pinned_copy"] = out["store_via_server_GBps"] / out["pinned_d2h_GBps"]
        out["load_via_server_vs_pinned_copy"] = out["load_via_server_GBps"] / out["pinned_h2d_GBps"]
        out["targets"] = {"store_via_server_vs_pinned_copy": ">= 0.8",
                          "load_via_server_vs_pinned_copy": ">= 0.8"}
    return out


def _paged_layers(kind: str, logical: tuple, device: str, separate_layers: bool) -> list:
    """Per-layer views of random bf16 paged KV, `logical` (layers, blocks, heads, block,
    2 * head_dim) in the backend's memory order: FlashAttention's NHD on CUDA, the CPU
    backend's HND on CPU; one allocation per layer or one for all layers."""
    perm = (0, 1, 3, 2, 4) if kind == "cuda" else (0, 1, 2, 3, 4)  # LBNHC / LBHNC
    if separate_layers:
        lperm, lshape = tuple(i - 1 for i in perm[1:]), logical[1:]  # one layer's order
        bufs = [torch.randn([lshape[i] for i in lperm], dtype=torch.bfloat16, device=device)
                for _ in range(logical[0])]
        return [b.permute(*[lperm.index(i) for i in range(4)]) for b in bufs]
    buf = torch.randn([logical[i] for i in perm], dtype=torch.bfloat16, device=device)
    view = buf.permute(*[perm.index(i) for i in range(5)])
    return [view[i] for i in range(logical[0])]


def _rate_timer(nbytes: int, sync):
    """timed(fn, reps=5) -> GB/s of `nbytes` over fn's best of `reps` runs, after a warm-up."""
    def timed(fn, reps: int = 5) -> float:
        fn()
        sync()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9
    return timed


def _host_copies(paged, slots: list, dev: list, shape, timed) -> dict:
    """CUDA only: paged <-> host through a /dev/shm mapping, as the server's segment is used,
    pageable then pinned, and the plain pinned copies of the same bytes (the baseline the
    copy target is against: no gather, no server)."""
    host = _shm_tensors(len(dev), shape, torch.bfloat16)

    def store():
        for s, d, h in zip(slots, dev, host):
            paged.gather(s, d)
            h.copy_(d)

    def load():
        for s, d, h in zip(slots, dev, host):
            paged.scatter(s, d.copy_(h))
    out = {"store_to_shm_GBps": timed(store), "load_from_shm_GBps": timed(load)}
    t0 = time.perf_counter()
    out["shm_pinned"] = pin_host(host[0])
    out["pin_seconds"] = time.perf_counter() - t0
    out["store_to_pinned_shm_GBps"] = timed(store)
    out["load_from_pinned_shm_GBps"] = timed(load)
    out["pinned_d2h_GBps"] = timed(lambda: [h.copy_(d) for d, h in zip(dev, host)])
    out["pinned_h2d_GBps"] = timed(lambda: [d.copy_(h) for d, h in zip(dev, host)])
    return out


def _through_server(paged, block_ids: list[int], shape, chunk: int, n: int, sync,
                    nbytes: int, reps: int = 5, async_store: bool = True) -> dict:
    """The connector's own store and load code (kvedit.vllm.transfer.copier.PagedCopier, what
    wait_for_save and start_load_kv run) through a real kvedit server: paged -> its shared
    memory (prepare_store / commit) and back (retrieve / release), fresh keys each time.
    A store is timed until committed (the background thread flushed).

    Best of `reps`; deleting the previous round's keys is outside the timed part. The
    breakdown times the server round trips alone (the same requests, no copies) and the
    batched gathers / scatters alone, so the copies' share is the rest."""
    layout = ModelLayout(num_layers=shape[1], num_kv_heads=paged.num_heads,
                         head_dim=paged.head_dim, dtype="bfloat16", chunk_size=chunk)
    pool_gb = 3 * n * layout.chunk_bytes / 2**30 + 0.5
    copier = PagedCopier(paged, layout, "bench", async_store=async_store)
    batch = paged.chunk_slots([(block_ids, c) for c in range(n)], chunk)
    with start_server(pool_gb, chunk_size=chunk) as server, KVClient(server.url) as client:
        client.register("bench", layout)
        keys: list[bytes] = []

        def fresh():
            if keys:
                client.delete("bench", keys)
            keys[:] = [os.urandom(16) for _ in range(n)]

        def store():
            copier.store_chunks(client, {k: (block_ids, c) for c, k in enumerate(keys)})
            copier.flush()

        def load():
            run = ChunkRun(req_id="bench", first=0, keys=[keys], start=0, end=n * chunk,
                           block_ids=block_ids)
            if copier.load_run(client, run) != n * chunk:
                raise RuntimeError("bench connector: the server lost chunks mid-benchmark")

        def store_rpc_only():  # the same requests, nothing copied
            with client.prepare_store("bench", keys) as handle:
                for _ in handle.writable():
                    pass

        def load_rpc_only():
            with client.retrieve("bench", keys) as got:
                assert len(got.tensors) == n

        staged = torch.empty((n, *shape), dtype=paged.dtype, device=paged.device)

        def best(fn, setup=None) -> float:
            return _best_seconds(fn, sync, reps, setup)

        t = {"store_total": best(store, fresh), "load_total": best(load),
             "store_server_round_trips": best(store_rpc_only, fresh),
             "load_server_round_trips": best(load_rpc_only),
             "store_gathers": best(lambda: paged.gather_chunks(batch, staged)),
             "load_scatters": best(lambda: paged.scatter_chunks(batch, staged))}
        copier.close()
        return {"transfer_mode": client.transfer_mode,
                "store_via_server_GBps": nbytes / t["store_total"] / 1e9,
                "load_via_server_GBps": nbytes / t["load_total"] / 1e9,
                "breakdown_ms": {k: 1e3 * t[k] for k in (
                    "store_total", "store_server_round_trips", "store_gathers",
                    "load_total", "load_server_round_trips", "load_scatters")},
                **({"server_shm_pin_attempted": True} if copier.pinned else {})}


def _best_seconds(fn, sync, reps: int, setup=None) -> float:
    """fn's best time of `reps` runs after a warm-up run; `setup` before each, untimed."""
    times = []
    for i in range(reps + 1):  # the first is a warm-up
        if setup:
            setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


def _shm_tensors(n: int, shape, dtype) -> list:
    """n tensors in one fresh /dev/shm mapping (unlinked at once: the mapping stays)."""
    one = torch.empty(shape, dtype=dtype)
    nbytes = n * one.numel() * one.element_size()
    path = f"/dev/shm/kvedit-bench-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)
    flat = torch.frombuffer(mm, dtype=dtype)
    return list(flat.view(n, *shape).unbind(0))
