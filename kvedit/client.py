"""KVClient: the low-level client of the kvedit server, used by the SDK and the vLLM connector.

Control messages go over ZMQ (one DEALER socket per thread, so a server-side wait in one
thread never holds up another). Data moves through the server's shared-memory segment when
this process can map it (slot offsets, the client copies in/out itself), otherwise over the
server's data link (raw TCP, kvedit.datalink). The segment is attached by mmap-ing
/dev/shm/NAME, never through multiprocessing.shared_memory, whose resource tracker would
unlink it when this process exits.
"""
from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
import time

import numpy as np
import torch
import zmq

from kvedit import protocol as P
from kvedit.handles import KVError, Retrieved, ServerUnavailable, StoreHandle, StoreResult
from kvedit.layout import ModelLayout
from kvedit.datalink import LinkClient
from kvedit.protocol import ServerInfo
from kvedit.server.pool import MAGIC, read_header

__all__ = ["KVClient", "KVError", "ServerUnavailable", "ServerInfo", "StoreHandle",
           "StoreResult", "Retrieved"]
log = logging.getLogger("kvedit.client")
SMALL_COPY_BYTES = 8 << 20


def copy_chunk(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), single-threaded below SMALL_COPY_BYTES.

    torch splits even a 256 KiB copy over its OpenMP threads; on a busy machine a descheduled
    thread then stalls the copy for milliseconds (measured: 20 ms instead of 0.1 ms with 2
    threads on 2 loaded cores). Large copies keep torch's threads, which pay off there.
    """
    n = dst.numel() * dst.element_size()
    if (n < SMALL_COPY_BYTES and src.device.type == "cpu" and src.dtype == dst.dtype
            and src.is_contiguous() and dst.is_contiguous()):
        np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.view(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src)


class KVClient:
    """Client of one kvedit server. Thread-safe: each thread gets its own ZMQ socket and data
    connection, so a server-side wait (lookup with wait_timeout) holds up only its caller.

    transfer_mode "shm": store copies into slots of the mapped segment, retrieve returns
    zero-copy views into it, valid until release(). "socket": bytes go over the data link;
    retrieved tensors live in receive buffers that are reused after release() as well.
    Survives a server restart: the next reply with a new instance id re-attaches, and models
    registered through this client are registered again on demand.
    """

    def __init__(self, url: str = "tcp://127.0.0.1:6555", *, use_shm: bool | None = None,
                 timeout: float = 30.0):
        self.url, self.timeout, self._use_shm = url, timeout, use_shm
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._link: LinkClient | None = None
        self._lock = threading.RLock()  # _check_instance reconnects while holding it
        self._rids = itertools.count(1)
        self._registered: dict[tuple[str, int], ModelLayout] = {}
        self._mm: mmap.mmap | None = None
        self._seg: torch.Tensor | None = None
        self._closed = False
        self.transfer_mode = "socket"
        try:
            self._connect()
        except BaseException:
            self.close()  # an open ZMQ socket would block interpreter exit
            raise

    # ---- connection -------------------------------------------------------------------
    def _connect(self) -> None:
        """(Re)read ServerInfo and attach to its segment as use_shm asks."""
        info = self._call(P.Hello())
        self._info = info
        if self._link is not None:
            self._link.close()
        host = self.url.rsplit("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        self._link = LinkClient(host, info.data_port, self.timeout)
        self._seg, self._mm = None, None
        reason = self._attach(info) if self._use_shm is not False else "use_shm=False"
        if reason is None:
            self.transfer_mode = "shm"
        elif self._use_shm:
            raise KVError("shm_unavailable", f"use_shm=True but {reason}")
        else:
            if self._use_shm is None and info.shm_name:
                log.info("kvedit client: socket transfers (%s)", reason)
            self.transfer_mode = "socket"

    def _attach(self, info: ServerInfo) -> str | None:
        """Map the segment; returns why it cannot be used, or None on success."""
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
        magic, instance, _, _ = read_header(mm)
        if magic != MAGIC or instance != info.instance:
            mm.close()
            return f"{path} belongs to another kvedit server (same name, another host?)"
        self._mm = mm
        self._seg = torch.frombuffer(mm, dtype=torch.uint8)
        return None

    def _check_instance(self, instance: int) -> None:
        """A reply from a restarted server: re-attach before trusting its slot offsets."""
        if instance != self._info.instance:
            with self._lock:
                if instance != self._info.instance:
                    log.warning("kvedit server at %s restarted: re-attaching", self.url)
                    self._connect()

    def _sock(self) -> zmq.Socket:
        s = getattr(self._local, "sock", None)
        if s is None:
            if self._closed:
                raise KVError("closed", "KVClient is closed")
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.url)
            self._local.sock = s
            with self._lock:
                self._sockets.append(s)
        return s

    def _drop_sock(self) -> None:
        """After a timeout: a fresh socket, so queued requests are never replayed later."""
        s = self._local.sock
        self._local.sock = None
        with self._lock:
            self._sockets.remove(s)
        s.close(linger=0)

    def _call(self, msg, timeout: float | None = None):
        """Send one request and wait for its reply. Raises KVError."""
        if self._closed:
            raise KVError("closed", "KVClient is closed")
        sock = self._sock()
        rid = next(self._rids).to_bytes(8, "little")
        sock.send_multipart([rid, P.encoder.encode(msg)])
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                self._drop_sock()
                raise ServerUnavailable("timeout", f"no reply from the kvedit server at "
                                                   f"{self.url} within {timeout or self.timeout}"
                                                   f" s to {type(msg).__name__}")
            frames = sock.recv_multipart(copy=False)
            if frames[0].bytes == rid:  # else: the late reply of an earlier, timed-out call
                break
        reply = P.reply_decoder.decode(frames[1].buffer)
        if isinstance(reply, P.Error):
            raise KVError(reply.code, reply.message)
        return reply

    def _model_call(self, model: str, tp_rank: int, msg, timeout: float | None = None):
        """A call naming a model: re-register once if a restarted server forgot it."""
        try:
            return self._call(msg, timeout=timeout)
        except KVError as e:
            layout = self._registered.get((model, tp_rank))
            if e.code != "unknown_model" or layout is None:
                raise
        self._call(P.Register(model=model, layout=layout))
        return self._call(msg, timeout=timeout)

    @property
    def recv_pool(self):
        return self._link.recv_pool

    def segment(self) -> tuple[str, torch.Tensor] | None:
        """(path, bytes) of the attached shared-memory segment, None in socket mode.

        Retrieved views point into these bytes, so `view.data_ptr() - bytes.data_ptr()` is the
        chunk's offset in the file at `path` (what kvedit.sdk.chunkmap maps from). Ask again
        after each retrieve: a server restart re-attaches a new segment."""
        seg, info = self._seg, self._info
        if seg is None or info is None or not info.shm_name:
            return None
        return f"/dev/shm/{info.shm_name}", seg

    # ---- API --------------------------------------------------------------------------
    def server_info(self) -> ServerInfo:
        return self._call(P.Hello())

    def register(self, model: str, layout: ModelLayout) -> None:
        self._call(P.Register(model=model, layout=layout))
        self._registered[(model, layout.tp_rank)] = layout

    def get_layout(self, model: str, tp_rank: int = 0) -> ModelLayout | None:
        return self._call(P.GetLayout(model=model, tp_rank=tp_rank)).layout

    def list_models(self) -> dict[str, list[ModelLayout]]:
        return self._call(P.ListModels()).models

    def lookup(self, model: str, keys: list[bytes], wait_timeout: float = 0.0,
               tp_rank: int = 0) -> int:
        msg = P.Lookup(model=model, keys=list(keys), tp_rank=tp_rank,
                       wait_timeout=float(wait_timeout))
        return self._model_call(model, tp_rank, msg, self.timeout + max(0.0, wait_timeout)).n

    def prepare_store(self, model: str, keys: list[bytes], tp_rank: int = 0) -> StoreHandle:
        msg = P.PrepareStore(model=model, keys=list(keys), tp_rank=tp_rank)
        slots = self._model_call(model, tp_rank, msg)
        self._check_instance(slots.instance)
        lay = slots.layout
        if self.transfer_mode == "shm":
            bufs = [self._view(off, lay) for off in slots.offsets]
        else:
            bufs = [torch.empty(lay.chunk_shape, dtype=getattr(torch, lay.dtype))
                    for _ in slots.missing]
        return StoreHandle(self, slots, bufs)

    def store(self, model: str, keys: list[bytes], chunks, tp_rank: int = 0) -> StoreResult:
        if isinstance(chunks, torch.Tensor) and chunks.dim() == 5:
            chunks = list(chunks.unbind(0))
        chunks = list(chunks)
        if len(chunks) != len(keys):
            raise KVError("bad_chunk", f"{len(chunks)} chunk(s) for {len(keys)} key(s), "
                                       f"expected one chunk per key")
        handle = self.prepare_store(model, keys, tp_rank)
        lay = handle.layout
        dtype = getattr(torch, lay.dtype)
        for i, c in enumerate(chunks):
            if not isinstance(c, torch.Tensor) or tuple(c.shape) != lay.chunk_shape \
                    or c.dtype != dtype:
                handle.abort()
                got = (f"{tuple(c.shape)} {c.dtype}" if isinstance(c, torch.Tensor)
                       else type(c).__name__)
                raise KVError("bad_chunk", f"chunk {i} is {got}, expected a tensor "
                                           f"{lay.chunk_shape} {dtype} (model {model!r} layout)")
        try:
            if self.transfer_mode == "shm":
                for buf, i in zip(handle.buffers, handle.missing):
                    copy_chunk(buf, chunks[i])
                return handle.commit()
            return handle.commit([chunks[i] for i in handle.missing])
        except BaseException:
            if not handle._done:
                handle.abort()
            raise

    def retrieve(self, model: str, keys: list[bytes], tp_rank: int = 0) -> Retrieved:
        shm = self.transfer_mode == "shm"
        msg = P.Retrieve(model=model, keys=list(keys), tp_rank=tp_rank, with_data=not shm)
        reply = self._model_call(model, tp_rank, msg)
        lay = reply.layout
        self._check_instance(reply.instance)  # a restarted server: new segment and data port
        if shm:
            if self.transfer_mode != "shm":  # the new server cannot be mapped: ask again
                self._call(P.Release(lease_id=reply.lease_id))
                return self.retrieve(model, keys, tp_rank)
            return Retrieved(self, [self._view(o, lay) for o in reply.offsets], reply.lease_id)
        if not reply.count:
            return Retrieved(self, [], None)
        # the server releases the lease once it has sent the bytes
        bufs = self._link.get(reply.lease_id, reply.count, lay)
        dtype = getattr(torch, lay.dtype)
        return Retrieved(self, [b.view(dtype).view(lay.chunk_shape) for b in bufs], None, bufs)

    def delete(self, model: str, keys: list[bytes], tp_rank: int = 0) -> int:
        return self._model_call(model, tp_rank,
                                P.Delete(model=model, keys=list(keys), tp_rank=tp_rank)).n

    def stats(self) -> dict:
        return self._call(P.Stats()).stats

    def _view(self, offset: int, lay: ModelLayout) -> torch.Tensor:
        return self._seg[offset:offset + lay.chunk_bytes].view(
            getattr(torch, lay.dtype)).view(lay.chunk_shape)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for s in self._sockets:
                s.close(linger=0)
            self._sockets.clear()
        if self._link is not None:
            self._link.close()
        self._ctx.term()
        self._seg = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # views still alive elsewhere: the mapping goes with them
                pass
            self._mm = None

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
