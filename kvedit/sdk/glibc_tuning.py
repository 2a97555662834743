"""Opt-in tuning of glibc's malloc for edit fns that allocate large outputs themselves.

Nothing here runs unless asked: `connect(..., tune_glibc_heap=True)` or `enable()`. It
changes the whole process (every thread, every library in it), which is why kvedit never
does it by default; an fn that builds a new tensor can use kvedit's own output pages
instead (`new_kv`, kvedit.sdk.output), which need none of this.

What it does, and why each part. glibc serves an allocation above its mmap threshold (at
most 32 MiB) with a fresh mmap and returns it to the kernel on free, so an fn's 100+ MB
`torch.cat` output faults in (and the kernel zeroes) every page again on every modify.
- `mallopt(M_MMAP_MAX, 0)` makes large blocks come from the heap, and a high
  `M_TRIM_THRESHOLD` keeps freed heap memory mapped: the next allocation of that size reuses
  touched pages. Cost: the process keeps its peak heap instead of returning it to the OS.
- That works only in the main arena (the brk heap): any other thread's arena maps a block
  over 64 MiB afresh whatever M_MMAP_MAX says. So `M_ARENA_MAX=1`, and the fn pool: threads
  that were checked to allocate from the main arena (glibc hands new threads the existing
  arenas round-robin once no new arena may be made; the pool starts threads until enough
  land on the main arena, the probe being an untouched 80 MiB tensor in the brk heap) run
  the synchronous fns, two streams' side by side. Cost: threads created later share the
  existing arenas (more lock contention for programs that malloc heavily from many threads).
  If the process had more arenas before, glibc fixed its limit already; the pool then runs
  fn in plain threads and `fn_pool().main_arena` is False.
- Around every fn the pool thread settles its tcache (`settle_small_cache`, below), or
  posix_memalign's small alignment tails pin the freed blocks and the heap grows per call.

glibc only (`libc.mallopt` None elsewhere: `enable()` returns None and nothing changes).
Measured effect and history: docs/sdk.md, "Allocator".
"""
from __future__ import annotations

import asyncio
import functools
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvedit.sdk import libc

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameter numbers
TRIM_THRESHOLD = 2**31 - 1             # never trim the heap top back to the kernel
PROBE_BYTES = 80 << 20                 # above a thread heap's 64 MiB: only the main arena
PROBES_PER_THREAD = 16                 # thread starts allowed per pool thread to find one
# malloc sizes, one per tcache bin (chunks of 32-1040 bytes): posix_memalign's tails (at most
# alignment 64 + MINSIZE 32) and the small objects allocated beside a large block (torch's
# tensor and storage structs) both pin it if parked in a cache
CACHE_SIZES = range(8, 1017, 16)

_lock = threading.Lock()
_applied: bool | None = None
_pool: FnPool | None = None


def enable() -> FnPool | None:
    """Apply the malloc settings (once per process) and start the fn pool -> the pool, or
    None where glibc's mallopt is not available or refused a setting."""
    return fn_pool() if keep_freed_memory() else None


def keep_freed_memory() -> bool:
    """Apply the allocator settings once per process; True if they are in effect."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = libc.mallopt is not None and \
                bool(libc.mallopt(M_MMAP_MAX, 0)) and \
                bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and \
                bool(libc.mallopt(M_ARENA_MAX, 1))
        return _applied


def settle_small_cache() -> None:
    """Empty this thread's glibc tcache (every bin) into the arena, then fill it with fresh
    chunks (7 each). Called before and after every fn; ~0.6 ms a call.

    torch allocates with posix_memalign, which carves an aligned block out of a larger chunk
    and frees the few bytes left at its ends; while the thread's tcache has room, such a tail
    is parked there, still "in use" for the heap, between the block and the rest of the heap.
    The freed block then cannot merge with its neighbours, and the next request of the same
    size (again with alignment slack) does not fit in it: the heap grows by a block.
    Filling the cache before fn is not enough: fn's own small allocations take entries out
    again, and the output's tails land in the gaps. So after fn the cache is emptied first
    (those tails come out with the rest) and refilled, and the emptied chunks are freed with
    the cache full: they go to the arena's bins, merged with their free neighbours at the next
    large malloc, and the freed output block is reused whole. Every bin, not only the tails'
    (0.07 ms a call): with those alone a fresh-interpreter test grew the heap by a block in 3
    of 10 runs (0 of 15 with every bin). Other threads' caches are out of reach: a small
    chunk another thread carves right after a live output and parks in its cache pins that
    output the same way (the heap grows by a block, once). The heap growth this stops and
    what a call costs: docs/sdk.md, "History: the glibc tuning while it was connect()'s
    default"."""
    if not _applied or libc.malloc is None or libc.free is None:
        return
    taken = [libc.malloc(n) for n in CACHE_SIZES for _ in range(7)]  # the cache's entries first
    fresh = [libc.malloc(n) for n in CACHE_SIZES for _ in range(7)]
    for c in fresh + taken:  # fresh ones fill the cache; the taken ones go to the arena
        if c:
            libc.free(c)


def _brk_heap() -> tuple[int, int] | None:
    """The main arena's heap as (start, end): the span of the [heap] lines of
    /proc/self/maps (madvise, e.g. torch's huge pages, splits it into several)."""
    spans = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip().endswith("[heap]"):
                    lo, hi = line.split()[0].split("-")
                    spans.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return None
    return (min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else None


def on_main_arena() -> bool:
    """Does the calling thread allocate a large tensor from the main arena's brk heap?
    (With M_MMAP_MAX=0 the main arena grows that heap; any other arena mmaps the block.)
    The probe is not touched: it costs address space, not pages."""
    p = torch.empty(PROBE_BYTES, dtype=torch.uint8)
    heap = _brk_heap()
    return heap is not None and heap[0] <= p.data_ptr() < heap[1]


@dataclass
class FnPool:
    """Threads that run synchronous edit fns from one queue. `main_arena`: every one of them
    allocates from the main arena (so kept freed blocks are reused), found after `probes`
    thread starts."""
    size: int
    main_arena: bool = False
    probes: int = 0
    work: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def start(self, probe: bool) -> None:
        found, go = 0, threading.Event()
        while probe and found < self.size and self.probes < PROBES_PER_THREAD * self.size:
            verdict: queue.SimpleQueue = queue.SimpleQueue()
            self._thread(verdict, go)
            self.probes += 1
            # a thread's first malloc attaches its arena for good: keep it, or park it
            # (so the next new thread is handed the next arena, not this one again)
            found += verdict.get()
        go.set()  # parked threads exit: their arenas go back to glibc's free list
        self.main_arena = probe and found == self.size
        for _ in range(self.size - found):  # not found: plain threads, any arena
            self._thread(None, go)

    def _thread(self, verdict, go) -> None:
        threading.Thread(target=self._serve, args=(verdict, go), name="kvedit-fn",
                         daemon=True).start()

    def _serve(self, verdict, go) -> None:
        if verdict is not None:
            ok = on_main_arena()
            verdict.put(ok)
            if not ok:
                go.wait()
                return
        while True:
            fut, call = self.work.get()
            if fut.set_running_or_notify_cancel():
                settle_small_cache()
                try:
                    result = call()
                    settle_small_cache()  # the output's alignment tails out of the cache
                except BaseException as e:  # handed to the awaiting coroutine
                    call = None
                    fut.set_exception(e)
                else:
                    call = None   # fn's arguments (kv) go before its result is handed over
                    fut.set_result(result)
            # nothing of this job may outlive it here: a kv kept alive by this thread until
            # its next job would hold its buffer (not reusable) or its mapped chunks' lease
            fut = call = result = None

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        self.work.put((fut, functools.partial(fn, *args, **kwargs)))
        return fut


def fn_pool() -> FnPool | None:
    """The process's fn pool, made on first use; None unless keep_freed_memory() is in
    effect (then fn runs in the context's thread pool, as any blocking call)."""
    global _pool
    with _lock:
        if _pool is None and _applied:
            pool = FnPool(size=max(2, min(8, os.cpu_count() or 2)))
            pool.start(probe=True)
            _pool = pool
        return _pool


def tuned() -> bool:
    """Is the tuning in effect in this process (enable() was called and glibc took it)?"""
    return bool(_applied)


async def run_fn(pool: FnPool, fn, /, *args, **kwargs):
    """fn(*args, **kwargs) in the fn pool, awaited."""
    return await asyncio.wrap_future(pool.submit(fn, *args, **kwargs))
