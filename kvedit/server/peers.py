"""Which client sessions are still connected to the ROUTER, so what they hold can be let go.

A client session (the holder of its stores, leases and parked lookups) is the first 16 bytes
of the ZMQ routing id its sockets set (kvedit.client: session + thread number, 20 bytes); a
socket with another routing id is its own holder. When the last socket of a holder
disconnects, the service drops its parked lookups and releases its quarantined slots.

Why a socket monitor and not ZMQ_ROUTER_NOTIFY: ROUTER_NOTIFY is a draft API that the libzmq
bundled with pyzmq does not enable. The monitor reports ACCEPTED/DISCONNECTED per file
descriptor, and every received frame carries the descriptor it came from (ZMQ_SRCFD), which
ties a descriptor to a routing id. Descriptors are reused by the kernel, so the order
matters: the monitor is drained after each message is received (the I/O thread queued the
events of that descriptor before it queued the message) and a message that arrives on a
descriptor already reported closed marks its sender gone at once.

The same descriptor answers two questions about one socket's connection for the key feed
(key_feed.py): how many bytes the kernel has delivered to the peer (TCP_INFO: what a client
claims to have read is believed only that far), and, for a peer that does not read what the
server queued for it, `cut` shuts the connection down: libzmq then drops the connection and
frees the messages it still held for that peer (a DEALER reconnects by itself).

Connections are counted per peer (a local user by uid, a remote address: http_peer.py), and
one over `per_peer` is shut down as soon as the monitor reports it: sockets cost their
opener nothing, and each one the server keeps costs it a descriptor and queues.
"""
from __future__ import annotations

import logging
import socket
import struct

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvedit.server.http_peer import PeerKey, peer_key

log = logging.getLogger("kvedit.server")

SESSION_BYTES = 16
ROUTING_ID_BYTES = SESSION_BYTES + 4
_TCP_INFO_BYTES = 232
_BYTES_ACKED_AT = 120    # struct tcp_info: tcpi_bytes_acked (u64, Linux >= 4.1)


def holder_of(ident: bytes) -> bytes:
    """The session a ROUTER identity belongs to (see the module docstring)."""
    return ident[:SESSION_BYTES] if len(ident) == ROUTING_ID_BYTES else ident


class Peers:
    def __init__(self, router: zmq.Socket, per_peer: int = 1 << 30):
        self.monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.per_peer = per_peer
        self._fd_peer: dict[int, PeerKey] = {}      # counted connections
        self._peer_conns: dict[PeerKey, int] = {}
        self.refused = 0                            # connections shut over per_peer
        self._fd_ident: dict[int, bytes] = {}
        self._ident_fd: dict[bytes, int] = {}
        self._open: set[int] = set()
        self._holder_idents: dict[bytes, set[bytes]] = {}
        self.closed: list[bytes] = []   # idents whose connection closed (the caller drains)

    def seen(self, ident: bytes, frame: zmq.Frame) -> list[bytes]:
        """A message from `ident` arrived on `frame`'s descriptor -> the holders now gone."""
        gone = self.poll()
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:  # no descriptor (not TCP): nothing to track
            return gone
        if self._ident_fd.get(ident) != fd:
            self._forget_ident(ident)
            self._holder_idents.setdefault(holder_of(ident), set()).add(ident)
            old = self._fd_ident.get(fd)
            if old is not None:  # the descriptor's previous ident left unnoticed
                gone += self._drop_ident(old)
            self._fd_ident[fd], self._ident_fd[ident] = ident, fd
        if fd not in self._open:  # its DISCONNECTED came before the message was read
            gone += self._close(fd)
        return gone

    def poll(self) -> list[bytes]:
        """Apply queued monitor events -> the holders whose last socket disconnected."""
        gone: list[bytes] = []
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return gone
            ev = parse_monitor_message(frames)
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self._open.add(fd)
                old = self._fd_ident.get(fd)
                if old is not None:  # a reused descriptor: its old ident left unnoticed
                    gone += self._drop_ident(old)
                self._count(fd)
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                gone += self._close(fd)

    def _count(self, fd: int) -> None:
        """A new connection on `fd`: counted for its peer, or shut over the peer's bound."""
        try:
            s = socket.socket(fileno=fd)   # borrowed: detached below, never closed here
        except OSError:
            return
        try:
            peer = peer_key(s.getsockname(), s.getpeername())
            if self._peer_conns.get(peer, 0) >= self.per_peer:
                s.shutdown(socket.SHUT_RDWR)
                self.refused += 1
                if self.refused & (self.refused - 1) == 0:   # 1, 2, 4, ...: not a flood
                    log.warning("shut a ZMQ connection of %s: it has %d open, at most "
                                "(--max-zmq-conns-per-peer); %d shut so far", peer,
                                self.per_peer, self.refused)
                return
        except OSError:   # closed meanwhile: its DISCONNECTED follows
            return
        finally:
            s.detach()
        self._fd_peer[fd] = peer
        self._peer_conns[peer] = self._peer_conns.get(peer, 0) + 1

    def _close(self, fd: int) -> list[bytes]:
        peer = self._fd_peer.pop(fd, None)
        if peer is not None:
            n = self._peer_conns[peer] - 1
            if n:
                self._peer_conns[peer] = n
            else:
                del self._peer_conns[peer]
        self._open.discard(fd)
        ident = self._fd_ident.get(fd)
        return self._drop_ident(ident) if ident is not None else []

    def _drop_ident(self, ident: bytes) -> list[bytes]:
        holder = holder_of(ident)
        self.closed.append(ident)
        self._forget_ident(ident)
        if self._holder_idents.get(holder):
            return []
        self._holder_idents.pop(holder, None)
        return [holder]

    def _forget_ident(self, ident: bytes) -> None:
        fd = self._ident_fd.pop(ident, None)
        if fd is not None and self._fd_ident.get(fd) == ident:
            del self._fd_ident[fd]
        idents = self._holder_idents.get(holder_of(ident))
        if idents is not None:
            idents.discard(ident)

    def connected(self) -> int:
        return len(self._open)

    def take_closed(self) -> list[bytes]:
        """Idents whose connection closed since the last call."""
        out, self.closed = self.closed, []
        return out

    def _fd(self, ident: bytes) -> int | None:
        fd = self._ident_fd.get(ident)
        return fd if fd is not None and fd in self._open else None

    def delivered(self, ident: bytes) -> tuple[int, int] | None:
        """(descriptor, bytes the kernel has delivered to the peer on it) for `ident`'s
        connection; None when unknown (not TCP, not Linux, gone)."""
        fd = self._fd(ident)
        if fd is None:
            return None
        try:
            s = socket.socket(fileno=fd)   # borrowed: detached below, never closed here
        except OSError:
            return None
        try:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        except (OSError, AttributeError):
            return None
        finally:
            s.detach()
        if len(info) < _BYTES_ACKED_AT + 8:
            return None
        return fd, struct.unpack_from("=Q", info, _BYTES_ACKED_AT)[0]

    def cut(self, ident: bytes) -> bool:
        """Shut `ident`'s connection down (libzmq then closes it and frees its queue)."""
        fd = self._fd(ident)
        if fd is None:
            return False
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            return False
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        finally:
            s.detach()
        log.info("cut the connection of a client socket that left what the server sent "
                 "it unread")
        return True

    def close(self) -> None:
        self.monitor.close(linger=0)
