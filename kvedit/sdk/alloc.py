"""Reuse of large freed blocks, so an fn that allocates (torch.cat, index_select) does not
pay a page fault per 4 KiB on every modify.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and
returns it to the kernel on free; the next modify's 100+ MB output then faults in (and the
kernel zeroes) every page again: `torch.cat` in fn reached ~0.3x memcpy in `kvedit bench
modify`. With `mallopt(M_MMAP_MAX, 0)` large blocks come from the heap instead, and a high
`M_TRIM_THRESHOLD` keeps freed heap memory mapped, so the next allocation of that size
reuses touched pages. fn may still allocate whatever it likes; the cost is that the process
keeps its peak heap (the largest modify's working set) instead of returning it to the OS.

That works only in the main arena (the brk heap). A thread other than the main one gets its
own arena, whose heaps are at most 64 MiB: a larger request is a direct mmap whatever
M_MMAP_MAX says, unmapped again on free. So synchronous fns run where their allocations come
from the main arena:
- in the fn pool here (`batch.modify`, the async API and the budgeted driver alike;
  `pool_reuses_memory()`): `fn_pool()` threads that were checked to allocate from the main
  arena, two streams' fns side by side;
- only if the pool could not get such threads, a synchronous `batch.modify(...)` runs fn in
  its waiting thread (kvedit.sdk.loop.in_caller: the main arena when that is the main
  thread, one fn at a time).
The pool: glibc hands a new thread an arena round-robin once no new arena may be created,
so with `M_ARENA_MAX=1` a new thread lands on the main arena every few threads; the pool
starts threads until it has enough that do (the probe: an untouched 80 MiB tensor lies in
the brk heap), parking the others meanwhile, then lets the others go. If that fails (the
process already had more than 8 arenas, so glibc fixed its arena limit before), the pool
runs fn in plain threads and `fn_pool().main_arena` is False.

Process-wide and glibc-only: `connect(keep_freed_memory=True)` (the default) applies it
once; `False` leaves malloc alone. The costs: the process keeps its peak heap, and with
M_ARENA_MAX=1 threads created later share the existing arenas (more lock contention for
programs that malloc heavily from many threads).

Measured (`kvedit bench modify --json --repeats 9`): see docs/sdk.md "decode-time editing".
Not used: torch's THP_MEM_ALLOC_ENABLE=1 (huge pages for large CPU tensors; this kernel's
THP mode is `madvise`) helps a fresh torch.cat in a worker thread (0.26 -> 0.55x a warm copy
in a micro-benchmark) but c10 reads it once, at the first CPU allocation, so a library
cannot turn it on after torch has run; a user may set it in the environment.
"""
from __future__ import annotations

import asyncio
import functools
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvedit.sdk import libc

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameter numbers
TRIM_THRESHOLD = 2**31 - 1             # never trim the heap top back to the kernel
PROBE_BYTES = 80 << 20                 # above a thread heap's 64 MiB: only the main arena
PROBES_PER_THREAD = 16                 # thread starts allowed per pool thread to find one
# malloc sizes whose chunks (32-128 bytes) cover posix_memalign's tails: the leader and the
# remainder are each at most alignment (torch: 64) + glibc's MINSIZE (32)
TAIL_SIZES = range(8, 121, 16)

_lock = threading.Lock()
_applied: bool | None = None
_pool: FnPool | None = None


def keep_freed_memory() -> bool:
    """Apply the allocator setting once per process; True if it is in effect."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = libc.mallopt is not None and \
                bool(libc.mallopt(M_MMAP_MAX, 0)) and \
                bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and \
                bool(libc.mallopt(M_ARENA_MAX, 1))
        return _applied


def settle_small_cache() -> None:
    """Empty this thread's glibc tcache bins that alignment tails fall in into the arena, then
    fill them with fresh chunks (7 each). Called before and after every fn.

    torch allocates with posix_memalign, which carves an aligned block out of a larger chunk
    and frees the few bytes left at its ends; while the thread's tcache has room, such a tail
    is parked there, still "in use" for the heap, between the block and the rest of the heap.
    The freed block then cannot merge with its neighbours, and the next request of the same
    size (again with alignment slack) does not fit in it: the heap grows by a block.
    Filling the cache before fn is not enough: fn's own small allocations take entries out
    again, and the output's tails land in the gaps (`kvedit bench modify`: the heap grew by
    1.4 GB over the first drop_half_cat repeats and held ten 144 MiB blocks for two outputs
    in flight). So after fn the cache is emptied first (those tails come out with the rest)
    and refilled, and the emptied chunks are freed with the cache full: they go to the
    arena's bins, merged with their free neighbours at the next large malloc, and the freed
    output block is reused whole (same bench: the heap grew by 0.4 GB and then stayed).
    Costs ~0.15 ms per call."""
    if not _applied or libc.malloc is None or libc.free is None:
        return
    taken = [libc.malloc(n) for n in TAIL_SIZES for _ in range(7)]  # the cache's entries first
    fresh = [libc.malloc(n) for n in TAIL_SIZES for _ in range(7)]
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
    import torch

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


def pool_reuses_memory() -> bool:
    """Does the fn pool run fn where kept freed blocks are reused (every thread on the main
    arena)? Then it is where modify runs a synchronous fn, even with a waiting caller: two
    streams' fns run at once instead of one after the other in the caller's thread
    (`kvedit bench modify`, 6 runs, 5 alternating with the tree that ran it in the caller:
    drop_half_cat 0.48-0.62x memcpy vs 0.42-0.49; docs/sdk.md "where the time goes")."""
    pool = fn_pool()
    return pool is not None and pool.main_arena


async def run_fn(ctx, fn, /, *args, **kwargs):
    """fn(*args, **kwargs) in the fn pool (or the context's pool without one)."""
    pool = fn_pool()
    if pool is None:
        return await ctx.call(fn, *args, **kwargs)
    return await asyncio.wrap_future(pool.submit(fn, *args, **kwargs))
