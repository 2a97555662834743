"""The data link: chunk bytes of socket-mode clients over plain TCP, straight into/out of the pool.

Why not ZMQ frames: ZMQ receives every message into a freshly malloc'd buffer, and for 36 MiB
chunks that is a fresh mmap whose page faults (plus the copy into the pool) held transfers
to ~0.3x of raw loopback TCP. Here the server `recv_into`s the slots themselves and
`sendall`s from them, so a transfer costs what the kernel's TCP copy costs.

One thread per connection (a client opens one per thread); each blocks only on its own peer.
The ZMQ loop stays the only place that decides things: a transfer names a store or lease that
the loop created, and the index keeps it (marked busy) until the bytes have moved.
Framing: kvedit.wire.
PUT sends the missing chunks in key order after the request; GET's reply carries the leased
chunks in key order, and the server releases that lease once they are sent.
"""
from __future__ import annotations

import logging
import socket
import threading

from kvedit.wire import GET, MAGIC, PUT, REPLY, REQUEST, recv_exact, tune  # noqa: F401 (re-export)

log = logging.getLogger("kvedit.server")


class DataLink:
    def __init__(self, service, host: str):
        self.service = service
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._closing = False
        self.thread = threading.Thread(target=self._accept, name="kvedit-data", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self._closing = True
        self.listener.close()
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            tune(conn)
            self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        head = bytearray(REQUEST.size)
        try:
            while True:
                try:
                    recv_exact(conn, head)
                except ConnectionError:
                    return  # the client closed its connection between requests
                magic, op, pid, nbytes = REQUEST.unpack(head)
                if magic != MAGIC or op not in (PUT, GET):
                    return self._fail(conn, f"bad data-link request: magic {magic!r}, op {op}; "
                                            f"expected magic {MAGIC!r} and op PUT=1 or GET=2")
                err = self._put(conn, pid, nbytes) if op == PUT else self._get(conn, pid)
                if err:
                    return self._fail(conn, err)
        except OSError as e:  # the peer vanished: whatever it held expires by TTL
            log.info("data connection closed: %s", e)
        finally:
            self._conns.discard(conn)
            conn.close()

    @staticmethod
    def _fail(conn: socket.socket, message: str) -> None:
        # After an error the byte stream is out of step: answer, then drop the connection.
        msg = message.encode()
        conn.sendall(REPLY.pack(MAGIC, 1, 0, len(msg)) + msg)

    def _put(self, conn: socket.socket, store_id: int, nbytes: int) -> str | None:
        s = self.service
        with s.lock:
            p = s.index.stores.get(store_id)
            if p is None or p.busy:
                return f"PUT: {s.unknown_store(store_id)}" if p is None else \
                    f"PUT: store {store_id} is already receiving data on another connection"
            want = sum(o.nbytes for o in p.objs)
            if nbytes != want:
                return (f"PUT of store {store_id} announces {nbytes} bytes, expected {want} "
                        f"({len(p.objs)} missing chunk(s) of the layout)")
            p.busy = True  # not expired (freed) while bytes land in its slots
            views = [s.arena.view(o.offset, o.nbytes) for o in p.objs]
        try:
            for v in views:
                recv_exact(conn, v)
        finally:
            with s.lock:
                p.busy = False
        conn.sendall(REPLY.pack(MAGIC, 0, 0, 0))
        return None

    def _get(self, conn: socket.socket, lease_id: int) -> str | None:
        s = self.service
        with s.lock:
            p = s.index.leases.get(lease_id)
            if p is None or p.busy:
                return (f"GET: lease {lease_id} is unknown, released, expired, or already being "
                        f"sent (lease TTL {s.cfg.lease_ttl} s)")
            p.busy = True
            views = [s.arena.view(o.offset, o.nbytes) for o in p.objs]
        try:
            conn.sendall(REPLY.pack(MAGIC, 0, sum(v.nbytes for v in views), 0))
            for v in views:
                conn.sendall(v)
        finally:
            with s.lock:
                p.busy = False
                s.release(lease_id)
        return None
