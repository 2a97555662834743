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
    """First-fit allocator of page-aligned byte ranges with coalescing on free.

    Several object sizes (several model layouts) share one pool. An exact-size bucket makes
    the common case (one size, freed and reused) O(1).
    """

    def __init__(self, start: int, size: int):
        self.capacity = size
        self.used = 0
        self._free: dict[int, int] = {}     # start -> size
        self._ends: dict[int, int] = {}     # end -> start
        self._by_size: dict[int, set[int]] = {}
        self._add(start, size)

    @staticmethod
    def rounded(nbytes: int) -> int:
        return -(-nbytes // ALIGN) * ALIGN

    def _add(self, start: int, size: int) -> None:
        self._free[start] = size
        self._ends[start + size] = start
        self._by_size.setdefault(size, set()).add(start)

    def _remove(self, start: int) -> int:
        size = self._free.pop(start)
        del self._ends[start + size]
        bucket = self._by_size[size]
        bucket.discard(start)
        if not bucket:
            del self._by_size[size]
        return size

    def alloc(self, nbytes: int) -> int | None:
        n = self.rounded(nbytes)
        bucket = self._by_size.get(n)
        if bucket:
            start = next(iter(bucket))
            self._remove(start)
        else:
            start = next((s for s, size in self._free.items() if size >= n), None)
            if start is None:
                return None
            size = self._remove(start)
            self._add(start + n, size - n)
        self.used += n
        return start

    def free(self, start: int, nbytes: int) -> None:
        n = self.rounded(nbytes)
        self.used -= n
        end = start + n
        if end in self._free:           # merge with the next block
            n += self._remove(end)
        prev = self._ends.get(start)
        if prev is not None:            # merge with the previous block
            n += self._remove(prev)
            start = prev
        self._add(start, n)
