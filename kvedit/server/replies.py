"""What the server has queued for each client socket and the kernel has not delivered: bounded.

Why a module of its own: ROUTER keeps the replies to a peer that does not read them in that
peer's queue (up to ZMQ's high-water mark of messages), and a request costs its sender almost
nothing while its reply stays in the server (a `leased` of 8,192 offsets is ~74 KB): sockets
that never read grew the server by 18 MiB each, +539 MiB at 30 sockets. As Redis's
client-output-buffer-limit does, the bytes queued for each socket are counted, and a socket
past `per_socket` is cut: its connection is shut down (peers.py), which frees its queue (a
DEALER reconnects by itself and may start again, with nothing queued). Past `total` over all
sockets, the sockets holding the most are cut first until the total is back under it.
A cut socket is doomed until its connection is gone: libzmq tears it down a little later,
and replies meanwhile (to requests it had already sent) are dropped, not queued.
Queued = what the service sent minus what the kernel has delivered to the peer (TCP_INFO
bytes_acked, as for key watches): a client cannot make its replies look read without reading
them. The kernel is asked only when a socket's estimate passes the cap (or the total its
cap): one syscall per cap's worth of replies. Key-watch sockets are counted by the key feed
instead (key_feed.py: a snapshot's parts may wait there by design). A socket the kernel
cannot be asked about (not TCP) is not counted: ZMQ's high-water mark bounds it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Queue:
    fd: int          # the connection (a reconnect with the same routing id is a new one)
    base: int        # bytes the kernel had delivered on it when counting began
    sent: int = 0    # bytes the service sent it since
    est: int = 0     # queued, as last known (sent - delivered; an overestimate between asks)


class ReplyQueues:
    def __init__(self, per_socket: int, total: int,
                 delivered: Callable[[bytes], tuple[int, int] | None],
                 cut: Callable[[bytes], bool]):
        """`delivered(ident)` -> (connection, bytes the kernel delivered on it) or None;
        `cut(ident)` shuts its connection down."""
        self.per_socket, self.total_cap = per_socket, total
        self._delivered, self._cut = delivered, cut
        self._q: dict[bytes, _Queue] = {}
        self._doomed: set[bytes] = set()   # cut, their connection not gone yet
        self.total = 0      # sum of the estimates
        self.cuts = 0       # sockets cut over a cap

    def doomed(self, ident: bytes) -> bool:
        """Whether `ident` was cut and its connection is not gone yet (ignore it)."""
        return ident in self._doomed

    def admit(self, ident: bytes, nbytes: int) -> bool:
        """The service is about to send `nbytes` to `ident` -> False to drop them (a doomed
        socket, or one this message takes past its cap: cut now); the biggest sockets are
        cut while all of them hold more than the total cap."""
        if ident in self._doomed:
            return False
        q = self._q.get(ident)
        if q is None:
            now = self._delivered(ident)
            if now is None:
                return True
            q = self._q[ident] = _Queue(now[0], now[1])
        q.sent += nbytes
        q.est += nbytes
        self.total += nbytes
        if q.est > self.per_socket and self._refresh(ident, q) > self.per_socket:
            self._cut_one(ident)
            return False
        if self.total > self.total_cap:
            self._over_total()
        return ident not in self._doomed

    def gone(self, ident: bytes) -> None:
        """`ident`'s connection closed: ZMQ dropped what was queued for it."""
        self._doomed.discard(ident)
        self._forget(ident)

    def _forget(self, ident: bytes) -> None:
        q = self._q.pop(ident, None)
        if q is not None:
            self.total -= q.est

    def _refresh(self, ident: bytes, q: _Queue) -> int:
        """Ask the kernel -> bytes still queued for `ident` (0 when its connection went)."""
        now = self._delivered(ident)
        if now is None or now[0] != q.fd:   # gone, or a new connection: nothing of ours
            self._forget(ident)
            return 0
        queued = max(0, q.sent - (now[1] - q.base))
        self.total += queued - q.est
        q.est = queued
        return queued

    def _over_total(self) -> None:
        for ident, q in list(self._q.items()):
            if q.est:
                self._refresh(ident, q)
        while self.total > self.total_cap and self._q:
            self._cut_one(max(self._q, key=lambda i: self._q[i].est))

    def _cut_one(self, ident: bytes) -> None:
        self._forget(ident)
        if self._cut(ident):
            self.cuts += 1
            self._doomed.add(ident)

    def snapshot(self) -> dict:
        return {"reply_queued_bytes": self.total, "reply_cuts": self.cuts}
