"""The Redis side of the second tier: key names, the checksummed record, and the three
operations the L2 threads need (put a chunk, probe which keys are there, read one into a slot).

A chunk is two Redis keys written in one MULTI/EXEC: the payload (the chunk's bytes, sent
straight from its L1 slot: redis-py passes a large memoryview to sendall without copying) and
a 24-byte meta record (format tag, byte count, XXH3-64 of the payload). A read is byte-exact
or a miss: a payload whose length or checksum differs from its meta, a payload without a meta
or the other way round (Redis evicted one of them), or a meta of another format all count as
misses. XXH3 and not blake2b or CRC-32: on this machine blake2b hashes ~0.5 GB/s and zlib's
CRC-32 ~2.3 GB/s, against the ~1-1.4 GB/s a SET moves, so either would cost the write path a
large share of its speed; XXH3 runs at memory speed (~10x CRC-32 here). It guards against
torn, truncated and swapped values, not against someone who can write to the Redis (they
could recompute any unkeyed hash too).

With --l2-mac the meta record carries an HMAC-SHA256 (key derived from the shared secret)
of the Redis key, the byte count and the payload instead, so a record written by whoever can
reach the Redis but lacks the secret (a Redis without a password: any local user) is a miss,
never a promoted chunk. That costs ~0.5 GB/s per thread of hashing, on the L2 threads (not
the control loop), hence opt-in. A server with the MAC on reads only MAC'd records and one
without it only plain ones.

Payload reads bypass redis-py's reply parser (~0.25 GB/s without hiredis: it copies the
bulk string several times): the GET is sent on the connection and the bulk body is received
with recv_into straight into the L1 slot. Only the header line is parsed here.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import redis
import xxhash

from kvedit.layout import ModelLayout

META = struct.Struct("<8sQQ")        # format tag, payload bytes, xxh3_64
META_TAG = b"kvedit.1"
MAC_META = struct.Struct("<8sQ32s")  # format tag, payload bytes, HMAC-SHA256
MAC_TAG = b"kvedit.h"
META_SUFFIX = b":m"
ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)   # Redis down or slow
_HASHER = ThreadPoolExecutor(1, thread_name_prefix="kvedit-l2-hash")   # overlaps hash and send


class L2ProtocolError(redis.ConnectionError):
    """The server sent something other than a bulk string to a GET (the connection is
    dropped: its stream position is unknown)."""


@dataclass(frozen=True, slots=True)
class Meta:
    nbytes: int
    digest: int | bytes      # xxh3_64, or the HMAC with --l2-mac


def layout_tag(layout: ModelLayout) -> str:
    """12 hex digits naming the layout (shape, dtype, rank, RoPE): two layouts of one model
    name never share a Redis key, even though the chunk key already hashes the layout."""
    return hashlib.blake2b(msgspec.msgpack.encode(layout), digest_size=6).hexdigest()


def redis_key(prefix: str, model: str, tag: str, tp_rank: int, key: bytes) -> bytes:
    return f"{prefix}:{model}:{tag}:{tp_rank}:".encode() + key.hex().encode()


def checksum(view) -> int:
    return xxhash.xxh3_64_intdigest(view)


def pack_meta(nbytes: int, digest: int) -> bytes:
    return META.pack(META_TAG, nbytes, digest)


def unpack_meta(raw: bytes | None, mac: bool = False) -> Meta | None:
    """The meta of one record: a plain one, or (`mac`) a MAC'd one; None for the other kind."""
    fmt, want = (MAC_META, MAC_TAG) if mac else (META, META_TAG)
    if raw is None or len(raw) != fmt.size:
        return None
    tag, nbytes, digest = fmt.unpack(raw)
    return Meta(nbytes, digest) if tag == want else None


def record_mac(key: bytes, rkey: bytes, view) -> bytes:
    """HMAC-SHA256 of a record: its Redis key, its byte count and its payload."""
    mv = memoryview(view).cast("B")
    h = hmac.new(key, rkey + struct.pack("<Q", len(mv)), hashlib.sha256)
    h.update(mv)
    return h.digest()


class RedisChunks:
    """Chunk records in one Redis (or Valkey) instance. One per thread: each holds its own
    connection (redis-py clients are not to be shared across threads mid-command)."""

    def __init__(self, url: str, timeout: float, ttl: float = 0.0,
                 mac_key: bytes | None = None):
        self.url = url
        self.mac_key = mac_key   # --l2-mac: records carry an HMAC of the secret
        self.ttl = int(ttl) if ttl > 0 else None   # EX takes whole seconds
        # a pool (of about one connection: one thread uses it) connects at first use, so a
        # server starts while Redis is down
        self.pool = redis.ConnectionPool.from_url(url, socket_timeout=timeout,
                                                  socket_connect_timeout=timeout)
        self.client = redis.Redis(connection_pool=self.pool)

    def ping(self) -> None:
        self.client.ping()

    def put(self, rkey: bytes, view) -> int | bytes:
        """Write one chunk (payload from `view`, a buffer over its slot) and its meta in one
        MULTI/EXEC -> its checksum. The checksum is computed on another thread while the payload is
        being sent (both release the GIL), so it costs little beyond the SET itself; the
        meta that carries it goes last, before EXEC."""
        mv = memoryview(view).cast("B")
        digest = (_HASHER.submit(record_mac, self.mac_key, rkey, mv) if self.mac_key
                  else _HASHER.submit(checksum, mv))
        ex = ("EX", self.ttl) if self.ttl else ()
        conn = self.pool.get_connection()
        try:
            conn.send_command("MULTI")
            conn.send_command("SET", rkey, mv, *ex)
            meta = (MAC_META.pack(MAC_TAG, len(mv), digest.result()) if self.mac_key
                    else pack_meta(len(mv), digest.result()))
            conn.send_command("SET", rkey + META_SUFFIX, meta, *ex)
            conn.send_command("EXEC")
            replies = [conn.read_response() for _ in range(4)]
        except BaseException:
            conn.disconnect()      # the transaction is discarded with the connection
            raise
        finally:
            if not digest.done():
                digest.result()   # never leave the hash reading a slot after we return
            self.pool.release(conn)
        if not isinstance(replies[-1], list) or len(replies[-1]) != 2:
            raise L2ProtocolError(f"MULTI/EXEC of a chunk answered {replies!r:.200}")
        return digest.result()

    def delete(self, rkey: bytes) -> None:
        self.client.delete(rkey, rkey + META_SUFFIX)

    def probe(self, rkeys: list[bytes]) -> list[Meta | None]:
        """The metas of `rkeys` (one MGET round trip); None where absent or not ours."""
        if not rkeys:
            return []
        mac = self.mac_key is not None
        return [unpack_meta(v, mac) for v in self.client.mget([k + META_SUFFIX for k in rkeys])]

    def read_into(self, rkey: bytes, meta: Meta, out) -> bool:
        """GET the payload straight into `out` (a writable buffer of meta.nbytes) -> True if
        it arrived whole and its checksum matches `meta` (else `out` holds garbage: a miss)."""
        conn = self.pool.get_connection()
        try:
            conn.send_command("GET", rkey)
            sock = conn._sock      # redis-py keeps no bytes of ours buffered: see module doc
            head = _read_line(sock)
            if head in (b"$-1", b"_"):   # gone since the probe (TTL, eviction, overwritten)
                return False
            if not head.startswith(b"$"):
                raise L2ProtocolError(f"GET answered {head[:80]!r}, expected a bulk string")
            n = int(head[1:])
            target = memoryview(out).cast("B")
            if n != meta.nbytes or n != len(target):
                _discard(sock, n + 2)
                return False
            _recv_exactly(sock, target)
            _discard(sock, 2)      # the CRLF after the body
        except BaseException:      # timeout or error mid-reply: the stream position is lost
            conn.disconnect()
            raise
        finally:
            self.pool.release(conn)
        if self.mac_key is not None:
            return hmac.compare_digest(record_mac(self.mac_key, rkey, target), meta.digest)
        return checksum(target) == meta.digest

    def close(self) -> None:
        try:
            self.client.close()
            self.pool.disconnect()
        except ERRORS:
            pass


def _read_line(sock) -> bytes:
    """One RESP header line (without CRLF), read a byte at a time: it is a few bytes and
    nothing after it may be consumed (the body goes straight into the slot)."""
    line = bytearray()
    while not line.endswith(b"\r\n"):
        b = sock.recv(1)
        if not b:
            raise redis.ConnectionError("Redis closed the connection mid-reply")
        line += b
        if len(line) > 64:
            raise L2ProtocolError(f"reply header too long: {bytes(line[:64])!r}")
    return bytes(line[:-2])


def _recv_exactly(sock, target: memoryview) -> None:
    got = 0
    while got < len(target):
        n = sock.recv_into(target[got:])
        if n == 0:
            raise redis.ConnectionError("Redis closed the connection mid-reply")
        got += n


def _discard(sock, n: int) -> None:
    buf = bytearray(min(n, 1 << 20))
    while n > 0:
        k = sock.recv_into(buf, min(n, len(buf)))
        if k == 0:
            raise redis.ConnectionError("Redis closed the connection mid-reply")
        n -= k
