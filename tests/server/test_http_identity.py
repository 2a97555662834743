"""Who an HTTP peer is, when it churns connections, against real sockets and a real server
(kvedit/server/http_peer.py, kvedit/server/http.py).

Reproduction of an outside red-team run: connections a client had already closed were taken
for root's (the kernel reports uid 0 for a socket no process holds: TIME_WAIT, orphaned), so
a user churning connections filled root's share, and the /health of a server run as root got
503 or a reset (5 of 20 probes, up to 1.35 s). Here only a live socket a process holds names
a user; the rest are keyed by address, and the server's own user is always admitted.
"""
from __future__ import annotations

import os
import socket
import time

import httpx
import pytest

from kvedit.launch.server import start_server
from kvedit.server.http_peer import loopback_uid, peer_key
from tests.server.test_preauth import _join, _spawn_as
from tests.server.test_secure_default import other_uid  # noqa: F401 (fixture)


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    lst = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(lst.getsockname())
    srv, _ = lst.accept()
    return lst, cli, srv


def test_a_live_client_socket_names_its_user():
    lst, cli, srv = _pair()
    try:
        assert loopback_uid(srv.getsockname(), srv.getpeername()) == os.getuid()
        assert peer_key(srv.getsockname(), srv.getpeername()) == ("uid", os.getuid())
    finally:
        for s in (cli, srv, lst):
            s.close()


def test_a_closed_client_socket_is_nobody_s_not_root_s():
    """The client closed first (its socket lingers in FIN_WAIT2, then TIME_WAIT once the
    server side closes too): no user owns it, so the peer is its address."""
    lst, cli, srv = _pair()
    try:
        here, there = srv.getsockname(), srv.getpeername()
        cli.close()
        time.sleep(0.1)
        assert loopback_uid(here, there) is None          # orphaned (FIN_WAIT2)
        assert peer_key(here, there) == ("addr", "127.0.0.1")
        srv.close()
        time.sleep(0.1)
        assert loopback_uid(here, there) is None          # TIME_WAIT
    finally:
        for s in (cli, srv, lst):
            s.close()


def _churn(port: int, seconds: float) -> dict:
    """Open a connection, send a whole request, close at once; again and again."""
    n, end = 0, time.monotonic() + seconds
    req = b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n"
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
                c.sendall(req)
            n += 1
        except OSError:
            pass
    return {"connections": n}


@pytest.mark.slow   # a flood: 10 s of a user churning connections
def test_the_server_s_own_user_is_answered_beside_a_churning_user(other_uid):  # noqa: F811
    with start_server(0.02) as s:
        pid, r = _spawn_as(other_uid, lambda: _churn(s.http_port, 10.0))
        codes = []
        try:
            time.sleep(1.0)
            for _ in range(100):   # a fresh connection per probe, as a liveness probe's
                try:
                    codes.append(httpx.get(s.http_url + "/health", timeout=5).status_code)
                except httpx.HTTPError as e:
                    codes.append(type(e).__name__)
        finally:
            churn = _join(pid, r)
        assert churn.get("connections", 0) > 100, churn
        assert codes == [200] * 100, [c for c in codes if c != 200][:5]


def _burst(port: int, n: int) -> dict:
    """Open n connections one after another, each asking /health and reading the answer's
    status line and body: -> {"ok": ..., "shed": ..., "other": [...]}."""
    ok = shed = 0
    other = []
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            try:
                while chunk := c.recv(4096):
                    data += chunk
            except ConnectionResetError:   # shed before the request came: the request
                pass                       # met a closed socket (the 503 came first)
        if data.startswith(b"HTTP/1.1 200"):
            ok += 1
        elif data.startswith(b"HTTP/1.1 503") and b"too many new HTTP connections" in data:
            shed += 1
        else:
            other.append(data[:80].decode("latin-1"))
    return {"ok": ok, "shed": shed, "other": other}


def test_a_peer_over_its_rate_of_new_connections_is_shed_but_never_the_own_user(
        other_uid):  # noqa: F811
    """--http-new-conns-per-peer 20: another user's 80 back-to-back connections get 20
    answers (the bucket's second's worth, plus what refills meanwhile) and 503s naming the
    rate; the server's own user, as fast, is answered every time."""
    with start_server(0.02, extra_args=["--http-new-conns-per-peer", "20"]) as s:
        pid, r = _spawn_as(other_uid, lambda: _burst(s.http_port, 80))
        theirs = _join(pid, r)
        mine = _burst(s.http_port, 80)
        cfg = httpx.get(s.http_url + "/config", timeout=5).json()
    assert theirs.get("other") == [] and theirs["shed"] > 0, theirs
    assert 20 <= theirs["ok"] < 80, theirs
    assert mine == {"ok": 80, "shed": 0, "other": []}, mine
    assert cfg["http_new_conns_per_peer"] == 20.0
