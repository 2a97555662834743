"""KVClient: the low-level client of the kvedit server, used by the SDK and the vLLM connector.

Control messages go over ZMQ (one DEALER socket per thread, so a server-side wait in one
thread never holds up another). Data moves through the server's shared-memory segment when
this process can map it (slot offsets, the client copies in/out itself), otherwise over the
server's data link (raw TCP, one connection per thread, see kvedit.server.datalink). The segment is attached by mmap-ing /dev/shm/NAME, never through
multiprocessing.shared_memory, whose resource tracker would unlink it when this process exits.
"""
from __future__ import annotations

import itertools
import logging
import mmap
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from kvedit import protocol as P
from kvedit.layout import ModelLayout
from kvedit.protocol import ServerInfo
from kvedit.server import datalink as DL
from kvedit.server.pool import MAGIC, read_header

__all__ = ["KVClient", "KVError", "ServerUnavailable", "ServerInfo", "StoreHandle",
           "StoreResult", "Retrieved"]
log = logging.getLogger("kvedit.client")
RECV_POOL_BYTES = 512 << 20  # idle socket-mode receive buffers kept for reuse


class KVError(Exception):
    """An error reply (or a client-side check): .code names the kind, the message the detail."""

    def __init__(self, code: str, message: str):
        super().__init__(f"[{code}] {message}")
        self.code, self.message = code, message


class ServerUnavailable(KVError):
    """No reply from the server within the timeout."""


@dataclass(frozen=True, slots=True)
class StoreResult:
    stored: int    # chunks written by this call
    present: int   # chunks already in the server (or being written by another store)


class StoreHandle:
    """Slots for the missing keys of a prepare_store: fill .buffers, then commit() or abort()."""

    def __init__(self, client: KVClient, slots: P.StoreSlots, buffers: list[torch.Tensor]):
        self._client, self._slots, self._done = client, slots, False
        self.missing: list[int] = slots.missing
        self.present: int = slots.present
        self.layout: ModelLayout = slots.layout
        self.buffers = buffers

    def commit(self, data: list[torch.Tensor] | None = None) -> StoreResult:
        """Publish the data (socket mode sends `data` or the staging buffers as frames)."""
        if self._done:
            raise KVError("closed", "this store was already committed or aborted")
        self._done = True
        if self._client.transfer_mode == "socket" and self.missing:
            try:
                self._client._put(self._slots.store_id, self.buffers if data is None else data)
            except BaseException:
                self._done = False
                self.abort()
                raise
        reply = self._client._call(P.Commit(store_id=self._slots.store_id))
        return StoreResult(stored=reply.stored, present=self.present)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._client._call(P.Abort(store_id=self._slots.store_id))
            except KVError as e:
                if e.code != "unknown_store":  # already gone (data-link error, TTL): fine
                    raise

    def __enter__(self) -> StoreHandle:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if not self._done:
                self.commit()
        else:
            self.abort()


class Retrieved:
    """Tensors of the leading present keys; in shm mode zero-copy views valid until release()."""

    def __init__(self, client: KVClient, tensors: list[torch.Tensor], lease_id: int | None,
                 recycle: list[torch.Tensor] = ()):
        self._client, self._lease, self._recycle = client, lease_id, list(recycle)
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def release(self) -> None:
        if self._recycle:  # socket mode: the receive buffers go back to the client's pool
            self._client._recv_pool.give(self._recycle)
            self._recycle = []
        if self._lease is not None:
            lid, self._lease = self._lease, None
            self._client._call(P.Release(lease_id=lid))


class _RecvPool:
    """Socket-mode receive buffers, reused after Retrieved.release().

    Receiving into fresh memory costs a page fault per 4 KiB, which held socket retrieves to
    ~0.3x of raw TCP; reused buffers are already mapped. Keeps at most `cap` idle bytes.
    """

    def __init__(self, cap: int):
        self.cap, self.idle = cap, 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            bufs = self._free.get(nbytes)
            if bufs:
                self.idle -= nbytes
                return bufs.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, bufs: list[torch.Tensor]) -> None:
        with self._lock:
            for b in bufs:
                if self.idle + b.numel() <= self.cap:
                    self._free.setdefault(b.numel(), []).append(b)
                    self.idle += b.numel()

    def __enter__(self) -> Retrieved:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _raw(t: torch.Tensor):
    """A chunk's bytes as a buffer the socket sends without copying."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


class KVClient:
    def __init__(self, url: str = "tcp://127.0.0.1:6555", *, use_shm: bool | None = None,
                 timeout: float = 30.0):
        self.url, self.timeout, self._use_shm = url, timeout, use_shm
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._links: list[socket.socket] = []
        self._recv_pool = _RecvPool(RECV_POOL_BYTES)
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self._registered: dict[tuple[str, int], ModelLayout] = {}
        self._mm: mmap.mmap | None = None
        self._seg: torch.Tensor | None = None
        self._closed = False
        self.transfer_mode = "socket"
        self._connect()

    # ---- connection -------------------------------------------------------------------
    def _connect(self) -> None:
        """(Re)read ServerInfo and attach to its segment as use_shm asks."""
        info = self._call(P.Hello())
        self._info = info
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

    # ---- data link (socket mode) ------------------------------------------------------
    def _link(self) -> socket.socket:
        conn = getattr(self._local, "link", None)
        if conn is None:
            host = self.url.rsplit("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
            try:
                conn = socket.create_connection((host, self._info.data_port), self.timeout)
            except OSError as e:
                raise ServerUnavailable("data_link", f"cannot connect to the data link at "
                                                     f"{host}:{self._info.data_port}: {e}") from None
            DL.tune(conn)
            self._local.link = conn
            with self._lock:
                self._links.append(conn)
        return conn

    def _drop_link(self) -> None:
        conn, self._local.link = self._local.link, None
        with self._lock:
            self._links.remove(conn)
        conn.close()

    def _link_io(self, what: str, fn):
        """Run fn(conn) on this thread's data connection; errors -> KVError, fresh connection."""
        conn = self._link()
        try:
            return fn(conn)
        except KVError:
            self._drop_link()
            raise
        except OSError as e:
            self._drop_link()
            raise ServerUnavailable("data_link", f"data link {what} failed: {e}") from None

    @staticmethod
    def _link_reply(conn: socket.socket) -> int:
        head = bytearray(DL.REPLY.size)
        DL.recv_exact(conn, head)
        magic, status, nbytes, msglen = DL.REPLY.unpack(head)
        if magic != DL.MAGIC:
            raise KVError("bad_data", f"data link reply has magic {magic!r}, expected {DL.MAGIC!r}")
        if status:
            msg = bytearray(msglen)
            DL.recv_exact(conn, msg)
            raise KVError("data_link", msg.decode(errors="replace"))
        return nbytes

    def _put(self, store_id: int, chunks: list[torch.Tensor]) -> None:
        raws = [_raw(t) for t in chunks]

        def put(conn):
            conn.sendall(DL.REQUEST.pack(DL.MAGIC, DL.PUT, store_id, sum(r.nbytes for r in raws)))
            for r in raws:
                conn.sendall(r)
            self._link_reply(conn)

        self._link_io("PUT", put)

    def _get(self, lease_id: int, count: int, lay: ModelLayout) -> list[torch.Tensor]:
        def get(conn):
            conn.sendall(DL.REQUEST.pack(DL.MAGIC, DL.GET, lease_id, 0))
            nbytes = self._link_reply(conn)
            if nbytes != count * lay.chunk_bytes:
                raise KVError("bad_data", f"data link GET sends {nbytes} bytes, expected {count}"
                                          f" chunk(s) of {lay.chunk_bytes}")
            bufs = [self._recv_pool.take(lay.chunk_bytes) for _ in range(count)]
            for b in bufs:
                DL.recv_exact(conn, b.numpy())
            return bufs

        return self._link_io("GET", get)

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
                    buf.copy_(chunks[i])
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
        if shm:
            if reply.instance != self._info.instance:  # restarted: offsets are for a new segment
                self._call(P.Release(lease_id=reply.lease_id))
                self._check_instance(reply.instance)
                return self.retrieve(model, keys, tp_rank)
            return Retrieved(self, [self._view(o, lay) for o in reply.offsets], reply.lease_id)
        if not reply.count:
            return Retrieved(self, [], None)
        # the server releases the lease once it has sent the bytes
        bufs = self._get(reply.lease_id, reply.count, lay)
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
            for conn in self._links:
                conn.close()
            self._links.clear()
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
