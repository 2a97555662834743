"""modify's retrieve buffers: reused touched memory, and copy-on-write change tracking.

Fresh memory costs a page fault per 4 KiB page (docs/sdk.md, "Performance notes"), so
buffers are reused across modifies. A buffer is handed
out again only when nothing else uses what fn got (no tensor, view or numpy array of it
left; the check is made at take time because a worker thread may drop its last reference
just after the modify returns). The pool keeps at most `max_buffers` (raised to a batch's
modify_concurrency), the largest seen; `clear()` or closing the context frees them.

Change tracking. On Linux a buffer is a memfd: the retrieve writes the chunks through a
shared mapping, and fn gets them through a private (copy-on-write) mapping of the same
file. Any write by fn, whether by torch, numpy, ctypes or `.data`, makes the kernel copy
the page, and /proc/self/pagemap says which pages were copied. So a chunk that fn returns
in place and unwritten is known byte-identical to what was retrieved, and the key check in
modify needs no comparison for it. Without memfd or pagemap, plain memory (anonymous pages kvedit maps itself) and memcmp.
In shm mode modify maps the stored chunks themselves this way (kvedit.sdk.chunkmap) and
needs no buffer; these buffers serve socket mode, odd layouts and untracked handouts.

Copy-on-write costs a page copy per page fn writes (COW_COST_RATIO: its cost against a
byte-comparison of the same bytes; docs/sdk.md, "Observations behind modify's design"), so it
pays only when fn leaves whole chunks untouched and writes little. After an fn for which it
did not pay (written page fraction x COW_COST_RATIO > fraction of chunks it spared a
comparison, plus chunkmap.COPY_SPARED where
a mapping of the stored chunks also spared the retrieve copy), the next PLAIN_AFTER_LOSS
buffers are handed out plainly (fn writes the buffer itself; reused chunks are
byte-compared, which stops at the first difference), then tracking is tried again.
"""
from __future__ import annotations

import mmap
import os
import threading
import weakref

import numpy as np
import torch

_PAGEMAP = "/proc/self/pagemap"
# Storage references of a handed-out view nobody else uses: the view's own tensor + the
# storage object untyped_storage() hands out. Views, tensors and arrays made from it add.
_FREE_USES = 2
COW_COST_RATIO = 5.0
PLAIN_AFTER_LOSS = 8


def _storage_uses(t: torch.Tensor) -> int | None:
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else use_count(t.untyped_storage()._cdata)


def _cow_supported() -> bool:
    return hasattr(os, "memfd_create") and os.access(_PAGEMAP, os.R_OK)


class KVBuffer:
    """`target` receives the retrieved chunks; `open()` gives the bytes to hand to fn."""

    def __init__(self, nbytes: int, cow: bool):
        self.nbytes = nbytes
        self._fd: int | None = None
        if cow:
            fd = os.memfd_create("kvedit-kv", os.MFD_CLOEXEC)
            weakref.finalize(self, os.close, fd)  # the mappings keep the file alive
            os.ftruncate(fd, nbytes)
            self._fd = fd
            self.target = torch.frombuffer(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED),
                                           dtype=torch.uint8)
        else:
            self.target = torch.frombuffer(anonymous_pages(nbytes), dtype=torch.uint8)
        self.view: torch.Tensor | None = None
        self.private = False  # is `view` a copy-on-write mapping?

    def open(self, cow: bool = True) -> torch.Tensor:
        """Flat bytes for fn: a new private mapping of the target (or the target itself)."""
        self.private = cow and self._fd is not None
        if not self.private:
            self.view = self.target
        else:
            private = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.view = torch.frombuffer(private, dtype=torch.uint8)  # keeps the mapping
        return self.view

    def in_use(self) -> bool:
        return self.view is not None and _storage_uses(self.view) != _FREE_USES

    def written_pages(self) -> np.ndarray | None:
        """Per page of the open private mapping: written since open()? None if unknown."""
        if not self.private or self.view is None:
            return None
        return written_pages(self.view.data_ptr(), self.nbytes)


def anonymous_pages(nbytes: int) -> mmap.mmap:
    """Fresh memory mapped by kvedit itself, not by the process's malloc: what a plain buffer
    holds stays kvedit's (reused while the pool keeps it, unmapped with it) and malloc's own
    settings never decide its fate. Transparent huge pages are asked for where the kernel
    grants them on request (THP mode `madvise`), so first touches fault per 2 MiB, not 4 KiB."""
    pages = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            pages.madvise(mmap.MADV_HUGEPAGE)
        except OSError:   # a kernel without THP: 4 KiB pages
            pass
    return pages


def written_pages(ptr: int, nbytes: int) -> np.ndarray | None:
    """Per page of a private file mapping at ptr: written (copied on write)? None if unknown."""
    page = mmap.PAGESIZE
    first, npages = ptr // page, -(-nbytes // page)
    try:
        fd = os.open(_PAGEMAP, os.O_RDONLY)
        try:
            raw = os.pread(fd, npages * 8, first * 8)
        finally:
            os.close(fd)
    except OSError:
        return None
    if len(raw) != npages * 8:
        return None
    e = np.frombuffer(raw, dtype=np.uint64)
    present, swapped, file_page = ((e >> np.uint64(b)) & np.uint64(1) for b in (63, 62, 61))
    # A written page of a private file mapping is an anonymous copy (or swapped out).
    return ((present & (file_page ^ np.uint64(1))) | swapped).astype(bool)


class BufferPool:
    def __init__(self, max_buffers: int = 2, cow: bool | None = None):
        self.max_buffers = max_buffers
        self.cow = _cow_supported() if cow is None else cow
        self._bufs: list[KVBuffer] = []  # largest first
        self._lock = threading.Lock()     # taken/given from pool threads
        self._plain_left = 0              # plain handouts left after a write-heavy fn

    def use_cow(self) -> bool:
        """Track fn's writes this time? Unless it did not pay off lately."""
        with self._lock:
            cow = self.cow and self._plain_left == 0
            self._plain_left = max(0, self._plain_left - (not cow))
        return cow

    def note_outcome(self, written: np.ndarray | None, spared: float) -> None:
        """After a tracked fn: the pages it wrote (KVBuffer.written_pages) and the fraction
        of chunks whose comparison tracking spared."""
        if written is not None and written.size and written.mean() * COW_COST_RATIO > spared:
            with self._lock:
                self._plain_left = PLAIN_AFTER_LOSS

    def take(self, nbytes: int) -> KVBuffer:
        """A buffer of at least nbytes: a touched, unused pooled one if any."""
        with self._lock:
            fits = [i for i, b in enumerate(self._bufs) if b.nbytes >= nbytes and not b.in_use()]
            if fits:
                buf = self._bufs.pop(min(fits, key=lambda i: self._bufs[i].nbytes))
                buf.view = None  # the old private mapping goes with its last user
                return buf
        return KVBuffer(nbytes, self.cow)

    def give(self, buf: KVBuffer) -> None:
        """The caller is done with buf; it is reused once nobody else uses it either."""
        if self.max_buffers <= 0:
            return
        with self._lock:
            self._bufs.append(buf)
            self._bufs.sort(key=lambda b: b.nbytes, reverse=True)
            del self._bufs[self.max_buffers:]  # keep the largest

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()
