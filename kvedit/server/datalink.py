"""The data link: chunk bytes of socket-mode clients over plain TCP, straight into/out of the pool.

Why not ZMQ frames: ZMQ receives every message into a freshly malloc'd buffer, and for 36 MiB
chunks that is a fresh mmap whose page faults (plus the copy into the pool) cost more than
the transfer itself (docs/protocol.md, "Data path 2"). Here the server `recv_into`s the slots
themselves and `send`s from them, so a transfer costs what the kernel's TCP copy costs.

One thread per connection (a client opens one per thread); each blocks only on its own peer.
The ZMQ loop stays the only place that decides things: a transfer names a store or lease that
the loop created, and the service's begin_put/begin_get hand out its slots only to the
session that holds it (checked against the handshake). Framing: kvedit.wire.

Every wait has a bound, so a stalled or hostile peer cannot pin a thread or a slot:
- at most `max_data_conns` connections (beyond: an error reply instead of the nonce, close),
  and of them at most `max_handshakes` (`max_handshakes_per_peer` per peer) that have not
  authenticated yet (handshakes.py): a stranger without the secret never holds what
  authenticated clients need;
- the handshake must arrive within `handshake_timeout`, and a request header within
  `data_idle_timeout` of the previous request: total deadlines (a reaper thread shuts the
  socket down), so dripping one byte at a time does not extend them;
- mid-transfer each recv/send must make progress within `transfer_idle_timeout`, and the
  whole transfer must end within `transfer_timeout`;
- when the store/lease itself passes its TTL, the service shuts this socket down (cut), so
  a thread blocked in recv/send returns at once.
A cut transfer ends with finish_*(ok=False): the slots are reclaimed (or quarantined).
PUT sends the missing chunks in key order after the request; GET's reply carries the leased
chunks in key order, and the server releases that lease once they are sent.
Error replies carry "<code>: <message>" (code from kvedit.protocol.ErrorCode).
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from kvedit import auth
from kvedit.server.config import listen_backlog
from kvedit.server.handshakes import Handshakes
from kvedit.wire import FAILED, GET, MAGIC, OK, PUT, REPLY, REQUEST, recv_exact, tune

log = logging.getLogger("kvedit.server")


class TransferCut(Exception):
    """The transfer passed a deadline or its socket was shut down; the bytes are void."""


class DataLink:
    def __init__(self, service, cfg, secret: bytes | None):
        self.service, self.cfg, self.secret = service, cfg, secret
        self.listener = socket.create_server((cfg.host, cfg.data_port),
                                             backlog=listen_backlog())
        self.port = self.listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()   # guards _conns (accept thread vs connection threads)
        self._closing = False
        self._deadlines: dict[socket.socket, float] = {}   # armed waits (under _lock)
        self.handshakes = Handshakes(cfg.handshakes_total, cfg.max_handshakes_per_peer)
        self.thread = threading.Thread(target=self._accept, name="kvedit-data", daemon=True)
        self._reaper = threading.Thread(target=self._reap, name="kvedit-data-reaper",
                                        daemon=True)

    def start(self) -> None:
        self.thread.start()
        self._reaper.start()

    def _arm(self, conn: socket.socket, seconds: float) -> None:
        """`conn` must get what it waits for within `seconds` in total, or be shut down."""
        conn.settimeout(seconds)
        with self._lock:
            self._deadlines[conn] = time.monotonic() + seconds

    def _disarm(self, conn: socket.socket) -> None:
        with self._lock:
            self._deadlines.pop(conn, None)

    def _reap(self) -> None:
        while not self._closing:
            time.sleep(0.25)
            now = time.monotonic()
            with self._lock:
                late = [c for c, d in self._deadlines.items() if d <= now]
                for c in late:
                    del self._deadlines[c]
            for c in late:
                _shutdown(c)

    def connections(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        self._closing = True
        self.listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _shutdown(c)

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= self.cfg.max_data_conns
                if not full:
                    self._conns.add(conn)
            if full:  # refused before the handshake: the reply replaces the nonce
                self._refuse(conn)
                continue
            try:
                tune(conn)
                self.handshakes.admit(conn)   # may push out an older, unfinished handshake
                threading.Thread(target=self._serve, args=(conn,), name="kvedit-data-conn",
                                 daemon=True).start()
            except (OSError, RuntimeError) as e:  # peer reset at once / no thread to be had
                log.warning("data connection dropped at accept: %s", e)
                self.handshakes.done(conn)
                with self._lock:
                    self._conns.discard(conn)
                conn.close()

    def _refuse(self, conn: socket.socket) -> None:
        self.service.count_error("busy")
        try:
            conn.settimeout(1.0)  # a few dozen bytes: fits in any send buffer
            # no lingering here: the accept thread must not wait on a refused peer
            _send_error(conn, "busy", f"too many data-link connections (--max-data-conns "
                                      f"{self.cfg.max_data_conns}); close idle ones or retry",
                        linger=False)
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        cfg = self.cfg
        try:
            self._arm(conn, cfg.handshake_timeout)
            try:
                try:
                    session = auth.server_handshake(conn, self.secret)
                finally:
                    self.handshakes.done(conn)
            except (auth.AuthError, OSError) as e:
                with self._lock:
                    late = conn not in self._deadlines  # the reaper shut it down
                if isinstance(e, auth.AuthError) and not late:  # wrong MAC or short answer
                    self.service.count_error("unauthorized")
                    return _send_error(conn, "unauthorized", str(e))
                self.service.count_error("malformed")
                log.info("data connection closed: no complete handshake within %.1f s (%s)",
                         cfg.handshake_timeout, e)
                return
            self._disarm(conn)
            head = bytearray(REQUEST.size)
            while True:
                self._arm(conn, cfg.data_idle_timeout)
                try:
                    recv_exact(conn, head)
                except OSError:  # closed by the client, or idle too long (timeout, reaper)
                    return       # between requests: the client reconnects when it needs to
                self._disarm(conn)
                magic, op, pid, nbytes = REQUEST.unpack(head)
                if magic != MAGIC or op not in (PUT, GET):
                    self.service.count_error("malformed")
                    return _send_error(conn, "malformed", f"bad data-link request: magic "
                                                          f"{magic!r}, op {op}; expected magic "
                                                          f"{MAGIC!r} and op PUT=1 or GET=2")
                failure = (self._put(conn, session, pid, nbytes) if op == PUT
                           else self._get(conn, session, pid))
                if failure:  # after an error the byte stream is out of step: answer, close
                    self.service.count_error(failure[0])
                    return _send_error(conn, *failure)
        except (OSError, TransferCut) as e:  # the peer vanished or stalled: it was cut
            log.info("data connection closed: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._deadlines.pop(conn, None)
            conn.close()

    def _put(self, conn, session: bytes, store_id: int, nbytes: int):
        t = self.service.begin_put(store_id, session, nbytes, lambda: _shutdown(conn))
        if t.error:
            return t.error
        ok = False
        try:
            deadline = time.monotonic() + self.cfg.transfer_timeout
            for v in t.views:
                self._recv_into(conn, v, deadline)
            ok = True
        finally:
            error = self.service.finish_put(store_id, ok)
        if error:  # cut by its TTL just as the last byte came in
            return error
        conn.sendall(REPLY.pack(MAGIC, OK, 0, 0))
        return None

    def _get(self, conn, session: bytes, lease_id: int):
        t = self.service.begin_get(lease_id, session, lambda: _shutdown(conn))
        if t.error:
            return t.error
        ok = False
        try:
            deadline = time.monotonic() + self.cfg.transfer_timeout
            self._send(conn, memoryview(REPLY.pack(MAGIC, OK, sum(v.nbytes for v in t.views), 0)),
                       deadline)
            for v in t.views:
                self._send(conn, memoryview(v).cast("B"), deadline)
            ok = True
        finally:
            self.service.finish_get(lease_id, ok)
        return None

    def _timeout(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferCut(f"transfer took longer than --transfer-timeout "
                              f"{self.cfg.transfer_timeout} s")
        return min(self.cfg.transfer_idle_timeout, left)

    def _recv_into(self, conn: socket.socket, buf, deadline: float) -> None:
        view, pos = memoryview(buf).cast("B"), 0
        while pos < len(view):
            conn.settimeout(self._timeout(deadline))
            try:
                n = conn.recv_into(view[pos:])
            except TimeoutError:
                raise TransferCut(f"PUT made no progress for {self.cfg.transfer_idle_timeout} s "
                                  f"(--transfer-idle-timeout)") from None
            if not n:
                raise TransferCut("peer closed the data connection mid-PUT (or the store "
                                  "expired and the transfer was cut)")
            pos += n

    def _send(self, conn: socket.socket, view: memoryview, deadline: float) -> None:
        pos = 0
        while pos < len(view):
            conn.settimeout(self._timeout(deadline))
            try:
                pos += conn.send(view[pos:])
            except TimeoutError:
                raise TransferCut(f"GET made no progress for {self.cfg.transfer_idle_timeout} s "
                                  f"(--transfer-idle-timeout)") from None


LINGER_S = 1.0  # after an error reply: how long to swallow what the peer still sends


def _send_error(conn: socket.socket, code: str, message: str, linger: bool = True) -> None:
    """Send an error reply, then close gently: closing a socket with unread input sends a
    RST, which can destroy the reply before the peer reads it (e.g. a client still sending a
    PUT the server refused). So: stop sending, swallow the peer's bytes for LINGER_S."""
    msg = f"{code}: {message}".encode()
    try:
        conn.sendall(REPLY.pack(MAGIC, FAILED, 0, len(msg)) + msg)
        if not linger:
            return
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + LINGER_S
        sink = bytearray(1 << 16)
        while (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            if not conn.recv_into(sink):
                break
    except OSError:
        pass  # the peer is gone or slow; nothing more to tell


def _shutdown(conn: socket.socket) -> None:
    """Make a thread blocked in recv/send on `conn` return (safe from any thread)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
