"""Reuse of large freed blocks, so an fn that allocates (torch.cat, index_select) does not
pay a page fault per 4 KiB on every modify.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and
returns it to the kernel on free; the next modify's 100+ MB output then faults in (and the
kernel zeroes) every page again: `torch.cat` in fn reached ~0.3x memcpy in `kvedit bench
modify`. With `mallopt(M_MMAP_MAX, 0)` large blocks come from the heap instead, and a high
`M_TRIM_THRESHOLD` keeps freed heap memory mapped, so the next allocation of that size
reuses touched pages. fn may still allocate whatever it likes; the cost is that the process
keeps its peak heap (the largest modify's working set) instead of returning it to the OS.

Process-wide and glibc-only: `connect(keep_freed_memory=True)` (the default) applies it
once; `False` leaves malloc alone. It helps allocations of the main thread's arena: a
synchronous `batch.modify(...)` runs a synchronous fn in the calling thread
(kvedit.sdk.loop.in_caller), so fn's torch.cat output reuses the previous one's pages.
Worker-thread arenas (the async API, where fn runs in the context's thread pool) serve a
request larger than a thread heap (64 MiB) with a direct mmap whatever M_MMAP_MAX says, so
there it changes nothing. Measured (`kvedit bench modify --json --repeats 9`, two processes
back to back): drop_half_cat 0.55x memcpy median (repeats 0.35, 0.43, then 0.50-0.62) vs
0.35 (0.31-0.36) with --no-keep-freed-memory; the process's RSS stayed flat over 30
repeated 150 MB allocations.
"""
from __future__ import annotations

import threading

from kvedit.sdk import libc

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameter numbers
TRIM_THRESHOLD = 2**31 - 1             # never trim the heap top back to the kernel

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the allocator setting once per process; True if it is in effect."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = libc.mallopt is not None and \
                bool(libc.mallopt(M_MMAP_MAX, 0)) and \
                bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        return _applied
