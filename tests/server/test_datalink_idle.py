"""Socket-mode clients after idle periods (kvedit/client/datalink.py).

The server closes a data connection idle past --data-idle-timeout; a client that reused the
dead socket lost one store or load after each quiet period (`Broken pipe`, `peer closed the
data connection mid-transfer`). Against a real server with a 1 s idle timeout, and against a
scripted data-link peer for the close that races a request.
"""
from __future__ import annotations

import secrets
import socket
import threading
import time

import pytest
import torch

from kvedit import auth, wire
from kvedit.client import KVClient
from kvedit.client.datalink import LinkClient
from kvedit.client.handles import ServerUnavailable
from kvedit.launch.server import start_server
from tests.kv_helpers import SMALL, chunk_for, key, matches

IDLE = 1.0


@pytest.fixture(scope="module")
def server():
    with start_server(0.02, shm=False, extra_args=["--data-idle-timeout", str(IDLE)]) as s:
        yield s


def _round_trip(c: KVClient, tag: str) -> None:
    ks = [key(i, tag) for i in range(3)]
    assert c.store("m", ks, [chunk_for(k) for k in ks]).stored == 3
    with c.retrieve("m", ks) as r:
        assert [matches(k, t) for k, t in zip(ks, r.tensors)] == [True] * 3


@pytest.mark.slow  # real-time waits past the server's idle timeout
def test_a_socket_client_survives_idle_periods_longer_than_the_server_s_timeout(server):
    with KVClient(server.url, use_shm=False) as c:
        assert c.transfer_mode == "socket"
        c.register("m", SMALL)
        for i in range(3):
            _round_trip(c, f"idle-{i}")
            time.sleep(IDLE * 1.6)   # past the server's idle timeout: it closed the socket
        got = c.counters()
        # the client stops reusing a connection before the server would close it
        assert got["idle_reconnects"] >= 2 and got["retries"] == 0, got
        assert c.server_info().data_idle_timeout == IDLE


def test_a_connection_the_server_closed_is_replaced_before_use(server):
    """A client that keeps connections longer than the server (asked to) finds the server's
    close waiting in the socket and reconnects instead of failing."""
    with KVClient(server.url, use_shm=False, data_idle_timeout=60) as c:
        c.register("m", SMALL)
        _round_trip(c, "closed-0")
        time.sleep(IDLE * 1.6)
        _round_trip(c, "closed-1")
        got = c.counters()
        assert got["closed_reconnects"] >= 1 and got["idle_reconnects"] == 0, got


class _ScriptedLink:
    """A data-link server that answers PUTs on its connections as told: "ok" (read the
    bytes, reply OK) or "close" (read the request header, close without a word: a server
    that closed an idle connection just as the request went out)."""

    def __init__(self, script: list[str]):
        self.script, self.received = list(script), []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.script:
            try:
                conn, _ = self.listener.accept()
            except OSError:   # closed by the test
                return
            with conn:
                auth.server_handshake(conn, None)
                while self.script:
                    head = bytearray(wire.REQUEST.size)
                    try:
                        wire.recv_exact(conn, head)
                    except OSError:
                        break
                    _, _, _, nbytes = wire.REQUEST.unpack(head)
                    if self.script.pop(0) == "close":
                        break
                    body = bytearray(nbytes)
                    wire.recv_exact(conn, body)
                    self.received.append(bytes(body))
                    conn.sendall(wire.REPLY.pack(wire.MAGIC, wire.OK, 0, 0))

    def close(self) -> None:
        self.listener.close()


def test_a_transfer_is_sent_again_once_when_a_reused_connection_was_closed_unanswered():
    link_srv = _ScriptedLink(["ok", "close", "ok"])
    link = LinkClient("127.0.0.1", link_srv.port, 5.0, secrets.token_bytes(16), None, 60.0)
    try:
        a, b = torch.full((64,), 1, dtype=torch.uint8), torch.full((64,), 2, dtype=torch.uint8)
        link.put(1, [a])
        link.put(2, [b])   # the reused connection is closed unanswered: sent again, fresh
        assert link.counters["retries"] == 1 and link.counters["connects"] == 2
        assert link_srv.received == [bytes(a.numpy()), bytes(b.numpy())]
    finally:
        link.close()
        link_srv.close()


def test_a_fresh_connection_closed_unanswered_is_not_retried():
    link_srv = _ScriptedLink(["close", "ok"])
    link = LinkClient("127.0.0.1", link_srv.port, 5.0, secrets.token_bytes(16), None, 60.0)
    try:
        with pytest.raises(ServerUnavailable) as e:
            link.put(1, [torch.zeros(64, dtype=torch.uint8)])
        assert e.value.code == "data_link"
        assert link.counters["retries"] == 0
    finally:
        link.close()
        link_srv.close()
