"""Byte layouts shared by the server and its clients: the shm segment header and the data link.

Client code imports these from here and never from kvedit.server (the server's modules are
free to change; these bytes are the contract).

Segment header (first HEADER_BYTES of /dev/shm/<name>): magic, server instance id, pool
offset, pool bytes. A client checks the instance id against ServerInfo before trusting slot
offsets, so it never writes into a segment of another server that happens to share the name.

Data link (raw TCP, see kvedit.server.datalink and docs/protocol.md):
  handshake: server -> client NONCE_BYTES random nonce; client -> server its nonce(32) +
             session(16); server -> client its proof, client -> server its MAC: HMAC-SHA256
             of the secret over both nonces, the session and the port (32 each; kvedit.auth)
  request  <4s B 3x q Q>  magic "KVD1", op (PUT=1, GET=2), store/lease id, byte count
  reply    <4s B 3x Q I>  magic, status (0 ok, 1 error), payload bytes, message bytes
"""
from __future__ import annotations

import socket
import struct
from typing import NamedTuple

# ---- shared-memory segment header ------------------------------------------------------
HEADER_BYTES = 4096
SEGMENT_MAGIC = b"KVEDIT01"
SEGMENT_HEADER = struct.Struct("<8sQQQ")  # magic, instance, pool_offset, pool_bytes


class SegmentHeader(NamedTuple):
    magic: bytes
    instance: int
    pool_offset: int
    pool_bytes: int


def read_header(buf) -> SegmentHeader:
    return SegmentHeader(*SEGMENT_HEADER.unpack_from(buf, 0))


def write_header(buf, instance: int, pool_offset: int, pool_bytes: int) -> None:
    SEGMENT_HEADER.pack_into(buf, 0, SEGMENT_MAGIC, instance, pool_offset, pool_bytes)


# ---- data link --------------------------------------------------------------------------
MAGIC = b"KVD1"
PUT, GET = 1, 2
REQUEST = struct.Struct("<4sB3xqQ")
REPLY = struct.Struct("<4sB3xQI")
OK, FAILED = 0, 1
NONCE_BYTES = 32
SESSION_BYTES = 16
SOCK_BUF = 4 << 20


def recv_exact(sock: socket.socket, buf) -> None:
    """Fill `buf` (a writable buffer) from `sock`; ConnectionError if the peer goes away."""
    view, pos = memoryview(buf).cast("B"), 0
    while pos < len(view):
        n = sock.recv_into(view[pos:])
        if not n:
            raise ConnectionError("peer closed the data connection mid-transfer")
        pos += n


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
