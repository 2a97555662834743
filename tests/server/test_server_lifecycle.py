"""Start-up, shutdown and restart: segment handling, refusal messages, client re-attach."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvedit.client import KVClient, KVError
from kvedit.launch.server import free_port, start_server
from tests.kv_helpers import SMALL, chunk_for, key, matches


def _run_server(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvedit.server.cli", "--port", str(free_port()),
                           "--http-port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_and_unlinks_segment(sig):
    s = start_server(0.01)
    path = f"/dev/shm/{s.shm_name}"
    try:
        assert os.path.exists(path)
        with KVClient(s.url) as c:  # an attached client must not keep the segment alive
            assert c.transfer_mode == "shm"
            s.proc.send_signal(sig)
            assert s.proc.wait(10) == 0
        assert not os.path.exists(path)
        assert "shutting down" in s.log() and "unlinked" in s.log()
    finally:
        s.stop()


def test_client_exit_does_not_unlink_segment(kv_server):
    code = (f"from kvedit.client import KVClient; c = KVClient({kv_server.url!r}); "
            f"assert c.transfer_mode == 'shm'; c.close()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert os.path.exists(f"/dev/shm/{kv_server.shm_name}")


def test_restart_with_stale_segment():
    s = start_server(0.01)
    try:
        with KVClient(s.url) as c:
            c.register("m", SMALL)
            c.store("m", [key(0)], [chunk_for(key(0))])
        s.kill()  # SIGKILL: the segment stays behind
        assert os.path.exists(f"/dev/shm/{s.shm_name}")
        s.restart()
        assert "removing stale shared-memory segment" in s.log()
        with KVClient(s.url) as c:  # a fresh, working, empty server
            assert c.transfer_mode == "shm"
            c.register("m", SMALL)
            assert c.lookup("m", [key(0)]) == 0
            c.store("m", [key(0)], [chunk_for(key(0))])
            with c.retrieve("m", [key(0)]) as r:
                assert matches(key(0), r.tensors[0])
    finally:
        s.stop()


def test_segment_in_use_is_refused(kv_server):
    p = _run_server("--l1-size-gb", "0.01", "--shm-name", kv_server.shm_name)
    assert p.returncode == 1
    assert "in use by a running kvedit server" in p.stderr
    with KVClient(kv_server.url) as c:  # the running server is untouched
        assert c.transfer_mode == "shm"


def test_shm_too_small_is_refused_not_downgraded():
    free_gib = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize / 2**30
    name = f"kvedit-toolarge-{os.getpid()}"
    p = _run_server("--l1-size-gb", str(int(free_gib) + 64), "--shm-name", name)
    assert p.returncode == 1
    assert "/dev/shm has only" in p.stderr and "--shm-name ''" in p.stderr
    assert not os.path.exists(f"/dev/shm/{name}")


def test_bad_flags_are_named():
    p = _run_server("--l1-size-gb", "0")
    assert p.returncode == 2 and "--l1-size-gb must be > 0" in p.stderr
    for flag in ("--eviction", "--eviction-policy"):   # the old name is an alias
        p = _run_server("--l1-size-gb", "1", flag, "MRU")
        assert p.returncode == 2 and "eviction policy 'MRU' is not one of " \
            "['lru', 'fifo', 'arc', 'none']" in p.stderr


def test_socket_only_server_and_prefaulted_pool():
    with start_server(0.01, shm=False, lazy=False) as s:
        assert "socket only" in s.log() and "pre-faulted" in s.log()
        with KVClient(s.url) as c:
            assert c.transfer_mode == "socket"
            c.register("m", SMALL)
            c.store("m", [key(1)], [chunk_for(key(1))])
            with c.retrieve("m", [key(1)]) as r:
                assert matches(key(1), r.tensors[0])
        with pytest.raises(KVError) as e:
            KVClient(s.url, use_shm=True)
        assert e.value.code == "shm_unavailable" and "no shared memory" in str(e.value)


@pytest.mark.parametrize("use_shm", [True, False])
def test_client_survives_server_restart(use_shm):
    """After a restart the client re-attaches to the new segment and re-registers its models."""
    with start_server(0.01) as s, KVClient(s.url, use_shm=use_shm, timeout=10) as c:
        c.register("m", SMALL)
        c.store("m", [key(0)], [chunk_for(key(0))])
        s.restart()
        assert c.lookup("m", [key(0)]) == 0  # re-registered on the fly
        c.store("m", [key(1)], [chunk_for(key(1))])
        with c.retrieve("m", [key(1)]) as r:
            assert matches(key(1), r.tensors[0])
        with KVClient(s.url) as other:  # the data landed in the new server's pool
            with other.retrieve("m", [key(1)]) as r:
                assert matches(key(1), r.tensors[0])
        s.restart()
        with KVClient(s.url) as other:
            other.register("m", SMALL)
            other.store("m", [key(2)], [chunk_for(key(2))])
        with c.retrieve("m", [key(2)]) as r:  # a retrieve is the first call after the restart
            assert matches(key(2), r.tensors[0])


def test_a_server_never_runs_open_unless_told():
    """Without a secret a server makes one (kvedit.rundir; tests/server/test_secure_default.py
    runs it), and a config that would still run open beyond loopback is refused: --insecure is
    the only way to run without one."""
    from kvedit.server.config import ServerConfig
    cfg = ServerConfig(l1_size_gb=0.01, host="0.0.0.0")
    with pytest.raises(ValueError, match="reachable from other machines but no secret is set"):
        cfg.validate()
    ServerConfig(l1_size_gb=0.01, host="0.0.0.0", insecure=True).validate()
    ServerConfig(l1_size_gb=0.01, host="0.0.0.0", authenticated=True).validate()


def test_host_help_names_every_listener():
    p = subprocess.run([sys.executable, "-m", "kvedit.server.cli", "--help"],
                       capture_output=True, text=True, timeout=30)
    help_text = " ".join(p.stdout.split())
    assert "the ZMQ control socket (--port), the data link (--data-port) and the HTTP API " \
           "(--http-port)" in help_text


def test_gen_secret_data_port_and_curve(tmp_path):
    path = tmp_path / "kvedit.secret"
    data_port = free_port()
    s = start_server(0.01, extra_args=["--gen-secret", str(path), "--data-port", str(data_port)])
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert f"wrote a new secret to {path}" in s.log() and "CurveZMQ" in s.log()
        secret = path.read_bytes().strip()
        with KVClient(s.url, secret=secret) as c:
            assert c.server_info().data_port == data_port
            c.register("m", SMALL)
            k = key(0, "gen")
            c.store("m", [k], [chunk_for(k)])
            with c.retrieve("m", [k]) as r:
                assert matches(k, r.tensors[0])
    finally:
        assert s.stop() == 0   # the ZAP authenticator stops with the server
    p = _run_server("--l1-size-gb", "0.01", "--gen-secret", str(path))  # never overwritten
    assert p.returncode == 2 and "exists" in p.stderr
