"""A squatter that relays /health to a real server with the same secret gets nothing it could
replay, against two real server processes (kvedit/auth.py, kvedit/client/http_proof.py,
kvedit/client/l2_wait.py, kvedit/sdk/context.py).

Reproduction of an outside red-team run: `/health` proved the secret with an HMAC of the
challenge alone, so a process on a stopped server's port (or on [::1] where the real server
listens on 127.0.0.1) passed the challenge to another server sharing the secret (servers
sharing a Redis share it), passed its proof back, and `wait_l2_written` then sent it
`Authorization: Bearer <secret>`: the whole secret. Here the proof names the endpoint the
server answers on, the client checks it against the endpoint it reached, and the bearer is
a token derived for HTTP only.
"""
from __future__ import annotations

import socket
import threading

import pytest

from kvedit import auth
from kvedit.client.l2_wait import wait_l2_written
from kvedit.launch.server import free_port, start_server
from kvedit.sdk.context import connect
from kvedit.sdk.errors import ConnectError


class Relay:
    """A TCP listener on (host, port) that pipes every connection to `target` both ways and
    records what clients send (a squatter with no secret of its own)."""

    def __init__(self, host: str, port: int, target: tuple[str, int]):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family)
        self.target, self.sent = target, bytearray()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=10)
            threading.Thread(target=self._pipe, args=(client, upstream, True),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False),
                             daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)


def _assert_nothing_replayable(sent: bytes, secret: bytes) -> None:
    assert sent.startswith(b"GET /health "), sent[:80]
    assert secret not in sent and b"authorization" not in sent.lower(), sent
    assert sent.count(b"GET ") == 1, sent   # nothing after the challenge


@pytest.fixture
def two_servers(tmp_path):
    """A real server on its HTTP port, and the port of a second one, stopped, whose secret
    they shared (docs/l2.md: servers sharing a Redis share the secret)."""
    path = tmp_path / "secret"
    secret = auth.generate_secret(path)
    gone_port = free_port()
    start_server(0.02, secret_file=path, http_port=gone_port).stop()
    with start_server(0.02, secret_file=path) as live:
        yield secret, gone_port, live


def test_wait_l2_written_sends_no_token_through_a_relay(two_servers):
    secret, gone_port, live = two_servers
    relay = Relay("127.0.0.1", gone_port, ("127.0.0.1", live.http_port))
    try:
        with pytest.raises(ValueError, match="cannot prove"):
            wait_l2_written(f"http://127.0.0.1:{gone_port}", timeout=2, secret=secret.decode())
    finally:
        relay.close()
    _assert_nothing_replayable(bytes(relay.sent), secret)


def test_a_relay_on_ipv6_loopback_to_the_ipv4_server_is_refused(two_servers):
    """Where `localhost` resolves to ::1 first, a squatter on [::1]:PORT relays to the one
    real server on 127.0.0.1:PORT: the proof names 127.0.0.1, the client reached ::1."""
    secret, _, live = two_servers
    try:
        relay = Relay("::1", live.http_port, ("127.0.0.1", live.http_port))
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    try:
        with pytest.raises(ValueError, match="cannot prove"):
            wait_l2_written(f"http://[::1]:{live.http_port}", timeout=2,
                            secret=secret.decode())
        with pytest.raises(ConnectError, match="cannot prove"):
            connect(live.url, f"http://[::1]:{live.http_port}", "m", timeout=3, secret=secret)
    finally:
        relay.close()
    _assert_nothing_replayable(bytes(relay.sent[:relay.sent.find(b"GET ", 1)]), secret)
    assert secret not in relay.sent and b"authorization" not in relay.sent.lower()


def test_the_real_server_is_proven_directly(two_servers):
    """The same client, straight to the server: proven, and its token (not the secret)
    opens /status."""
    secret, _, live = two_servers
    with pytest.raises(ValueError, match="no second tier"):   # got as far as /status
        wait_l2_written(live.http_url, timeout=2, secret=secret.decode())
    import httpx
    r = httpx.get(live.http_url + "/status", timeout=5,
                  headers={"Authorization": f"Bearer {secret.decode()}"})
    assert r.status_code == 401 and "secret itself" in r.json()["error"], r.text
    assert "HTTP auth 2" in r.json()["error"]
    r = httpx.get(live.http_url + "/status", timeout=5, headers=auth.bearer_header(secret))
    assert r.status_code == 200


def test_http_token_prints_the_derived_token(tmp_path):
    import subprocess
    import sys
    path = tmp_path / "secret"
    secret = auth.generate_secret(path)
    out = subprocess.run([sys.executable, "-m", "kvedit.cli", "http-token", "--secret-file",
                          str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == auth.http_token(secret) and secret.decode() not in out.stdout
