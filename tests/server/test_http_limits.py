"""The HTTP API's connection bounds against a real server (kvedit/server/http.py, http_peer.py).

Reproductions of an outside red-team run: 70 connections with unfinished request heads,
topped up every 2 s, kept /health at 503 (the 64-connection cap applied to everyone, and a
head could take 10 s); a client that half-closed after its request got no answer from the
thread-backed endpoints, while DELETE /cache still ran.
"""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from kvedit.client import KVClient
from kvedit.launch.server import start_server
from tests.kv_helpers import SMALL, chunk_for, key


@pytest.fixture(scope="module")
def server():
    with start_server(0.02) as s:
        yield s


def _half_head(port: int) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\nX-Slow: ")   # and never the rest
    return c


def _closed(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:   # reset
        return True


@pytest.mark.slow  # real-time waits: heads dripped past a deadline
def test_health_is_answered_while_unfinished_heads_are_topped_up(server):
    held = [_half_head(server.http_port) for _ in range(70)]
    codes = []
    try:
        end = time.monotonic() + 6.0
        while time.monotonic() < end:
            for _ in range(8):   # top up what the server closed
                held.append(_half_head(server.http_port))
            codes.append(httpx.get(server.http_url + "/health", timeout=5).status_code)
            time.sleep(0.5)
    finally:
        for c in held:
            c.close()
    assert len(codes) >= 10 and codes == [200] * len(codes), codes


def test_one_peer_holds_at_most_its_share_of_connections(server):
    """40 silent connections of one peer: the server keeps 16 (the per-peer bound), closing
    the oldest ones as new ones come, long before the head timeout."""
    silent = [socket.create_connection(("127.0.0.1", server.http_port)) for _ in range(40)]
    try:
        time.sleep(0.3)
        closed = [_closed(c, 0.05) for c in silent]
        assert sum(closed) >= 24, closed
        assert not any(closed[-16:]), closed   # the newest stay until their head timeout
    finally:
        for c in silent:
            c.close()


def test_the_head_timeout_is_a_flag():
    with start_server(0.02, extra_args=["--http-head-timeout", "0.5"]) as s:
        c = _half_head(s.http_port)
        t0 = time.monotonic()
        assert _closed(c, 5.0)
        assert time.monotonic() - t0 < 2.0
        c.close()
        cfg = httpx.get(s.http_url + "/config", timeout=5).json()
        assert cfg["http_head_timeout"] == 0.5 and cfg["http_max_conns_per_peer"] == 16


def _half_closed_request(port: int, method: str, path: str) -> tuple[int, dict]:
    """Send one request, shut down our sending side, read the whole answer."""
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    c.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    c.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := c.recv(65536):
        data += chunk
    c.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head, "no answer at all"
    status = int(head.split()[1])
    return status, json.loads(body) if body.strip().startswith(b"{") else {"text": body}


@pytest.mark.parametrize("path", ["/status", "/config", "/metrics", "/cache?limit=5",
                                  "/health"])
def test_a_half_closed_request_is_answered(server, path):
    status, body = _half_closed_request(server.http_port, "GET", path)
    assert status == 200, body


def test_a_half_closed_delete_is_answered_with_what_it_did(server):
    with KVClient(server.url) as c:
        c.register("m", SMALL)
        ks = [key(i, "half") for i in range(3)]
        c.store("m", ks, [chunk_for(k) for k in ks])
        status, body = _half_closed_request(server.http_port, "DELETE", "/cache")
        assert status == 200 and body["deleted"] == 3, body
        assert c.lookup("m", ks) == 0
