"""kvedit.sdk.alloc: the fn pool's threads allocate large blocks from the main arena, so a
torch.cat output is served from kept freed memory (same pages again) instead of a fresh
mmap, while a thread that attached its own arena before gets a fresh mapping every time.

Each check runs in a fresh interpreter: the allocator settings are process-wide and glibc
fixes a thread's arena at its first malloc, so the pytest process (which may already have
connected) cannot show them. Reads the process's own memory map, not kvedit's counters.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc only")

SCRIPT = textwrap.dedent("""
    import asyncio, json, threading
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from kvedit.sdk import alloc

    src = torch.ones(2, 36, 2048, 1024, dtype=torch.bfloat16)   # 302 MB, as one stream's KV

    def cat():
        out = torch.cat([src[:, :, :512], src[:, :, -512:]], dim=2)  # 151 MB, fresh tensor
        heap = alloc._brk_heap()
        return out.data_ptr(), bool(heap and heap[0] <= out.data_ptr() < heap[1])

    early = ThreadPoolExecutor(1)       # attaches its own arena before the setting
    early.submit(cat).result()
    applied = alloc.keep_freed_memory()
    pool = alloc.fn_pool()
    in_pool, heap_size = [], []
    for _ in range(12):
        in_pool.append(pool.submit(cat).result())
        lo, hi = alloc._brk_heap()
        heap_size.append(hi - lo)
    names = {pool.submit(lambda: threading.current_thread().name).result() for _ in range(8)}
    early_runs = [early.submit(cat).result() for _ in range(2)]

    async def through_run_fn():
        return await alloc.run_fn(None, cat)

    via = asyncio.run(through_run_fn())
    try:
        pool.submit(lambda: 1 / 0).result()
        error = None
    except ZeroDivisionError as e:
        error = type(e).__name__
    print(json.dumps({"applied": applied, "main_arena": pool.main_arena,
                      "started": pool.probes, "size": pool.size, "in_pool": in_pool,
                      "heap_size": heap_size,
                      "names": sorted(names), "early": early_runs, "via": via,
                      "error": error}))
""")


def _run() -> dict:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pool_threads_reuse_the_main_arena_and_an_own_arena_thread_does_not():
    r = _run()
    assert r["applied"] and r["main_arena"] and r["started"] >= r["size"] >= 2
    assert r["names"] == ["kvedit-fn"]
    # every output from the brk heap, and the heap stops growing: later outputs reuse the
    # blocks earlier ones freed (kvedit.sdk.alloc.settle_small_cache says why it is not at once)
    ptrs = [ptr for ptr, _ in r["in_pool"]]
    assert all(on_heap for _, on_heap in r["in_pool"])
    assert r["heap_size"][-1] == r["heap_size"][-5]
    # the same memory again: each late output starts where an earlier one did, give or take
    # the few bytes of alignment tails that now merge back (settle_small_cache)
    assert all(any(abs(p - q) < 4096 for q in ptrs[:-4]) for p in ptrs[-4:]), ptrs
    assert r["via"][1]  # run_fn uses the pool
    # control: a thread with its own arena maps the 151 MB afresh, outside the heap
    assert not any(on_heap for _, on_heap in r["early"])
    assert r["error"] == "ZeroDivisionError"  # fn's exception reaches the caller as it is


MODIFY_SCRIPT = textwrap.dedent("""
    import json
    from kvedit.bench.modify import _drop_half_cat, _streams
    from kvedit.client import KVClient
    from kvedit.layout import ModelLayout
    from kvedit.sdk import alloc
    from kvedit.sdk.context import connect
    from kvedit.launch.server import start_server

    T = 1024
    lay = ModelLayout(num_layers=36, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                      chunk_size=256)
    kv_bytes = 4 * (T // 256) * lay.chunk_bytes
    server = start_server(kv_bytes * 1.5 / 2**30 + 0.25, chunk_size=256)
    heap = []
    try:
        with KVClient(server.url) as client:
            client.register("m", lay)
            with connect(server.url, server.http_url, "m", timeout=10) as ctx:
                for seed in range(1, 8):
                    batch = _streams(ctx, client, 4, T, seed)
                    batch.modify_concurrency = 2
                    batch.modify(_drop_half_cat)
                    client.delete("m", [k for s in batch for k in s.keys])
                    lo, hi = alloc._brk_heap()
                    heap.append(hi - lo)
    finally:
        server.stop()
    print(json.dumps({"heap": heap, "out_block": kv_bytes // 8}))
""")


def test_torch_cat_outputs_of_two_streams_in_flight_stop_growing_the_heap():
    """Real server, 4 streams, two fns at a time returning fresh torch.cat outputs (75 MB
    each), 7 modifies: after the first, the brk heap grows by at most 3 output blocks in
    all. With the cache only filled before fn (not emptied after it) the alignment tails
    pinned the freed blocks and the heap grew by 9-10 blocks over the same run."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", MODIFY_SCRIPT], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    growth = [(h - r["heap"][0]) / r["out_block"] for h in r["heap"]]
    assert growth[-1] <= 3, growth
