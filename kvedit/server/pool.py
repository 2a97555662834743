"""The memory pool: one mapping (a POSIX shm segment or anonymous memory) and its allocator.

Segment layout: a 4 KiB header (magic, server instance id, pool offset/size) then the pool.
Clients check the header's instance id against ServerInfo before trusting slot offsets, so a
client never writes into a segment of another server that happens to have the same name.
The server holds an exclusive flock on the segment for its lifetime: at start-up a segment
whose lock can be taken was left by a crashed server (stale) and is replaced.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
from bisect import bisect_left, insort

import numpy as np

from kvedit.wire import HEADER_BYTES, SEGMENT_MAGIC as MAGIC, read_header, write_header  # noqa: F401

log = logging.getLogger("kvedit.server")

ALIGN = 4096
SHM_DIR = "/dev/shm"


class PoolError(RuntimeError):
    """The pool cannot be set up as configured (message says why and what to do)."""


class Arena:
    """The mapped pool memory. `shm_name` "" maps anonymous memory (socket transfers only)."""

    def __init__(self, pool_bytes: int, shm_name: str, lazy: bool, instance: int):
        self.shm_name = shm_name
        self.pool_offset = HEADER_BYTES
        self.pool_bytes = pool_bytes
        self.size = HEADER_BYTES + pool_bytes
        self.path = os.path.join(SHM_DIR, shm_name) if shm_name else ""
        self._fd = -1
        self.notes: list[str] = []  # what /status and the start-up log should tell the user
        if shm_name:
            self._fd = self._create_segment(lazy)
            self.mm = mmap.mmap(self._fd, self.size, flags=mmap.MAP_SHARED)
        else:
            self.mm = mmap.mmap(-1, self.size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)
        if not lazy:
            # Touch every page now so that first-touch faults never land on a transfer.
            self.buf[::mmap.PAGESIZE] = 0
        write_header(self.mm, instance, self.pool_offset, pool_bytes)

    def _create_segment(self, lazy: bool) -> int:
        path = self.path
        if os.path.exists(path):
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise PoolError(f"shared-memory segment {path} is in use by a running kvedit "
                                f"server: stop that server or pass another --shm-name") from None
            old = os.fstat(fd).st_size
            log.warning("removing stale shared-memory segment %s (%.2f GiB) left by a kvedit "
                        "server that did not shut down cleanly", path, old / 2**30)
            os.unlink(path)
            os.close(fd)
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
        if free < self.size:
            raise PoolError(
                f"shared memory asked for (--shm-name {self.shm_name!r}) but {SHM_DIR} has only "
                f"{free / 2**30:.2f} GiB free and the pool needs {self.size / 2**30:.2f} GiB: "
                f"lower --l1-size-gb, enlarge {SHM_DIR}, or pass --shm-name '' for socket-only "
                f"transfers")
        if lazy:
            self.notes.append(
                f"lazy pool: {path} takes tmpfs pages as data arrives; {SHM_DIR} had "
                f"{free / 2**30:.2f} GiB free at start, shared with other processes (if it fills "
                f"up, writes into the pool fail); --no-l1-use-lazy reserves the pool up front")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise PoolError(f"shared-memory segment {path} was created by another process "
                            f"while starting: pass another --shm-name") from None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            if lazy:  # sparse: tmpfs pages are taken as objects land in them
                os.ftruncate(fd, self.size)
            else:     # take every page now: no SIGBUS later if /dev/shm fills up
                os.posix_fallocate(fd, 0, self.size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise PoolError(f"cannot reserve {self.size / 2**30:.2f} GiB in {path}: {e}") from None
        return fd

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buf[offset:offset + nbytes]

    def close(self) -> None:
        """Unmap and unlink the segment (idempotent)."""
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.buf = None
        try:
            self.mm.close()
        except BufferError:  # a zero-copy send still references it; the OS frees it at exit
            pass


class Allocator:
    """Best-fit allocator of page-aligned byte ranges, coalescing on free.

    Free ranges are kept by start (to coalesce with neighbours on free) and segregated by size:
    one bucket of starts per distinct free-range size, plus the sorted list of those sizes.
    `alloc` bisects that list for the smallest size >= the request (best fit) and takes any
    range of that bucket, so its cost does not grow with the number of free holes: O(log d)
    for d distinct free sizes, plus an insort/del in that list when a size appears or goes
    (d is small: the sizes of d distinct page-multiple holes add up to at most the pool, so
    d <= sqrt(2 * pool pages), and in practice it is a few sizes per model layout).

    Several object sizes (several model layouts) share one pool. Best fit is the choice for
    that mix: a small object goes into the smallest hole that takes it (an exact-size hole
    first), so it does not split a hole that a large object fits into, and large holes stay
    whole for large objects. `alloc` returns None only when no free range of the requested
    size exists (the index evicts only then).
    """

    def __init__(self, start: int, size: int):
        self.capacity = size
        self.used = 0
        self._free: dict[int, int] = {}      # start -> size
        self._ends: dict[int, int] = {}      # end -> start
        self._by_size: dict[int, dict[int, None]] = {}   # size -> starts (an ordered set)
        self._sizes: list[int] = []          # the keys of _by_size, ascending
        if size > 0:
            self._add(start, size)

    @staticmethod
    def rounded(nbytes: int) -> int:
        return -(-nbytes // ALIGN) * ALIGN

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def holes(self) -> int:
        """Number of free ranges (after coalescing)."""
        return len(self._free)

    def largest_free(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    def ranges(self) -> list[tuple[int, int]]:
        """The free ranges (start, size) by address: for tests and debugging (O(n log n))."""
        return sorted(self._free.items())

    def _add(self, start: int, size: int) -> None:
        self._free[start] = size
        self._ends[start + size] = start
        bucket = self._by_size.get(size)
        if bucket is None:
            bucket = self._by_size[size] = {}
            insort(self._sizes, size)
        bucket[start] = None

    def _remove(self, start: int) -> int:
        size = self._free.pop(start)
        del self._ends[start + size]
        bucket = self._by_size[size]
        del bucket[start]
        if not bucket:
            self._drop_size(size)
        return size

    def _drop_size(self, size: int) -> None:
        del self._by_size[size]
        del self._sizes[bisect_left(self._sizes, size)]

    def alloc(self, nbytes: int) -> int | None:
        """The start of a free range of `nbytes` (rounded up to pages), or None if none fits."""
        got = self.alloc_many(nbytes, 1)
        return got[0] if got else None

    def alloc_many(self, nbytes: int, count: int) -> list[int]:
        """Up to `count` slots of `nbytes`; fewer only when no free range fits one more.

        Best fit per range: the smallest range that takes a slot gives as many slots as it
        holds (one split per range, not one per slot: a large store carves its slots from
        one big range in one step)."""
        n = self.rounded(nbytes)
        out: list[int] = []
        sizes = self._sizes
        while len(out) < count:
            i = bisect_left(sizes, n)
            if i == len(sizes):
                break
            size = sizes[i]
            bucket = self._by_size[size]
            start, _ = bucket.popitem()   # LIFO within a size: O(1), the most recently freed
            if not bucket:
                self._drop_size(size)
            del self._free[start]
            del self._ends[start + size]
            k = min(size // n, count - len(out))
            out.extend(range(start, start + k * n, n))
            if size > k * n:
                self._add(start + k * n, size - k * n)
        self.used += len(out) * n
        return out

    def free(self, start: int, nbytes: int) -> None:
        n = self.rounded(nbytes)
        self.used -= n
        end = start + n
        if end in self._free:           # merge with the next range
            n += self._remove(end)
        prev = self._ends.get(start)
        if prev is not None:            # merge with the previous range
            n += self._remove(prev)
            start = prev
        self._add(start, n)
