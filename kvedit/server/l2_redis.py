"""The Redis side of the second tier: key names, the checksummed record, and the three
operations the L2 threads need (put a chunk, probe which keys are there, read one into a slot),
on one Redis or a Redis/Valkey Cluster alike (l2_nodes.py says which node serves a key).

A chunk is two Redis keys written in one MULTI/EXEC: the payload (the chunk's bytes, sent
straight from its L1 slot: redis-py passes a large memoryview to sendall without copying) and
a 24-byte meta record (format tag, byte count, XXH3-64 of the payload). A read is byte-exact
or a miss: a payload whose length or checksum differs from its meta, a payload without a meta
or the other way round (Redis evicted one of them), or a meta of another format all count as
misses. XXH3 and not blake2b or CRC-32: both hash at about the rate a SET moves bytes, so
either would cost the write path a large share of its speed; XXH3 runs at memory speed
(docs/l2.md has the measured rates). It guards against
torn, truncated and swapped values, not against someone who can write to the Redis (they
could recompute any unkeyed hash too).

With --l2-mac the meta record carries an HMAC-SHA256 (key derived from the shared secret)
of the Redis key, the byte count and the payload instead, so a record written by whoever can
reach the Redis but lacks the secret (a Redis without a password: any local user) is a miss,
never a promoted chunk. That costs a keyed hash of every byte, on the L2 threads (not the
control loop), hence opt-in. A server with the MAC on reads only MAC'd records and one
without it only plain ones.

Payload reads bypass redis-py's reply parser (slow without hiredis: it copies the bulk
string several times): the GET is sent on the connection and the bulk body is received
with recv_into straight into the L1 slot. Only the header line is parsed here.

In a cluster the payload and its meta must share a hash slot (MULTI/EXEC and MGET are refused
across slots): the chunk key's hex is the key's hash tag, `{...}`, so both land on one master
and chunks spread over all of them. A MOVED answer (the slot has another master: a failover,
a resharding) patches the slot map and the command goes there; an ASK (the slot is being
migrated) sends it once to the importing node after ASKING. At most MAX_REDIRECTS of them.
While a slot migrates, a command on two of its keys that are not both on one side is answered
TRYAGAIN: a chunk's MULTI/EXEC is tried again for up to about TRYAGAIN_FOR seconds (a slot
moves in milliseconds per key) and then refused (the write is dropped and counted); a probe
of such keys is a miss.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import redis
import xxhash
from redis._parsers.base import BaseParser
from redis.exceptions import AskError, ExecAbortError, TryAgainError

from kvedit.layout import ModelLayout
from kvedit.server.l2_nodes import ERRORS, UNAVAILABLE, NodeError, Route, open_nodes
from kvedit.server.l2_url import parse

META = struct.Struct("<8sQQ")        # format tag, payload bytes, xxh3_64
META_TAG = b"kvedit.1"
MAC_META = struct.Struct("<8sQ32s")  # format tag, payload bytes, HMAC-SHA256
MAC_TAG = b"kvedit.h"
META_SUFFIX = b":m"
MAX_REDIRECTS = 3
TRYAGAIN_FOR, TRYAGAIN_WAIT = 1.0, 0.05   # seconds a write waits out a slot migration
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
    """`prefix:model:tag:rank:{hex}`; the braces make the chunk key the hash tag, so the
    meta (`...:{hex}:m`) shares the payload's slot. Braces in a model name are escaped (the
    first `{` of a key opens its tag), and so is `%`, keeping names apart."""
    m = model.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return f"{prefix}:{m}:{tag}:{tp_rank}:{{{key.hex()}}}".encode()


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
    """Chunk records in one Redis or a cluster. One per thread: each operation checks a
    connection of its own out of the node's pool (redis-py connections are not to be shared
    across threads mid-command); the routing (`nodes`) may be shared by the tier's threads."""

    def __init__(self, url: str, timeout: float, ttl: float = 0.0,
                 mac_key: bytes | None = None, nodes=None):
        self.url = url
        self.mac_key = mac_key   # --l2-mac: records carry an HMAC of the secret
        self.ttl = int(ttl) if ttl > 0 else None   # EX takes whole seconds
        self._own_nodes = nodes is None
        self.nodes = open_nodes(parse(url), timeout) if nodes is None else nodes

    def ping(self, failed: str | None = None) -> None:
        """Raises NodeError while a node serving slots does not answer."""
        self.nodes.check(failed)

    def put(self, rkey: bytes, view) -> int | bytes:
        """Write one chunk (payload from `view`, a buffer over its slot) and its meta in one
        MULTI/EXEC -> its checksum. The checksum is computed on another thread while the payload is
        being sent (both release the GIL), so it costs little beyond the SET itself; the
        meta that carries it goes last, before EXEC."""
        mv = memoryview(view).cast("B")
        digest = (_HASHER.submit(record_mac, self.mac_key, rkey, mv) if self.mac_key
                  else _HASHER.submit(checksum, mv))
        try:
            return self._put(rkey, mv, digest)
        finally:
            if not digest.done():
                digest.result()   # never leave the hash reading a slot after we return

    def _put(self, rkey: bytes, mv: memoryview, digest) -> int | bytes:
        route, redirects = self.nodes.route(rkey), 0
        give_up = time.monotonic() + TRYAGAIN_FOR
        while True:
            answer = self._put_on(route, rkey, mv, digest)
            if answer is None:
                return digest.result()
            if isinstance(answer, TryAgainError):    # the slot is migrating: wait it out
                if time.monotonic() > give_up:
                    raise answer                     # refused: the caller drops the write
                time.sleep(TRYAGAIN_WAIT)
                route, redirects = self.nodes.route(rkey), 0
                continue
            redirects += 1
            if redirects > MAX_REDIRECTS:
                raise NodeError(route.node, answer)
            route = self.nodes.redirected(answer)

    def _put_on(self, route: Route, rkey: bytes, mv: memoryview,
                digest) -> AskError | TryAgainError | None:
        ex = ("EX", self.ttl) if self.ttl else ()
        conn = _connection(route)
        try:
            if route.asking:
                conn.send_command("ASKING")
            conn.send_command("MULTI")
            conn.send_command("SET", rkey, mv, *ex)
            meta = (MAC_META.pack(MAC_TAG, len(mv), digest.result()) if self.mac_key
                    else pack_meta(len(mv), digest.result()))
            conn.send_command("SET", rkey + META_SUFFIX, meta, *ex)
            conn.send_command("EXEC")
            replies = [_reply(conn) for _ in range(4 + route.asking)]
        except ERRORS as e:
            conn.disconnect()      # the transaction is discarded with the connection
            raise NodeError(route.node, e) from e
        except BaseException:
            conn.disconnect()
            raise
        finally:
            route.pool.release(conn)
        _raise_unavailable(route, replies)
        for r in replies:
            if isinstance(r, AskError | TryAgainError):   # EXEC was aborted or refused
                return r
        for r in replies:
            if isinstance(r, redis.ResponseError) and not isinstance(r, ExecAbortError):
                raise r                   # refused (OOM, ACL): the caller drops the write
        if not isinstance(replies[-1], list) or len(replies[-1]) != 2:
            raise L2ProtocolError(f"MULTI/EXEC of a chunk answered {replies!r:.200}")
        return None

    def delete(self, rkey: bytes) -> None:
        route = self.nodes.route(rkey)
        for _ in range(MAX_REDIRECTS):
            conn = _connection(route)
            try:
                if route.asking:
                    conn.send_command("ASKING")
                conn.send_command("DEL", rkey, rkey + META_SUFFIX)
                r = [_reply(conn) for _ in range(1 + route.asking)][-1]
            except ERRORS as e:
                conn.disconnect()
                raise NodeError(route.node, e) from e
            finally:
                route.pool.release(conn)
            _raise_unavailable(route, [r])
            if not isinstance(r, AskError):
                if isinstance(r, redis.ResponseError):
                    raise r
                return
            route = self.nodes.redirected(r)

    def probe(self, rkeys: list[bytes]) -> list[Meta | None]:
        """The metas of `rkeys` (one MGET per slot, pipelined per node: one round trip to
        the nodes together); None where absent, not ours, or still redirected."""
        out: list[Meta | None] = [None] * len(rkeys)
        if not rkeys:
            return out
        mac = self.mac_key is not None
        pending = self.nodes.groups(rkeys)
        for _ in range(MAX_REDIRECTS):
            redirects = []
            for route, groups, replies in self._mget_all(rkeys, pending):
                for g, r in zip(groups, replies):
                    if isinstance(r, AskError):
                        redirects.append((self.nodes.redirected(r), [g]))
                    elif isinstance(r, TryAgainError):
                        continue                  # keys split by a migration: misses
                    elif isinstance(r, redis.ResponseError):
                        raise r
                    else:
                        for i, v in zip(g, r):
                            out[i] = unpack_meta(v, mac)
            if not redirects:
                break
            pending = redirects
        return out

    def _mget_all(self, rkeys, pending):
        """Send every node its MGETs, then read the replies: (route, groups, replies)."""
        sent, out = [], []
        try:
            for route, groups in pending:
                conn = _connection(route)
                sent.append((route, groups, conn))
                try:
                    for g in groups:
                        if route.asking:
                            conn.send_command("ASKING")
                        conn.send_command("MGET", *[rkeys[i] + META_SUFFIX for i in g])
                except ERRORS as e:
                    conn.disconnect()
                    raise NodeError(route.node, e) from e
            for route, groups, conn in sent:
                try:
                    replies = [_reply(conn) for _ in range(len(groups) * (1 + route.asking))]
                except ERRORS as e:
                    conn.disconnect()
                    raise NodeError(route.node, e) from e
                if route.asking:
                    replies = replies[1::2]
                _raise_unavailable(route, replies)
                out.append((route, groups, replies))
        except BaseException:
            for _, _, conn in sent:   # the others' replies may be unread: start afresh
                conn.disconnect()
            raise
        finally:
            for route, _, conn in sent:
                route.pool.release(conn)
        return out

    def read_into(self, rkey: bytes, meta: Meta, out) -> bool:
        """GET the payload straight into `out` (a writable buffer of meta.nbytes) -> True if
        it arrived whole and its checksum matches `meta` (else `out` holds garbage: a miss)."""
        route = self.nodes.route(rkey)
        for _ in range(MAX_REDIRECTS):
            got = self._read_on(route, rkey, meta, out)
            if not isinstance(got, AskError):
                return got
            route = self.nodes.redirected(got)
        return False

    def _read_on(self, route: Route, rkey: bytes, meta: Meta, out) -> bool | AskError:
        conn = _connection(route)
        try:
            if route.asking:
                conn.send_command("ASKING")
            conn.send_command("GET", rkey)
            sock = conn._sock      # redis-py keeps no bytes of ours buffered: see module doc
            if route.asking:
                _read_line(sock)   # +OK (an error here shows again on the GET)
            head = _read_line(sock)
            if head.startswith(b"-"):   # an error reply: one line, the stream stays in step
                err = BaseParser.parse_error(head[1:].decode(errors="replace"))
                _raise_unavailable(route, [err])
                if isinstance(err, AskError):
                    return err
                raise err
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
        except ERRORS as e:        # timeout or error mid-reply: the stream position is lost
            conn.disconnect()
            raise NodeError(route.node, e) from e
        except BaseException:
            conn.disconnect()
            raise
        finally:
            route.pool.release(conn)
        if self.mac_key is not None:
            return hmac.compare_digest(record_mac(self.mac_key, rkey, target), meta.digest)
        return checksum(target) == meta.digest

    def close(self) -> None:
        if self._own_nodes:
            try:
                self.nodes.close()
            except ERRORS:
                pass


def _connection(route: Route):
    """A connection of the route's pool (connected: a node down fails here, named)."""
    try:
        return route.pool.get_connection()
    except ERRORS as e:
        raise NodeError(route.node, e) from e


def _reply(conn):
    """One reply; an error reply is returned (not raised), so the rest are still read."""
    try:
        return conn.read_response()
    except redis.ResponseError as e:
        return e


def _raise_unavailable(route: Route, replies: list) -> None:
    """CLUSTERDOWN, TRYAGAIN, LOADING: the node cannot serve now; like a node that is down."""
    for r in replies:
        if isinstance(r, UNAVAILABLE):
            raise NodeError(route.node, r)


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
