"""A client proves nothing to a server that cannot prove the secret first, against squatting
processes on real sockets and real servers (kvedit/auth.py, kvedit/sdk/context.py,
kvedit/client/datalink.py, kvedit/client/l2_wait.py, kvedit/rundir.py).

Reproduction of an outside red-team run: `connect(http_url=...)` sent the bearer token (the
secret itself) on its first /health, and another user squatting the port while the server
restarted captured a persistent secret; the data link answered any nonce with an HMAC a
relaying squatter could pass on; another user could pre-create the server's runtime
directory so that default starts stayed blocked, with an error that did not say whose it was.
Here /health proves the secret to the client (no bearer is ever sent by the SDK), the data
link's server proves it before the client answers, and the directory error names its owner.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import subprocess
import sys
import threading

import pytest

from kvedit import auth
from kvedit.client.datalink import LinkClient
from kvedit.client.handles import ServerUnavailable
from kvedit.client.l2_wait import wait_l2_written
from kvedit.launch.server import start_server
from kvedit.sdk.context import connect
from kvedit.sdk.errors import ConnectError
from tests.server.test_secure_default import other_uid  # noqa: F401 (fixture)

SECRET = b"the-shared-secret-0123456789abcdef"


class Squatter:
    """A TCP listener on a free port that records everything each connection sends; `greet`
    is what it sends first (a fake nonce, a fake HTTP answer)."""

    def __init__(self, greet=b"", reply=b""):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.greet, self.reply = greet, reply
        self.got: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(1)
                data = b""
                try:
                    if self.greet:
                        conn.sendall(self.greet)
                    while chunk := conn.recv(65536):
                        data += chunk
                        if self.reply and b"\r\n\r\n" in data:
                            conn.sendall(self.reply)
                            self.reply = b""
                except OSError:
                    pass
                self.got.append(data)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)   # wakes the accept() (Linux)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)


_HEALTH = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 32\r\n"
           b"Connection: close\r\n\r\n" + b'{"status": "ok", "instance": 1}\n')


def test_the_sdk_sends_no_secret_to_a_squatting_http_server():
    sq = Squatter(reply=_HEALTH)
    try:
        with pytest.raises(ConnectError, match="cannot prove it knows the kvedit secret"):
            connect("tcp://127.0.0.1:1", f"http://127.0.0.1:{sq.port}", "m", timeout=3,
                    secret=SECRET)
    finally:
        sq.close()
    sent = b"".join(sq.got)
    assert sent.startswith(b"GET /health ")
    assert SECRET not in sent and b"authorization" not in sent.lower()


def test_wait_l2_written_sends_no_bearer_to_a_squatter():
    sq = Squatter(reply=_HEALTH)
    try:
        with pytest.raises(ValueError, match="cannot prove"):
            wait_l2_written(f"http://127.0.0.1:{sq.port}", timeout=2, secret=SECRET.decode())
    finally:
        sq.close()
    sent = b"".join(sq.got)
    assert SECRET not in sent and b"authorization" not in sent.lower()


def test_a_data_link_squatter_gets_no_mac_it_could_replay():
    """The squatter sends a nonce (one it could have got from the real server) and a made-up
    proof: the client sends its own nonce and session, then hangs up. Before, its answer was
    HMAC(secret, nonce + session): good for the real server's nonce."""
    nonce = secrets.token_bytes(auth.NONCE_BYTES)
    sq = Squatter(greet=nonce + bytes(auth.MAC_BYTES))
    try:
        link = LinkClient("127.0.0.1", sq.port, 3.0, secrets.token_bytes(16), SECRET)
        with pytest.raises(ServerUnavailable, match="did not prove"):
            link.put(1, [])
        link.close()
    finally:
        sq.close()
    sent = sq.got[0]
    assert len(sent) == auth.NONCE_BYTES + auth.SESSION_BYTES
    for i in range(len(sent) - 16 + 1):   # no HMAC of the secret over the nonce in any form
        mac = hmac.new(SECRET, nonce + sent[i:i + 16], hashlib.sha256).digest()
        assert mac not in sent


def test_the_real_server_proves_itself_over_http(tmp_path):
    path = tmp_path / "secret"
    secret = auth.generate_secret(path)
    with start_server(0.02, secret_file=path) as s:
        import httpx
        challenge = auth.http_challenge()
        r = httpx.get(s.http_url + "/health", headers={auth.CHALLENGE_HEADER: challenge},
                      timeout=5)
        proof, where = r.headers.get(auth.PROOF_HEADER), f"127.0.0.1:{s.http_port}"
        assert r.headers.get(auth.ENDPOINT_HEADER) == where
        assert auth.check_http_proof(secret, challenge, proof, where)
        assert not auth.check_http_proof(SECRET, challenge, proof, where)
        assert not auth.check_http_proof(secret, challenge, proof, f"[::1]:{s.http_port}")


def test_a_runtime_directory_of_another_user_is_refused_naming_its_owner(tmp_path,
                                                                          other_uid):  # noqa
    import pwd
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    squat = xdg / "kvedit"
    squat.mkdir(mode=0o700)
    os.chown(squat, other_uid, -1)   # made by another user before the server's first start
    env = {k: v for k, v in os.environ.items() if k not in (auth.SECRET_ENV,
                                                            auth.SECRET_FILE_ENV)}
    env["XDG_RUNTIME_DIR"] = str(xdg)
    p = subprocess.run([sys.executable, "-m", "kvedit.server.cli", "--l1-size-gb", "0.01",
                        "--port", "0", "--http-port", "0", "--shm-name", ""],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2, p.stderr
    who = pwd.getpwuid(other_uid).pw_name
    assert f"owned by {who} (uid {other_uid})" in p.stderr, p.stderr
    assert f"rm -r {squat}" in p.stderr and "--secret-file" in p.stderr
