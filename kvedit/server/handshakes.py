"""Data-link connections that have not authenticated yet: how many, and whose.

Why a module of its own: the data link takes a connection before it knows who is at the
other end, and the handshake (auth.py) is how it finds out. Before, a local user without the
secret could hold every one of the link's connections (--max-data-conns) by opening them and
never finishing the handshake, and socket-mode clients then got `busy` at almost every
connect. "What a stranger can hold before authenticating" is one invariant, kept here:
- at most `per_peer` connections in handshake per peer (a local user by uid on loopback,
  http_peer.py; an address otherwise) and `total` in all, far below the link's cap, so the
  rest of the link is always left to clients that authenticated;
- a new connection over a bound shuts down the oldest handshake of that peer (or, over the
  total, of the peer with the most), never an authenticated connection: a stranger's new
  connections push out its own, and a stalled handshake cannot lock out a fresh one;
- the server's own user is not bounded per peer (it can read the secret, and its clients
  open a connection per thread at once); the handshake deadline (--handshake-timeout)
  bounds how long any of them is held.
Thread-safe: the accept thread admits, connection threads finish (`done`).
"""
from __future__ import annotations

import os
import socket
import threading
from collections import OrderedDict

from kvedit.server.http_peer import PeerKey, peer_key


class Handshakes:
    def __init__(self, total: int, per_peer: int, own_uid: int | None = None):
        self.total, self.per_peer = total, per_peer
        self.own = ("uid", os.getuid() if own_uid is None else own_uid)
        self._lock = threading.Lock()
        self._open: OrderedDict[socket.socket, PeerKey] = OrderedDict()   # oldest first
        self._count: dict[PeerKey, int] = {}
        self.pushed_out = 0     # handshakes shut down to make room

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, conn: socket.socket) -> None:
        """`conn` starts its handshake; older handshakes over a bound are shut down."""
        try:
            peer = peer_key(conn.getsockname(), conn.getpeername())
        except OSError:   # reset already: its thread finds out at once
            peer = ("addr", "?")
        with self._lock:
            victims = []
            if peer != self.own and self._count.get(peer, 0) >= self.per_peer:
                victims.append(self._oldest(peer))
                self._forget(victims[-1])
            if len(self._open) >= self.total:
                victims.append(self._oldest(self._busiest()))
                self._forget(victims[-1])
            self.pushed_out += len(victims)
            self._open[conn] = peer
            self._count[peer] = self._count.get(peer, 0) + 1
        for v in victims:
            _shutdown(v)

    def done(self, conn: socket.socket) -> None:
        """`conn`'s handshake ended (authenticated, refused, cut or pushed out)."""
        with self._lock:
            self._forget(conn)

    def _forget(self, conn: socket.socket) -> None:
        peer = self._open.pop(conn, None)
        if peer is not None:
            n = self._count[peer] - 1
            if n:
                self._count[peer] = n
            else:
                del self._count[peer]

    def _oldest(self, peer: PeerKey) -> socket.socket:
        return next(c for c, p in self._open.items() if p == peer)

    def _busiest(self) -> PeerKey:
        """The peer with the most handshakes (the server's own user only if alone)."""
        others = {p: n for p, n in self._count.items() if p != self.own}
        pool = others or self._count
        return max(pool, key=pool.get)


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
