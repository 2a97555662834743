"""What `kvedit.launch.server.start_server` gives the evals, benches and experiments that use
it, against real server processes: a server private to this user, that dies with its launcher.

Reproductions of an outside red-team run: start_server() started servers `--insecure`, so any
local user could read and poison the KV of every eval and bench; a launcher that started the
server from a worker thread and died left it running (the parent-death signal follows the
thread that forked). Here the server makes its own secret (this user's clients find it), and
it stops when the launcher's end of a pipe closes, whichever thread started it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvedit import auth, rundir
from kvedit.client import KVClient
from kvedit.launch.server import start_server
from tests.kv_helpers import SMALL, chunk_for, key, matches


def test_start_server_makes_a_private_secret_by_default():
    with start_server(0.02, insecure=False) as s:
        assert s.secret_file and os.stat(s.secret_file).st_mode & 0o777 == 0o600
        secret = auth.load_secret(secret_file=s.secret_file)
        r = httpx.get(s.http_url + "/status", timeout=10)
        assert r.status_code == 401                    # was 200: open to every local user
        assert httpx.get(s.http_url + "/status", headers=auth.bearer_header(secret),
                         timeout=10).status_code == 200
        with KVClient(s.url) as c:                     # this user's client finds it
            c.register("m", SMALL)
            k = key(0, "private")
            c.store("m", [k], [chunk_for(k)])
            with c.retrieve("m", [k]) as got:
                assert matches(k, got.tensors[0])
        path = s.secret_file
    assert not os.path.exists(path) and rundir.lookup(s.url) is None   # gone with it


def test_an_http_client_of_this_user_finds_the_made_secret_by_its_proof():
    """wait_l2_written and other HTTP clients know only the HTTP URL: the secret this user's
    server made is found by the proof it gives (nothing derived from any is sent)."""
    from kvedit.client.http_proof import found
    with start_server(0.02, insecure=False) as s:
        conn, health, secret = found(s.http_url)
        try:
            assert health["status"] == "ok"
            assert secret == auth.load_secret(secret_file=s.secret_file)
            conn.request("GET", "/status", headers=auth.bearer_header(secret))
            assert conn.getresponse().status == 200
        finally:
            conn.close()
    with start_server(0.02, insecure=True) as s:   # no secret: nothing to find
        conn, _, secret = found(s.http_url)
        conn.close()
        assert secret is None


_LAUNCHER = """
import json, sys, threading, time
from kvedit.launch.server import start_server
box = {}
t = threading.Thread(target=lambda: box.update(s=start_server(0.01)))
t.start(); t.join()
print(json.dumps({"pid": box["s"].pid, "port": box["s"].port}), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.slow   # two interpreters start
def test_a_server_started_from_a_thread_dies_with_its_launcher():
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=os.environ)
    pid = port = None
    try:
        got = json.loads(launcher.stdout.readline())
        pid, port = got["pid"], got["port"]
        assert _alive(pid)
        launcher.kill()   # SIGKILL: no cleanup of its own runs
        launcher.wait()
        end = time.monotonic() + 15
        while time.monotonic() < end and _alive(pid):
            time.sleep(0.1)
        assert not _alive(pid), "the server outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        if port is not None:
            rundir.withdraw(port)   # the secret it made (its launcher never stopped it)
