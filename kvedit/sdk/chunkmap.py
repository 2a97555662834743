"""Zero-copy retrieve: fn's kv mapped copy-on-write straight from the stored chunks.

In shm mode a stored chunk [2, L, C, D] is a page-aligned slot of the server's tmpfs
segment. Row r (K/V, layer) of chunk i of kv[2, L, T, D] is C*D contiguous elements, and so
is row r of the chunk's slot; when that row is a whole number of pages it can be mapped
MAP_PRIVATE at its place inside one reserved address range, so kv is assembled without
copying a byte. Pages fn reads are mapped in on first touch (a fault per 16 pages); the
first write to a page copies it (copy-on-write), so fn can never change a stored chunk, and
/proc/self/pagemap tells which pages fn wrote, exactly as for the copy path's tracked
buffers (kvedit.sdk.buffers). It is one of modify's two KVSources (kvedit.sdk.source).

The chunks must not change while anything uses the mapping: the retrieve's read lease is
held until the last tensor, view or array of it is gone (the server frees a deleted chunk
only once its last lease is released, and never evicts a leased one); then the range is
unmapped and the lease released. A kv that fn keeps after modify so stays valid, for at
most the server's lease TTL: past it the server may hand the slots to other keys, and pages
fn has not read yet would then show their bytes. modify checks the lease (check_lease)
before it commits an edit computed from the mapping, so an edit is never stored from bytes
read after the lease ran out; a kv kept beyond the TTL is reported when its lease is
finally released (a warning: the server answered lease_expired).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import weakref

import torch

from kvedit.sdk import libc
from kvedit.sdk.buffers import written_pages
from kvedit.sdk.geometry import contiguous_row_offset

MAX_MAPS = 16384  # mappings per kv; vm.max_map_count is 65530 per process by default
# BufferPool.note_outcome credit for the retrieve copy a mapping spares (per chunk, in
# comparisons), set where mapped and copied edits break even (docs/sdk.md, "Observations
# behind modify's design"). Ties go to the mapping: it needs no buffer memory and no fresh
# pages on a context's first modify.
COPY_SPARED = 1.5
_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000  # Linux values; the mmap module lacks MAP_FIXED
log = logging.getLogger("kvedit.sdk")


def _unmap(base: int, nbytes: int, release) -> None:
    libc.munmap(base, nbytes)
    try:
        release()
    except Exception as e:  # client closed, lease expired: the server drops it by TTL anyway
        if getattr(e, "code", None) == "lease_expired":
            log.warning("a kv mapped for modify was released after the server's lease TTL (a "
                        "slow fn, or fn kept kv after modify): bytes read from it after the "
                        "TTL may belong to other keys; clone kv if fn must keep it")


class MappedKV:
    """The bytes of kv[2, L, n*C, D], mapped privately from n stored chunks."""

    spares_copy = COPY_SPARED  # no retrieve copy was made (BufferPool.note_outcome credit)

    def __init__(self, path: str, offsets: list[int], layout, lease):
        rows = 2 * layout.num_layers
        row = layout.chunk_bytes // rows  # one (K/V, layer) row of one chunk
        n = len(offsets)
        self.nbytes = nbytes = n * layout.chunk_bytes
        base = libc.mmap(None, nbytes, 0,  # PROT_NONE: every byte is mapped over below
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base is None or base == ctypes.c_void_p(-1).value:
            raise OSError(libc.errno(), f"cannot reserve {nbytes} bytes of address space")
        try:
            fd = os.open(path, os.O_RDONLY)  # a private mapping never writes the file
        except OSError:
            libc.munmap(base, nbytes)
            raise
        try:
            for r in range(rows):
                for i, off in enumerate(offsets):
                    dst = base + contiguous_row_offset(r, i, n, row)
                    if libc.mmap(dst, row, mmap.PROT_READ | mmap.PROT_WRITE,
                                 mmap.MAP_PRIVATE | _MAP_FIXED, fd, off + r * row) != dst:
                        err = libc.errno()
                        libc.munmap(base, nbytes)
                        raise OSError(err, f"cannot map {path} at offset {off + r * row}")
        finally:
            os.close(fd)
        arr = (ctypes.c_ubyte * nbytes).from_address(base)
        # Unmap and release once the array is gone: torch.frombuffer's storages keep it alive.
        weakref.finalize(arr, _unmap, base, nbytes, lease.release)
        self._lease = lease
        self.view: torch.Tensor | None = torch.frombuffer(arr, dtype=torch.uint8)

    def written_pages(self):
        return None if self.view is None else written_pages(self.view.data_ptr(), self.nbytes)

    def check_lease(self) -> None:
        """KVError("lease_expired") once the chunks' read lease may have run out."""
        self._lease.check_lease()

    def close(self) -> None:
        """Nothing to hand back for reuse: the mapping is only this edit's (see release)."""

    def release(self) -> None:
        """Unmapped and the lease released now, unless fn's tensors live on (then with the
        last of them)."""
        self.view = None


def _slots(got) -> tuple[str, list[int]] | None:
    """(segment path, chunk offsets) of a shared-memory retrieve (the server's offsets, which
    the transport hands over in Retrieved), None when it has none (socket mode)."""
    if got.offsets is None or got.segment is None:
        return None
    return got.segment, list(got.offsets)


def map_chunks(client, model: str, keys: list[bytes], layout) -> MappedKV | None:
    """keys' chunks as a MappedKV, or None where mapping is not possible (socket mode, rows
    that are not whole pages, too many mappings); LookupError if some are missing."""
    rows, page = 2 * layout.num_layers, mmap.PAGESIZE
    if libc.mmap is None or sys.platform != "linux" or client.segment() is None \
            or (layout.chunk_bytes // rows) % page or rows * len(keys) > MAX_MAPS:
        return None
    got = client.retrieve(model, keys)
    try:
        if len(got.tensors) < len(keys):
            raise LookupError(f"only {len(got.tensors)} of its {len(keys)} chunks could be "
                              f"retrieved (evicted meanwhile?)")
        slots = _slots(got)
        size = os.path.getsize(slots[0]) if slots is not None else 0
        if slots is None or any(o % page or o < 0 or o + layout.chunk_bytes > size
                                for o in slots[1]):
            got.release()
            return None
        m = MappedKV(slots[0], slots[1], layout, got)
    except OSError:  # cannot open or map the segment here: the caller copies instead
        got.release()
        return None
    except BaseException:
        got.release()
        raise
    if not torch.equal(m.view[:64], got.tensors[0].reshape(-1).view(torch.uint8)[:64]):
        m.release()  # the segment was replaced meanwhile (server restart): not our chunks
        return None
    return m
