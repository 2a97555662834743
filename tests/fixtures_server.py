"""Server fixtures and raw-protocol helpers shared by the server tests.

- `kv_server` (session): one real kvedit server process (shm, LRU, 2 GiB lazy, chunk 256).
- `seeded_server` (module): a small server with model "m" (SMALL) and SEED_KEYS stored, for
  tests that throw bad input at it and then check the seeded data is intact.
- `raw`: a bare ZMQ DEALER on `seeded_server` (ask() sends frames and decodes the reply).
- `redis_srv`: a fresh redis-server of its own per test (the L2 tests skip without one).
- `sdk_context(server, model, layout)`: an SDK context on a model registered by hand (no vLLM),
  for the tests that drive modify with a fake engine.
- data-link helpers that speak the wire format directly (link(), link_error()).
"""
from __future__ import annotations

import contextlib
import secrets
import socket
import time

import pytest
import zmq

from kvedit import auth, wire
from kvedit import protocol as P
from kvedit.client import KVClient
from kvedit.launch.redis import RedisProcess
from kvedit.launch.server import start_server
from kvedit.sdk.context import connect
from tests.kv_helpers import SMALL, chunk_for, key, matches

SEED_KEYS = [key(i, "seed") for i in range(4)]


@pytest.fixture(scope="session")
def kv_server():
    server = start_server(2.0, chunk_size=256, shm=True, eviction="LRU", lazy=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def seeded_server():
    with start_server(0.01) as s, KVClient(s.url) as c:
        c.register("m", SMALL)
        c.store("m", SEED_KEYS, [chunk_for(k) for k in SEED_KEYS])
        yield s


@pytest.fixture
def redis_srv():
    r = RedisProcess()
    try:
        yield r
    finally:
        r.stop()


@contextlib.contextmanager
def sdk_context(server, model: str, layout, timeout: float = 10):
    """`kvedit.connect` to `server` for `model`, registered first with `layout` (as the
    connector would), closed on exit."""
    with KVClient(server.url) as c:
        c.register(model, layout)
    with connect(server.url, server.http_url, model, timeout=timeout) as ctx:
        yield ctx


def assert_seed_intact(server) -> None:
    with KVClient(server.url) as c:
        with c.retrieve("m", SEED_KEYS) as r:
            assert [matches(k, t) for k, t in zip(SEED_KEYS, r.tensors)] == [True] * 4


def dealer(url: str, routing_id: bytes | None = None, timeout_ms: int = 5000) -> zmq.Socket:
    """A bare DEALER (its own zmq.Context; close with close_dealer)."""
    s = zmq.Context().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    s.connect(url)
    return s


def close_dealer(s: zmq.Socket) -> None:
    ctx = s.context
    s.close(linger=0)
    ctx.term()


@pytest.fixture
def raw(seeded_server):
    s = dealer(seeded_server.url)
    yield s
    close_dealer(s)


def ask(sock: zmq.Socket, *frames: bytes) -> tuple[bytes, object]:
    sock.send_multipart(list(frames))
    rid, msg = sock.recv_multipart()
    return rid, P.reply_decoder.decode(msg)


def call(sock: zmq.Socket, msg) -> object:
    """Send one request with a fresh request id and return the decoded reply."""
    rid = secrets.token_bytes(8)
    sock.send_multipart([rid, P.encoder.encode(msg)])
    while True:
        got_rid, reply = sock.recv_multipart()
        if got_rid == rid:
            return P.reply_decoder.decode(reply)


def session_dealer(url: str, session: bytes | None = None, thread_no: int = 0) -> zmq.Socket:
    """A DEALER with a client-style routing id: session (16 bytes) + thread number."""
    session = session or secrets.token_bytes(16)
    return dealer(url, session + thread_no.to_bytes(4, "big"))


def data_port(server) -> int:
    with KVClient(server.url) as c:
        return c.server_info().data_port


def link(server, session: bytes | None = None, secret: bytes | None = None,
         timeout: float = 10.0, handshake: bool = True, port: int | None = None
         ) -> socket.socket:
    """A raw data-link connection, handshake done (as `session`, random when None)."""
    conn = socket.create_connection((server.host, port or data_port(server)), timeout=timeout)
    if handshake:
        auth.client_handshake(conn, secret, session or secrets.token_bytes(16))
    return conn


def link_error(conn: socket.socket) -> str:
    """Read a data-link error reply -> its "code: message" text."""
    head = bytearray(wire.REPLY.size)
    wire.recv_exact(conn, head)
    magic, status, _, n = wire.REPLY.unpack(head)
    assert magic == wire.MAGIC and status == wire.FAILED, (magic, status)
    msg = bytearray(n)
    wire.recv_exact(conn, msg)
    return msg.decode()


def wait_until(pred, timeout: float = 15.0) -> bool:
    """Wait for a *server-side* deadline to pass (the thing under test is the deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def status(server) -> dict:
    """The server's counters through ZMQ Stats (no HTTP auth involved)."""
    with KVClient(server.url) as c:
        return c.stats()
