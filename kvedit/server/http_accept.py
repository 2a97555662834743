"""The HTTP API's listening socket: it sheds a peer's new connections beyond a rate at accept.

Why: a peer that opens connections as fast as it can (open, send a request, close; again)
fills the kernel's accept queue (4,096 deep), and a new connection, the server's own liveness
probe included, waits behind every connection queued before it. The event loop spent ~200 µs
on each one (a transport, a protocol, a task, the peer's identity: py-spy on a server under
one such peer: 94% of the HTTP thread), so one Python churner (~5k connections a second) kept
the queue full and a probe waited 2-4 s, at times past a 5 s timeout. The gate (http.py) bounds
the connections a peer holds open, but a churner holds almost none: it is its *rate* of new
ones that costs. Here, inside the listening socket's `accept()` (asyncio calls it in a loop
until the queue is empty), a connection of a peer over `rate` new connections a second (a
token bucket holding one second's worth) gets a 503 and is closed before asyncio builds
anything for it (~40 µs), so the queue drains several times faster than a churner fills it.
The server's own user (who can read its secret anyway) is never shed. The peer's key, asked
of the kernel once here, is handed to the protocol (`take_key`) so it is not asked twice.
"""
from __future__ import annotations

import os
import socket
import time

from kvedit.server.config import listen_backlog
from kvedit.server.http_peer import PeerKey, netlink, peer_key

MAX_BUCKETS = 4096   # peers remembered; beyond, the ones back to a full bucket are forgotten

_SHED_BODY = (b'{"error": "too many new HTTP connections from this peer (over '
              b'--http-new-conns-per-peer a second); reuse a connection (keep-alive)"}\n')
_SHED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Connection: close\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s"
         % (len(_SHED_BODY), _SHED_BODY))


class ConnRate:
    """New connections of each peer, a token bucket per peer: `rate` a second, at most
    `rate` (one second's worth) saved up. Event-loop thread only."""

    def __init__(self, rate: float, own: PeerKey, clock=time.monotonic):
        self.rate, self.own, self.clock = float(rate), own, clock
        self.buckets: dict[PeerKey, tuple[float, float]] = {}   # peer: (tokens, when)
        self.shed = 0

    def admit(self, peer: PeerKey) -> bool:
        if peer == self.own:
            return True
        now = self.clock()
        tokens, when = self.buckets.get(peer, (self.rate, now))
        tokens = min(self.rate, tokens + (now - when) * self.rate)
        if tokens < 1.0:
            self.buckets[peer] = (tokens, now)
            self.shed += 1
            return False
        if peer not in self.buckets and len(self.buckets) >= MAX_BUCKETS:
            self._forget(now)
        self.buckets[peer] = (tokens - 1.0, now)
        return True

    def _forget(self, now: float) -> None:
        """Drop the peers whose bucket has filled up again (they are as if never seen)."""
        full = [p for p, (t, w) in self.buckets.items() if t + (now - w) * self.rate >= self.rate]
        for p in full:
            del self.buckets[p]
        if len(self.buckets) >= MAX_BUCKETS:   # all busy: forget the one seen longest ago
            del self.buckets[min(self.buckets, key=lambda p: self.buckets[p][1])]


class ScreeningSocket(socket.socket):
    """A listening socket whose accept() sheds the connections of a peer over its rate.
    `rate` 0 sheds nothing (keys are still handed over)."""

    rate: ConnRate | None = None
    keys: dict[int, tuple[object, PeerKey]]
    nl: socket.socket | None = None   # the event loop's sock_diag socket, kept open

    def accept(self):
        while True:
            conn, addr = super().accept()   # BlockingIOError when the queue is empty
            try:
                key = peer_key(conn.getsockname(), addr, self.nl)
            except OSError:   # gone already: asyncio would fail on it too
                conn.close()
                continue
            if self.rate is None or self.rate.admit(key):
                self.keys[conn.fileno()] = (addr, key)
                return conn, addr
            try:   # read what came (a request already here): the close is then a FIN, not
                conn.setblocking(False)   # a reset that could discard the 503 at the peer
                conn.recv(65536)
            except OSError:
                pass
            try:
                conn.send(_SHED)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        if self.nl is not None:
            self.nl.close()
        super().close()

    def take_key(self, fd: int, peername) -> PeerKey | None:
        """The key found at accept for the connection on `fd` (None: not this one's)."""
        got = self.keys.pop(fd, None)
        return got[1] if got is not None and got[0] == peername else None


def bind(host: str, port: int, rate: float) -> ScreeningSocket:
    """A listening TCP socket whose proto is IPPROTO_TCP: asyncio sets TCP_NODELAY on the
    accepted connections only then (socket.create_server leaves proto 0, and uvicorn's
    separate header and body writes then meet Nagle + delayed ACK: 44 ms a request)."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    family, kind, proto, _, addr = info[0]
    sock = ScreeningSocket(family, kind, proto)
    sock.keys = {}
    try:
        sock.nl = netlink()
    except OSError:   # no sock_diag here: every loopback peer is then its address
        sock.nl = None
    if rate > 0:
        sock.rate = ConnRate(rate, ("uid", os.getuid()))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(listen_backlog())
    except OSError:
        sock.close()
        raise
    return sock
