"""How chunk bytes move between a KVClient and the server: chosen once at connect.

Two implementations of one small interface:
- ShmTransport: the server's pool is mapped from /dev/shm; a store copies into its slots, a
  retrieve hands out zero-copy views valid until the lease is released.
- SocketTransport: bytes travel over the data link (kvedit.client.datalink); a store sends them, a
  retrieve receives them into reused buffers and the server ends the lease once sent.
KVClient, StoreHandle and Retrieved call only these methods, so nothing else in the client
(nor the SDK or the connector) asks which transport is in use; `mode` is for reports only.
"""
from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from kvedit import protocol as P
from kvedit.client.datalink import LinkClient
from kvedit.client.handles import Retrieved
from kvedit.layout import ModelLayout
from kvedit.wire import SEGMENT_MAGIC, read_header

if TYPE_CHECKING:
    from kvedit.client.handles import StoreHandle

TransferMode = Literal["shm", "socket"]
SMALL_COPY_BYTES = 8 << 20


def copy_chunk(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), single-threaded below SMALL_COPY_BYTES.

    torch splits even a 256 KiB copy over its OpenMP threads; on a busy machine a descheduled
    thread then stalls the whole copy (docs/protocol.md, "Observations behind the data path").
    Large copies keep torch's threads, which pay off there.
    """
    n = dst.numel() * dst.element_size()
    if (n < SMALL_COPY_BYTES and src.device.type == "cpu" and src.dtype == dst.dtype
            and src.is_contiguous() and dst.is_contiguous()):
        np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.view(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src)


def _dtype(lay: ModelLayout) -> torch.dtype:
    return getattr(torch, lay.dtype)


class ShmTransport:
    """The server's segment, mapped here. Build with `attach()`."""

    mode: TransferMode = "shm"
    with_data = False  # retrieve: the server sends offsets, the bytes stay in the segment

    def __init__(self, path: str, mm: mmap.mmap):
        self.path, self._mm = path, mm
        self._seg: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8)

    @classmethod
    def attach(cls, info: P.ServerInfo) -> ShmTransport | str:
        """Map the server's segment; or a string saying why it cannot be used here.

        Maps /dev/shm/NAME with mmap, never multiprocessing.shared_memory, whose resource
        tracker would unlink the segment when this process exits."""
        if not info.shm_name:
            return "the server has no shared memory (--shm-name '')"
        path = f"/dev/shm/{info.shm_name}"
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            return f"cannot open {path}: {e.strerror} (server on another host?)"
        try:
            size = os.fstat(fd).st_size
            if size != info.segment_bytes:
                return f"{path} is {size} bytes, the server says {info.segment_bytes}"
            flags = mmap.MAP_SHARED | (0 if info.lazy else mmap.MAP_POPULATE)
            mm = mmap.mmap(fd, size, flags=flags)
        except OSError as e:
            return f"cannot map {path}: {e}"
        finally:
            os.close(fd)
        head = read_header(mm)
        if head.magic != SEGMENT_MAGIC or head.instance != info.instance:
            mm.close()
            return f"{path} belongs to another kvedit server (same name, another host?)"
        return cls(path, mm)

    def _view(self, offset: int, lay: ModelLayout) -> torch.Tensor:
        return self._seg[offset:offset + lay.chunk_bytes].view(_dtype(lay)).view(lay.chunk_shape)

    def store_buffers(self, slots: P.StoreSlots) -> list[torch.Tensor]:
        if slots.nbytes:   # a queries object: raw bytes of the size the store asked for
            return [self._seg[off:off + slots.nbytes] for off in slots.offsets]
        return [self._view(off, slots.layout) for off in slots.offsets]

    def write(self, handle: StoreHandle, chunks: list[torch.Tensor]) -> None:
        for buf, chunk in zip(handle.buffers, chunks):
            handle.check_deadline()  # never copy into a slot the server may have reclaimed
            copy_chunk(buf, chunk)

    def publish(self, handle: StoreHandle) -> None:
        """The bytes are in the slots already; commit alone publishes them."""

    def open_lease(self, client, reply: P.Leased, deadline: float) -> Retrieved:
        if reply.sizes:   # queries objects: raw bytes
            views = [self._seg[off:off + n] for off, n in zip(reply.offsets, reply.sizes)]
        else:
            views = [self._view(off, reply.layout) for off in reply.offsets]
        lease = reply.lease_id
        return Retrieved(views, lambda: client.release_lease(lease), deadline,
                         offsets=list(reply.offsets), segment=self.path)

    def segment(self) -> tuple[str, torch.Tensor] | None:
        return None if self._seg is None else (self.path, self._seg)

    def counters(self) -> dict[str, int]:
        """No connection of its own to count."""
        return {}

    def close(self) -> None:
        self._seg = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # views still alive elsewhere: the mapping goes with them
                pass
            self._mm = None


class SocketTransport:
    """The server's data link (raw TCP); one connection per thread, see kvedit.client.datalink."""

    mode: TransferMode = "socket"
    with_data = True  # retrieve: the server sends the bytes on the data link, then releases

    def __init__(self, link: LinkClient):
        self.link = link

    def store_buffers(self, slots: P.StoreSlots) -> list[torch.Tensor]:
        if slots.nbytes:   # a queries object: raw bytes
            return [torch.empty(slots.nbytes, dtype=torch.uint8) for _ in slots.missing]
        lay = slots.layout
        return [torch.empty(lay.chunk_shape, dtype=_dtype(lay)) for _ in slots.missing]

    def write(self, handle: StoreHandle, chunks: list[torch.Tensor]) -> None:
        handle.check_deadline()
        self.link.put(handle.store_id, chunks)
        handle.sent = True

    def publish(self, handle: StoreHandle) -> None:
        if not handle.sent and handle.missing:
            self.write(handle, handle.buffers)

    def open_lease(self, client, reply: P.Leased, deadline: float) -> Retrieved:
        lay = reply.layout
        if not reply.count:
            return Retrieved([], None, deadline)
        bufs = self.link.get(reply.lease_id, reply.sizes or [lay.chunk_bytes] * reply.count)
        views = bufs if reply.sizes else [b.view(_dtype(lay)).view(lay.chunk_shape)
                                          for b in bufs]
        pool = self.link.recv_pool
        # the server ended the lease once the bytes were sent: release recycles the buffers
        return Retrieved(views, lambda: pool.give(bufs), None)

    def segment(self) -> tuple[str, torch.Tensor] | None:
        return None

    def counters(self) -> dict[str, int]:
        """The data link's reconnects and retries (kvedit.client.datalink)."""
        return dict(self.link.counters)

    def close(self) -> None:
        self.link.close()


Transport = ShmTransport | SocketTransport
