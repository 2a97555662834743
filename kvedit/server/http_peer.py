"""Who is at the other end of a TCP connection: a local user (by uid) or an address.

Why: the HTTP API and the data link's handshakes (handshakes.py) bound connections per
peer, so that one peer holding connections open cannot crowd out the others. By address
alone every local process is the same peer (127.0.0.1), and one local user could crowd out
every other one, the liveness probe included. For a loopback connection the kernel knows
which user opened the client's socket: one sock_diag netlink query (the socket's exact
4-tuple, no table scan: tens of microseconds) gives its uid. Remote peers, and loopback ones
whose owner cannot be known, are keyed by address.

Only a live socket that a process holds has an owner: a client socket already closed (a
peer that churns connections) lingers as TIME_WAIT or orphaned, and the kernel reports uid 0
for it, so a churning user was taken for root and filled root's share, the liveness probe
of a server run as root included. Such sockets are not asked for (live states only) or are
refused (inode 0: no process holds it), and the connection is keyed by address.
"""
from __future__ import annotations

import functools
import ipaddress
import itertools
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
_NLMSG = struct.Struct("=IHHII")               # len, type, flags, seq, pid
_REQ = struct.Struct("=BBBBI")                 # family, protocol, ext, pad, states
# TCP states of a socket a process may hold (ESTABLISHED, SYN_SENT, FIN_WAIT1, FIN_WAIT2,
# CLOSE_WAIT, LAST_ACK, CLOSING): not TIME_WAIT (6), CLOSE (7), LISTEN (10), SYN_RECV (3)
_LIVE_STATES = sum(1 << s for s in (1, 2, 4, 5, 8, 9, 11))
_NO_COOKIE = struct.pack("=II", 0xFFFFFFFF, 0xFFFFFFFF)
_UID_AT = _NLMSG.size + 4 + 48 + 12            # inet_diag_msg: 4 bytes, sockid, 3 u32, uid
_INODE_AT = _UID_AT + 4                        # ... then the socket's inode

_SEQ = itertools.count(1)                      # netlink sequence numbers
PeerKey = tuple[str, object]                   # ("uid", 1000) or ("addr", "10.0.0.7")


def peer_key(sockname, peername, nl: socket.socket | None = None) -> PeerKey:
    """The peer of a connection whose local and remote addresses are these (as asyncio's
    get_extra_info gives them). `nl`: a netlink socket of `netlink()` to ask through (one
    thread's own, kept open: a socket a query costs a third of the query)."""
    host = peername[0] if peername else "?"
    if _is_loopback(host):
        uid = loopback_uid(sockname, peername, nl)
        if uid is not None:
            return ("uid", uid)
    return ("addr", host)


def netlink() -> socket.socket:
    """A sock_diag socket for `loopback_uid` (blocking, 0.5 s timeout)."""
    nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    nl.settimeout(0.5)
    return nl


def loopback_uid(sockname, peername, nl: socket.socket | None = None) -> int | None:
    """The uid owning the client socket of a loopback TCP connection, or None (not found,
    or no process holds it any more)."""
    try:
        if nl is not None:
            return _ask(nl, sockname, peername)
        with netlink() as own:
            return _ask(own, sockname, peername)
    except (OSError, AttributeError, ValueError, struct.error):
        return None


def _ask(nl: socket.socket, sockname, peername) -> int | None:
    family = socket.AF_INET6 if ":" in peername[0] else socket.AF_INET
    sockid = (struct.pack("!HH", peername[1], sockname[1]) + _addr(family, peername[0])
              + _addr(family, sockname[0]) + struct.pack("=I", 0) + _NO_COOKIE)
    req = _REQ.pack(family, socket.IPPROTO_TCP, 0, 0, _LIVE_STATES) + sockid
    seq = next(_SEQ)
    nl.send(_NLMSG.pack(_NLMSG.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0)
            + req)
    while True:   # a kept socket may hold the late answer to a query that timed out
        data = nl.recv(4096)
        if len(data) >= _NLMSG.size and _NLMSG.unpack_from(data)[3] == seq:
            break
    if len(data) < _INODE_AT + 4 or _NLMSG.unpack_from(data)[1] != SOCK_DIAG_BY_FAMILY:
        return None   # NLMSG_ERROR: no such socket (it closed meanwhile)
    uid, inode = struct.unpack_from("=II", data, _UID_AT)
    return uid if inode else None   # inode 0: orphaned, its uid is not its user's


def _addr(family: int, host: str) -> bytes:
    b = socket.inet_pton(family, host.split("%")[0])
    return b + bytes(16 - len(b))


@functools.lru_cache(maxsize=1024)
def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False
