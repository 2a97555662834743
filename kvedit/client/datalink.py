"""Client side of the server's data link (socket-mode chunk bytes over raw TCP).

One connection per thread, like the ZMQ sockets, so transfers of different threads run side
by side. Each connection starts with the handshake of kvedit.auth (the server's nonce
answered with this client's session id and an HMAC of the secret), so the server knows which
session's stores and leases it may touch. After any error the connection is dropped (the
byte stream is out of step) and the next transfer opens a fresh one. Framing: kvedit.wire.

Idle connections. The server closes a connection idle past its --data-idle-timeout, so a
client that reused it after a quiet minute lost that store or load. Three layers, each
counted in `counters`:
- a connection idle longer than `idle_timeout` (below the server's, which it announces in
  ServerInfo) is closed and replaced before use (`idle_reconnects`);
- before reuse, a connection the server has already closed (EOF or reset waiting in the
  socket) is replaced (`closed_reconnects`);
- a transfer on a reused connection that fails before any byte of the reply arrived is sent
  once more on a fresh connection (`retries`). That is safe whatever the server saw: it
  either never read the request (an idle close racing it), or the store/lease is one it
  will refuse or serve the same bytes for (a PUT of the same bytes, a GET of the same lease).
"""
from __future__ import annotations

import errno
import select
import socket
import threading
import time

import torch

from kvedit import auth
from kvedit import wire as DL
from kvedit.client.handles import KVError, RecvPool, ServerUnavailable
from kvedit.protocol import ERROR_CODES

RECV_POOL_BYTES = 512 << 20  # idle receive buffers kept for reuse
DEFAULT_IDLE_TIMEOUT = 30.0  # a server that does not announce its own (60 s by default)
IDLE_SHARE = 0.5             # of the server's idle timeout: when a client stops reusing


class Unanswered(ConnectionError):
    """The connection broke before any byte of the server's reply arrived."""


def raw_bytes(t: torch.Tensor):
    """A chunk's bytes as a buffer the socket sends without copying."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def client_idle_timeout(server_idle: float, asked: float | None = None) -> float:
    """How long this client reuses an idle connection: `asked` when given, else
    IDLE_SHARE of what the server announced (DEFAULT_IDLE_TIMEOUT if it announced nothing).
    Asking for more than the server keeps is allowed: a connection it closed is then found
    closed before use (and replaced) instead."""
    if asked is not None:
        return asked
    return IDLE_SHARE * server_idle if server_idle > 0 else DEFAULT_IDLE_TIMEOUT


def _split_code(message: str) -> tuple[str, str]:
    """A data-link error message "code: detail" -> (code, detail) when code is a protocol
    error code (unauthorized, not_holder, store_expired, ...); else ("data_link", message)."""
    code, sep, rest = message.partition(":")
    if sep and code.strip() in ERROR_CODES:
        return code.strip(), rest.strip()
    return "data_link", message


def closed_by_peer(conn: socket.socket) -> bool:
    """True when the peer has closed or reset `conn` (or sent bytes nobody asked for, which
    puts the stream out of step): never blocks."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        if not readable:
            return False
        conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)   # EOF, or stray bytes
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


class LinkClient:
    def __init__(self, host: str, port: int, timeout: float, session: bytes,
                 secret: bytes | None = None, idle_timeout: float = DEFAULT_IDLE_TIMEOUT):
        self.host, self.port, self.timeout = host, port, timeout
        self.session, self._secret = session, secret
        self.idle_timeout = idle_timeout
        self.recv_pool = RecvPool(RECV_POOL_BYTES)
        self._local = threading.local()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.counters = {"connects": 0, "idle_reconnects": 0, "closed_reconnects": 0,
                         "retries": 0}

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def _conn(self) -> tuple[socket.socket, bool]:
        """This thread's connection -> (it, reused): a fresh one when there was none, it had
        idled past idle_timeout, or the server had closed it."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            if time.monotonic() - self._local.used > self.idle_timeout:
                self._drop()
                self._count("idle_reconnects")
            elif closed_by_peer(conn):
                self._drop()
                self._count("closed_reconnects")
            else:
                return conn, True
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
        self._local.conn, self._local.used = conn, time.monotonic()
        with self._lock:
            self._conns.append(conn)
            self.counters["connects"] += 1
        return conn, False

    def _drop(self) -> None:
        conn, self._local.conn = self._local.conn, None
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)
        conn.close()

    def _io(self, what: str, fn):
        """Run fn(conn) on this thread's connection; errors -> KVError and a fresh connection.
        A reused connection that broke before the reply began is retried once (module doc)."""
        retried = False
        while True:
            conn, reused = self._conn()
            try:
                out = fn(conn)
            except KVError:
                self._drop()
                raise
            except OSError as e:
                self._drop()
                if isinstance(e, Unanswered) and reused and not retried:
                    retried = True
                    self._count("retries")
                    continue
                raise ServerUnavailable("data_link", f"data link {what} to {self.host}:"
                                                     f"{self.port} failed: {e}") from None
            self._local.used = time.monotonic()
            return out

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
        _recv_reply_head(conn, head)
        magic, status, nbytes, msglen = DL.REPLY.unpack(head)
        if magic != DL.MAGIC:
            raise KVError("bad_data", f"data link reply has magic {magic!r}, expected {DL.MAGIC!r}")
        if status:
            msg = bytearray(msglen)
            DL.recv_exact(conn, msg)
            raise KVError(*_split_code(msg.decode(errors="replace")))
        return nbytes

    @classmethod
    def _refusal(cls, conn: socket.socket, error: OSError) -> None:
        """After a failed send: raise the server's error reply if one arrived, else the
        send's error (Unanswered when not a byte of a reply came)."""
        try:
            conn.settimeout(1.0)
            cls._reply(conn)
        except Unanswered:
            raise Unanswered(f"{error} (no reply)") from None
        except OSError:
            pass
        raise error

    def put(self, store_id: int, chunks: list[torch.Tensor]) -> None:
        """Send the missing chunks of a prepared store into its slots."""
        raws = [raw_bytes(t) for t in chunks]

        def put(conn):
            try:
                conn.sendall(DL.REQUEST.pack(DL.MAGIC, DL.PUT, store_id,
                                             sum(r.nbytes for r in raws)))
                for r in raws:
                    conn.sendall(r)
            except OSError as e:
                # The server may have refused the PUT (store_expired, not_holder, ...) and
                # closed while the bytes were still going out: its reply says why.
                self._refusal(conn, e)
            self._reply(conn)

        self._io("PUT", put)

    def get(self, lease_id: int, sizes: list[int]) -> list[torch.Tensor]:
        """Receive a lease's objects (`sizes`: each one's bytes, in key order) -> uint8
        buffers (from the receive pool)."""
        def get(conn):
            try:
                conn.sendall(DL.REQUEST.pack(DL.MAGIC, DL.GET, lease_id, 0))
            except OSError as e:
                self._refusal(conn, e)
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


def _recv_reply_head(conn: socket.socket, head: bytearray) -> None:
    """Fill `head` with a reply header; Unanswered when the connection ends (EOF, reset)
    before its first byte, ConnectionError when it ends part-way."""
    view, pos = memoryview(head), 0
    while pos < len(view):
        try:
            n = conn.recv_into(view[pos:])
        except OSError as e:
            if pos == 0 and e.errno in (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED):
                raise Unanswered(f"the data connection was reset before the reply ({e})")
            raise
        if not n:
            if pos == 0:
                raise Unanswered("the server closed the data connection before replying")
            raise ConnectionError("peer closed the data connection mid-reply")
        pos += n
