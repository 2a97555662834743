"""glibc's malloc in the user's process: untouched by kvedit unless asked, tuned when asked.

Each check runs in a fresh interpreter (the settings are process-wide and glibc fixes a
thread's arena at its first malloc, so the pytest process cannot show them) and reads
glibc's own state, not kvedit's: `mallinfo2()` (bytes and count of mmapped blocks),
`malloc_info()` (one <heap> per arena) and the process's memory map (/proc/self/maps: a
block in the `[heap]` range came from the main arena's brk heap, not from its own mmap).

- Default: `kvedit.connect(...)` against a real server, then modifies (identity, drop-half
  in place, an fn building its output with `new_kv`), leave glibc as a fresh process has it:
  a large `torch.empty` is still served by its own mmap, concurrent new threads still get
  arenas of their own, and kvedit started no fn-pool thread.
- Opt-in (`connect(..., tune_glibc_heap=True)`): large blocks come from the brk heap, no
  new arena appears for new threads, synchronous fns run in the pool's main-arena threads,
  a torch.cat output reuses the freed block's pages, and the heap stops growing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc only")

# What the scripts below share: glibc's view of the heap, read through ctypes.
PROBES = textwrap.dedent("""
    import ctypes, os, tempfile, threading
    libc = ctypes.CDLL(None)

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = Mallinfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def mmapped():                       # (count, bytes) of blocks malloc mmapped itself
        m = libc.mallinfo2()
        return m.hblks, m.hblkhd

    def arenas():                        # malloc_info writes one <heap nr=...> per arena
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        fd, path = tempfile.mkstemp()
        os.close(fd)
        f = libc.fopen(path.encode(), b"w")
        libc.malloc_info(0, f)
        libc.fclose(f)
        with open(path) as fh:
            text = fh.read()
        os.unlink(path)
        return text.count("<heap nr=")

    def brk_heap():
        spans = []
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip().endswith("[heap]"):
                    lo, hi = line.split()[0].split("-")
                    spans.append((int(lo, 16), int(hi, 16)))
        return (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else (0, 0)

    def on_heap(ptr):
        lo, hi = brk_heap()
        return lo <= ptr < hi

    def new_threads_arenas(n=3):         # arenas while n new threads hold a malloc each
        go, held = threading.Barrier(n + 1), threading.Barrier(n + 1)
        def work():
            p = libc.malloc(4096)        # a new thread's first malloc attaches an arena
            go.wait()
            held.wait()
            libc.free(p)
        ts = [threading.Thread(target=work) for _ in range(n)]
        for t in ts:
            t.start()
        go.wait()
        count = arenas()
        held.wait()
        for t in ts:
            t.join()
        return count
""")

MODIFY = textwrap.dedent("""
    import json, sys, threading
    import torch
    from kvedit.bench.modify import _drop_half, _identity, _new_tensor, _streams
    from kvedit.client import KVClient
    from kvedit.layout import ModelLayout
    from kvedit.launch.server import start_server
    from kvedit.sdk import glibc_tuning
    import kvedit

    tune = sys.argv[1] == "tune"
    lay = ModelLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                      chunk_size=256)
    server = start_server(0.25, chunk_size=256)
    fn_threads = []
    def record(kv, tokens):
        fn_threads.append(threading.current_thread().name)
        return kv, tokens
    try:
        with KVClient(server.url) as client:
            client.register("m", lay)
            before = {"mmapped": mmapped(), "arenas": arenas()}
            with kvedit.connect(server.url, server.http_url, "m", timeout=10,
                                tune_glibc_heap=tune) as ctx:
                for seed, fn in enumerate((_identity, _drop_half, _new_tensor, record), 1):
                    batch = _streams(ctx, client, 2, 1024, seed)
                    batch.modify(fn)
                    client.delete("m", [k for s in batch for k in s.keys])
                m0 = mmapped()
                big = torch.empty(96 << 20, dtype=torch.uint8)   # above any mmap threshold
                m1 = mmapped()
                after = {"big_on_heap": on_heap(big.data_ptr()),
                         "mmapped_delta": [m1[0] - m0[0], m1[1] - m0[1]],
                         "arenas": arenas(), "arenas_new_threads": new_threads_arenas(),
                         "threads": sorted({t.name.split("_")[0]
                                            for t in threading.enumerate()}),
                         "fn_threads": fn_threads, "tuned": glibc_tuning.tuned(),
                         "pool": ctx.fn_pool is not None}
                del big
    finally:
        server.stop()
    print(json.dumps({"before": before, "after": after}))
""")


def _run(script: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", PROBES + script, *args], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a fresh interpreter importing torch
def test_connect_and_modify_leave_glibc_untouched():
    r = _run(MODIFY, "default")["after"]
    assert not r["tuned"] and not r["pool"]
    # M_MMAP_MAX untouched: a 96 MiB block is one more mmapped block, outside the brk heap
    assert r["mmapped_delta"][0] == 1 and r["mmapped_delta"][1] >= 96 << 20, r
    assert not r["big_on_heap"]
    # M_ARENA_MAX untouched: three new threads, each holding a malloc, add arenas (with
    # M_ARENA_MAX=1 they would all share the one there is)
    assert r["arenas_new_threads"] > r["arenas"] or r["arenas_new_threads"] >= 4, r
    # no thread of kvedit's fn pool; fns ran in the context's own threads
    assert "kvedit-fn" not in r["threads"]
    assert r["fn_threads"] and all(n.startswith("kvedit-io") for n in r["fn_threads"]), r


@pytest.mark.slow  # a fresh interpreter with torch per check; the opt-in, not the default path
def test_the_opt_in_tunes_the_process():
    r = _run(MODIFY, "tune")["after"]
    assert r["tuned"] and r["pool"]
    assert r["mmapped_delta"] == [0, 0] and r["big_on_heap"], r   # M_MMAP_MAX=0
    assert r["arenas_new_threads"] == r["arenas"], r                # M_ARENA_MAX=1
    assert set(r["fn_threads"]) == {"kvedit-fn"}, r                # the main-arena pool


POOL = textwrap.dedent("""
    import asyncio, json, threading, time
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from kvedit.sdk import glibc_tuning

    src = torch.ones(2, 36, 2048, 1024, dtype=torch.bfloat16)   # 302 MB, as one stream's KV

    def cat():
        out = torch.cat([src[:, :, :512], src[:, :, -512:]], dim=2)  # 151 MB, fresh tensor
        return out.data_ptr()

    def where(ptr):  # after fn, in this thread: reading /proc/self/maps inside fn allocated
        return ptr, on_heap(ptr)   # (buffers, strings) in the pool thread while out was live

    early = ThreadPoolExecutor(1)       # attaches its own arena before the setting
    early.submit(cat).result()
    pool = glibc_tuning.enable()
    in_pool, heap_size = [], []
    for _ in range(12):
        # polled, not Future.result(): that wait allocates a lock in this thread while the
        # output may be live, and a small chunk carved after the output and parked in this
        # thread's cache pins it (the heap then grows by a block once; 3 of 12 runs beside
        # three busy loops). The pool cannot settle other threads' caches; the two-streams
        # test below bounds what that costs in a real modify.
        job = pool.submit(cat)
        while not job.done():
            time.sleep(0.001)
        in_pool.append(where(job.result()))
        lo, hi = brk_heap()
        heap_size.append(hi - lo)
    names = {pool.submit(lambda: threading.current_thread().name).result() for _ in range(8)}
    early_runs = [where(early.submit(cat).result()) for _ in range(2)]
    via = where(asyncio.run(glibc_tuning.run_fn(pool, cat)))
    try:
        pool.submit(lambda: 1 / 0).result()
        error = None
    except ZeroDivisionError as e:
        error = type(e).__name__
    print(json.dumps({"tuned": glibc_tuning.tuned(), "main_arena": pool.main_arena,
                      "started": pool.probes, "size": pool.size, "in_pool": in_pool,
                      "heap_size": heap_size, "names": sorted(names), "early": early_runs,
                      "via": via, "error": error}))
""")


OUT_BYTES = 2 * 36 * 1024 * 1024 * 2    # POOL's torch.cat output (bf16)


@pytest.mark.slow  # fresh interpreters; the opt-in
def test_pool_threads_reuse_the_main_arena_and_an_own_arena_thread_does_not():
    r = _run(POOL)
    assert r["tuned"] and r["main_arena"] and r["started"] >= r["size"] >= 2
    assert r["names"] == ["kvedit-fn"]
    # every output from the brk heap, and the heap stops growing: later outputs reuse the
    # blocks earlier ones freed (glibc_tuning.settle_small_cache says why it is not at once)
    ptrs = [ptr for ptr, _ in r["in_pool"]]
    assert all(on_heap for _, on_heap in r["in_pool"])
    # Over the last 8 outputs the heap grows at most once, by less than one output (without
    # reuse it grows by an output each time: 8 x 151 MB). Once is tolerated: threads outside
    # the pool share the main arena (M_ARENA_MAX=1: the main thread, torch's OpenMP workers)
    # and their caches cannot be settled; seen in 2 of ~10 CI runs, +64.4 MiB at one late
    # output, then flat again.
    late = r["heap_size"][4:]
    grew = [b - a for a, b in zip(late, late[1:]) if b != a]
    assert len(grew) <= 1 and sum(grew) < OUT_BYTES, r["heap_size"]
    # the same memory again: each late output starts where an earlier one did, give or take
    # the small chunks the settled cache holds now (measured: at most 29 KiB; 1 MiB is under
    # 1% of the 151 MB output, whose pages are reused); the one after a growth may not
    reused = [any(abs(p - q) < 1 << 20 for q in ptrs[:i]) for i, p in enumerate(ptrs) if i >= 8]
    assert sum(reused) >= len(reused) - len(grew), ptrs
    assert r["via"][1]  # run_fn uses the pool
    # control: a thread with its own arena maps the 151 MB afresh, outside the heap
    assert not any(on_heap for _, on_heap in r["early"])
    assert r["error"] == "ZeroDivisionError"  # fn's exception reaches the caller as it is


HEAP = textwrap.dedent("""
    import json
    from kvedit.bench.modify import _new_tensor_malloc, _streams
    from kvedit.client import KVClient
    from kvedit.layout import ModelLayout
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
            with connect(server.url, server.http_url, "m", timeout=10,
                         tune_glibc_heap=True) as ctx:
                for seed in range(1, 8):
                    batch = _streams(ctx, client, 4, T, seed)
                    batch.modify_concurrency = 2
                    batch.modify(_new_tensor_malloc)
                    client.delete("m", [k for s in batch for k in s.keys])
                    lo, hi = brk_heap()
                    heap.append(hi - lo)
    finally:
        server.stop()
    print(json.dumps({"heap": heap, "out_block": kv_bytes // 8}))
""")


@pytest.mark.slow  # fresh interpreters; the opt-in
def test_torch_cat_outputs_of_two_streams_in_flight_stop_growing_the_heap():
    """Opted in; real server, 4 streams, two fns at a time returning fresh torch.cat outputs
    (75 MB each), 7 modifies: after the first, the brk heap grows by at most 4 output blocks
    in all (two outputs in flight and the alignment slack between them; how the two fns
    interleave moves it between 0 and 2 blocks beside three busy loops, 2026-12-02). With
    only the alignment tails' cache bins settled it reached 5 blocks in 2 of 6 such runs (the
    outputs' tensor structs, freed by another thread, pin too), and with the cache only filled
    before fn (not emptied after it) 9-10 blocks."""
    r = _run(HEAP)
    growth = [(h - r["heap"][0]) / r["out_block"] for h in r["heap"]]
    assert growth[-1] <= 4, growth


FAULTS = textwrap.dedent("""
    import resource, sys, torch
    if sys.argv[1] == "keep":
        from kvedit.sdk import glibc_tuning
        assert glibc_tuning.enable() is not None
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    src = torch.ones(64 * 2**20, dtype=torch.uint8)
    before = faults()
    for i in range(10):  # like an fn's torch.cat output every modify, other allocations between
        out = torch.empty_like(src).copy_(src)
        small = [torch.empty(100) for _ in range(50)]
        del out
    print(faults() - before)
""")


@pytest.mark.slow  # fresh interpreters; the opt-in
def test_the_opt_in_reuses_a_large_freed_block_without_page_faults():
    """A 64 MiB allocation repeated: malloc's default maps fresh pages each time (a fault per
    4 KiB page), the opt-in reuses the freed, touched block."""
    def faults(mode: str) -> int:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        r = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True,
                           text=True, check=True, timeout=120, env=env)
        return int(r.stdout.split()[-1])

    pages = 64 * 2**20 // 4096
    plain, keep = faults("plain"), faults("keep")
    assert plain > 10 * pages // 4  # fresh memory every time (huge pages may cut the count)
    assert keep < plain / 2 and keep < 5 * pages  # mostly the same touched block again
