"""Secure by default (kvedit/rundir.py): a server started without a secret makes one and
hands it to clients of the same user only.

Before, a server without --secret-file ran open: any local user could read, poison and wipe
every tenant's KV over loopback ZMQ and HTTP. Here: the server writes its secret 0600 in this
user's runtime directory, a client with no flags finds it, and a process of another uid
(a throwaway user made with useradd, where the box allows) is refused at every door.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import stat
import subprocess

import httpx
import pytest

from kvedit import auth, wire
from kvedit import protocol as P
from kvedit.client import KVClient
from kvedit.client.handles import ServerUnavailable
from kvedit.launch.server import ServerProcess, free_port, start_server
from tests.fixtures_server import close_dealer, dealer
from tests.kv_helpers import SMALL, chunk_for, key, matches


def plain_server(port: int | None = None, http_port: int | None = None,
                 extra: tuple[str, ...] = ()) -> ServerProcess:
    """`kvedit server` with no flag about secrets: only its ports, pool and segment name
    (the test harness's start_server runs servers --insecure)."""
    port, http_port = port or free_port(), http_port or free_port()
    shm = f"kvedit-{os.getpid()}-{port}"
    env = {k: v for k, v in os.environ.items() if k not in (auth.SECRET_ENV,
                                                            auth.SECRET_FILE_ENV)}
    return ServerProcess(["--l1-size-gb", "0.02", "--port", str(port), "--http-port",
                          str(http_port), "--shm-name", shm, *extra], "127.0.0.1", port,
                         http_port, shm, env=env)


@pytest.fixture
def rundir(tmp_path, monkeypatch):
    """A private runtime directory for this test's server and clients."""
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(d))
    for name in (auth.SECRET_ENV, auth.SECRET_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    return d / "kvedit"


def test_a_server_without_flags_makes_a_secret_its_user_s_clients_find(rundir):
    s = plain_server()
    try:
        path = rundir / f"{s.port}.secret"
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert stat.S_IMODE(os.stat(rundir).st_mode) == 0o700
        assert str(path) in s.log()
        secret = path.read_bytes().strip()
        assert len(secret) == 64
        for shm in (True, False):   # the data link's handshake is checked too
            with KVClient(s.url, use_shm=shm) as c:   # no secret, no flags
                c.register("m", SMALL)
                ks = [key(i, f"same-user-{shm}") for i in range(2)]
                c.store("m", ks, [chunk_for(k) for k in ks])
                with c.retrieve("m", ks) as r:
                    assert [matches(k, t) for k, t in zip(ks, r.tensors)] == [True, True]
        plain = dealer(s.url, timeout_ms=1500)   # no CURVE: the server never answers
        try:
            plain.send_multipart([b"1", P.encoder.encode(P.Hello(protocol=P.PROTOCOL))])
            with pytest.raises(Exception):
                plain.recv_multipart()
        finally:
            close_dealer(plain)
        assert httpx.get(s.http_url + "/status", timeout=5).status_code == 401
        ok = httpx.get(s.http_url + "/status", timeout=5, headers=auth.bearer_header(secret))
        assert ok.status_code == 200
        assert httpx.get(s.http_url + "/health", timeout=5).status_code == 200
    finally:
        assert s.stop() == 0
    # kept at a clean stop: the next server on this port reuses it (tests/server/
    # test_restarts.py), as long as it is this user's, mode 0600
    assert path.read_bytes().strip() == secret and stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_insecure_runs_open_and_a_stale_file_is_withdrawn(rundir):
    rundir.mkdir(mode=0o700)
    s = start_server(0.02)   # the test harness's default: --insecure
    try:
        stale = rundir / f"{s.port}.secret"
        assert not stale.exists()
        with KVClient(s.url) as c:
            c.register("m", SMALL)
        assert "--insecure: no secret" in s.log()
        assert httpx.get(s.http_url + "/status", timeout=5).status_code == 200
    finally:
        s.stop()
    stale.write_bytes(b"0" * 64 + b"\n")   # left by an earlier server on this port
    os.chmod(stale, 0o600)
    s = start_server(0.02, port=s.port, http_port=s.http_port)
    try:
        assert not stale.exists()   # else a client of this user would use a wrong secret
        with KVClient(s.url, timeout=5) as c:
            c.register("m", SMALL)
    finally:
        s.stop()


def test_a_runtime_directory_another_user_could_enter_is_refused(tmp_path, monkeypatch):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    monkeypatch.setattr("tempfile.tempdir", str(loose))   # no XDG: <tmp>/kvedit-<uid>
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    target = loose / f"kvedit-{os.getuid()}"
    target.mkdir(mode=0o777)
    os.chmod(target, 0o777)
    from kvedit import rundir
    with pytest.raises(rundir.RundirError, match="mode 0700"):
        rundir.publish(6555, b"x" * 64)
    assert rundir.lookup("tcp://127.0.0.1:6555") is None
    assert rundir.lookup("tcp://10.1.2.3:6555") is None   # never for another host


# ---- another uid ---------------------------------------------------------------------------
@pytest.fixture
def other_uid():
    """A throwaway system user (removed after), or a skip saying why there is none."""
    if os.getuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to make a second user")
    name = "kvt" + secrets.token_hex(4)
    made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                           "/usr/sbin/nologin", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"useradd refused here: {made.stderr.strip()}")
    try:
        import pwd
        yield pwd.getpwnam(name).pw_uid
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def _as_uid(uid: int, fn) -> dict:
    """Run fn() in a forked child as `uid` (everything it needs is imported already: the
    other user cannot read this user's files) -> the dict it returns."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = fn()
        except BaseException as e:   # noqa: BLE001 - reported to the parent
            out = {"child_error": repr(e)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def _data_link_answer(data_port: int) -> str:
    """Handshake without the secret, then GET a lease that does not exist -> the error code
    of the first reply (an open server gets as far as `unknown_lease`)."""
    with socket.create_connection(("127.0.0.1", data_port), timeout=5) as conn:
        auth.client_handshake(conn, None, secrets.token_bytes(16))
        try:
            conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.GET, 12345, 0))
        except OSError:   # refused and closed already: its reply is waiting
            pass
        head = bytearray(wire.REPLY.size)
        wire.recv_exact(conn, head)
        msg = bytearray(wire.REPLY.unpack(head)[3])
        wire.recv_exact(conn, msg)
    return msg.decode().split(":")[0]


def test_another_user_is_refused_at_every_door(rundir, other_uid):
    s = plain_server()
    try:
        with KVClient(s.url) as c:   # this user: fine
            c.register("m", SMALL)
            x = key(0, "tenant")
            c.store("m", [x], [chunk_for(x)])
            data_port = c.server_info().data_port
        port = s.port
        secret_path = rundir / f"{s.port}.secret"

        def attempt() -> dict:
            out = {"uid": os.getuid()}
            try:
                with KVClient(f"tcp://127.0.0.1:{port}", timeout=1.5) as c:
                    c.lookup("m", [x])
                out["zmq"] = "answered"
            except ServerUnavailable as e:
                out["zmq"] = e.code
            try:
                secret_path.read_bytes()
                out["secret_file"] = "read"
            except PermissionError:
                out["secret_file"] = "denied"
            out["http_status"] = httpx.get(s.http_url + "/status", timeout=5).status_code
            out["http_delete"] = httpx.delete(s.http_url + "/cache", timeout=5).status_code
            out["data_link"] = _data_link_answer(data_port)
            try:
                os.open(f"/dev/shm/{s.shm_name}", os.O_RDWR)
                out["shm"] = "opened"
            except PermissionError:
                out["shm"] = "denied"
            return out

        got = _as_uid(other_uid, attempt)
        assert got == {"uid": other_uid, "zmq": "timeout", "secret_file": "denied",
                       "http_status": 401, "http_delete": 401, "data_link": "unauthorized",
                       "shm": "denied"}, got
        with KVClient(s.url) as c:   # nothing of this user's was touched
            assert c.lookup("m", [x]) == 1
    finally:
        s.stop()


def test_a_client_finds_the_secret_of_a_server_started_in_another_environment(
        tmp_path, monkeypatch):
    """The server had no $XDG_RUNTIME_DIR (cron), the client has one (a login shell) holding
    a file an earlier server left for the same port: the client takes the live server's."""
    import time

    from kvedit import rundir
    xdg = tmp_path / "xdg"
    (xdg / "kvedit").mkdir(parents=True, mode=0o700)
    os.chmod(xdg, 0o700)
    stale = xdg / "kvedit" / "6555.secret"
    stale.write_bytes(b"s" * 64 + b"\n")
    os.utime(stale, (time.time() - 60, time.time() - 60))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))   # <tmp>/kvedit-<uid>
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    path = rundir.publish(6555, b"x" * 64)
    assert path.parent == tmp_path / f"kvedit-{os.getuid()}"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert rundir.lookup("tcp://127.0.0.1:6555") == (b"x" * 64, path)
    assert rundir.lookup("tcp://localhost:6555") == (b"x" * 64, path)
    rundir.withdraw(6555, b"x" * 64)
    assert rundir.lookup("tcp://127.0.0.1:6555") == (b"s" * 64, stale)   # only that one left
