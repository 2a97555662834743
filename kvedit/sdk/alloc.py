"""Reuse of large freed blocks, so an fn that allocates (torch.cat, index_select) does not
pay a page fault per 4 KiB on every modify.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and
returns it to the kernel on free; the next modify's 100+ MB output then faults in (and the
kernel zeroes) every page again: `torch.cat` in fn reached ~0.3x memcpy in `kvedit bench
modify`. With `mallopt(M_MMAP_MAX, 0)` large blocks come from the heap instead, and a high
`M_TRIM_THRESHOLD` keeps freed heap memory mapped, so the next allocation of that size
reuses touched pages. fn may still allocate whatever it likes; the cost is that the process
keeps its peak heap (the largest modify's working set) instead of returning it to the OS.

Process-wide and glibc-only, and OFF by default (`connect(keep_freed_memory=True)` turns
it on): measured here it does not yet reach its goal for modify. It works for allocations of
the main thread (a 64 MiB block reused 8 times in 10, page faults 10x -> ~2x its pages; a
fresh copy 0.89 s -> 0.27 s in `bench modify`'s memcpy_fresh_alloc), but modify runs fn in
worker threads, whose glibc arenas serve a request larger than a thread heap (64 MiB) with
a direct mmap whatever M_MMAP_MAX says; with M_ARENA_MAX=1 on top, reuse held for 2-3
calls, then small allocations interleaved by other threads split the freed block and every
call faulted fresh pages again. drop_half_cat stayed at 0.29x memcpy either way.
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
