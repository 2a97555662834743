"""Client side of the server's data link (socket-mode chunk bytes over raw TCP).

One connection per thread, like the ZMQ sockets, so transfers of different threads run side
by side. Each connection starts with the handshake of kvedit.auth (the server's nonce
answered with this client's session id and an HMAC of the secret), so the server knows which
session's stores and leases it may touch. After any error the connection is dropped (the
byte stream is out of step) and the next transfer opens a fresh one. Framing: kvedit.wire.
"""
from __future__ import annotations

import socket
import threading

import torch

from kvedit import auth
from kvedit import wire as DL
from kvedit.client.handles import KVError, RecvPool, ServerUnavailable
from kvedit.protocol import ERROR_CODES

RECV_POOL_BYTES = 512 << 20  # idle receive buffers kept for reuse


def raw_bytes(t: torch.Tensor):
    """A chunk's bytes as a buffer the socket sends without copying."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _split_code(message: str) -> tuple[str, str]:
    """A data-link error message "code: detail" -> (code, detail) when code is a protocol
    error code (unauthorized, not_holder, store_expired, ...); else ("data_link", message)."""
    code, sep, rest = message.partition(":")
    if sep and code.strip() in ERROR_CODES:
        return code.strip(), rest.strip()
    return "data_link", message


class LinkClient:
    def __init__(self, host: str, port: int, timeout: float, session: bytes,
                 secret: bytes | None = None):
        self.host, self.port, self.timeout = host, port, timeout
        self.session, self._secret = session, secret
        self.recv_pool = RecvPool(RECV_POOL_BYTES)
        self._local = threading.local()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def _conn(self) -> socket.socket:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = socket.create_connection((self.host, self.port), self.timeout)
            except OSError as e:
                raise ServerUnavailable("data_link", f"cannot connect to the data link at "
                                                     f"{self.host}:{self.port}: {e}") from None
            try:
                DL.tune(conn)
                self._refused(conn)
                auth.client_handshake(conn, self._secret, self.session)
            except KVError:
                conn.close()
                raise
            except (OSError, auth.AuthError) as e:
                conn.close()
                raise ServerUnavailable("data_link", f"data link handshake with {self.host}:"
                                                     f"{self.port} failed: {e}") from None
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def _drop(self) -> None:
        conn, self._local.conn = self._local.conn, None
        with self._lock:
            self._conns.remove(conn)
        conn.close()

    def _io(self, what: str, fn):
        """Run fn(conn) on this thread's connection; errors -> KVError and a fresh connection."""
        conn = self._conn()
        try:
            return fn(conn)
        except KVError:
            self._drop()
            raise
        except OSError as e:
            self._drop()
            raise ServerUnavailable("data_link", f"data link {what} to {self.host}:{self.port} "
                                                 f"failed: {e}") from None

    @classmethod
    def _refused(cls, conn: socket.socket) -> None:
        """A server over its connection cap sends an error reply instead of the nonce: raise
        it as KVError (a random nonce starting like a failed reply: about 2^-40)."""
        head = conn.recv(DL.REPLY.size, socket.MSG_PEEK | socket.MSG_WAITALL)
        if len(head) == DL.REPLY.size:
            magic, status, _, _ = DL.REPLY.unpack(head)
            if magic == DL.MAGIC and status == DL.FAILED:
                cls._reply(conn)

    @staticmethod
    def _reply(conn: socket.socket) -> int:
        head = bytearray(DL.REPLY.size)
        DL.recv_exact(conn, head)
        magic, status, nbytes, msglen = DL.REPLY.unpack(head)
        if magic != DL.MAGIC:
            raise KVError("bad_data", f"data link reply has magic {magic!r}, expected {DL.MAGIC!r}")
        if status:
            msg = bytearray(msglen)
            DL.recv_exact(conn, msg)
            raise KVError(*_split_code(msg.decode(errors="replace")))
        return nbytes

    @classmethod
    def _refusal(cls, conn: socket.socket) -> None:
        """After a failed send: raise the server's error reply if one arrived, else return."""
        try:
            conn.settimeout(1.0)
            cls._reply(conn)
        except OSError:
            pass

    def put(self, store_id: int, chunks: list[torch.Tensor]) -> None:
        """Send the missing chunks of a prepared store into its slots."""
        raws = [raw_bytes(t) for t in chunks]

        def put(conn):
            conn.sendall(DL.REQUEST.pack(DL.MAGIC, DL.PUT, store_id, sum(r.nbytes for r in raws)))
            try:
                for r in raws:
                    conn.sendall(r)
            except OSError:
                # The server may have refused the PUT (store_expired, not_holder, ...) and
                # closed while the bytes were still going out: its reply says why.
                self._refusal(conn)
                raise
            self._reply(conn)

        self._io("PUT", put)

    def get(self, lease_id: int, sizes: list[int]) -> list[torch.Tensor]:
        """Receive a lease's objects (`sizes`: each one's bytes, in key order) -> uint8
        buffers (from the receive pool)."""
        def get(conn):
            conn.sendall(DL.REQUEST.pack(DL.MAGIC, DL.GET, lease_id, 0))
            nbytes = self._reply(conn)
            if nbytes != sum(sizes):
                raise KVError("bad_data", f"data link GET sends {nbytes} bytes, expected "
                                          f"{len(sizes)} object(s) of {sum(sizes)} bytes")
            bufs = [self.recv_pool.take(n) for n in sizes]
            for b in bufs:
                DL.recv_exact(conn, b.numpy())
            return bufs

        return self._io("GET", get)

    def close(self) -> None:
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
