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
    # blocks earlier ones freed (kvedit.sdk.alloc.fill_small_cache says why it is not at once)
    ptrs = [ptr for ptr, _ in r["in_pool"]]
    assert all(on_heap for _, on_heap in r["in_pool"])
    assert r["heap_size"][-1] == r["heap_size"][-5]
    assert set(ptrs[-4:]) <= set(ptrs[:-4])
    assert r["via"][1]  # run_fn uses the pool
    # control: a thread with its own arena maps the 151 MB afresh, outside the heap
    assert not any(on_heap for _, on_heap in r["early"])
    assert r["error"] == "ZeroDivisionError"  # fn's exception reaches the caller as it is
