"""What a stranger can hold before it authenticates, and what one session can hold of a total
cap, against real server processes (kvedit/server/handshakes.py, kvedit/server/quota.py).

Reproductions of an outside red-team run: a local user without the secret held all 256
data-link connections by never finishing the handshake, and a socket-mode client then got
`busy` 32 times out of 33; one session could take a whole total cap, so every other
client's retrieve got `over_quota` for the lease TTL plus the quarantine. Here handshakes
are bounded per peer (the stranger's uid) and in all, and each session holds at most a share
of every total cap: 0 failures out of 100 legitimate operations beside each attacker.
"""
from __future__ import annotations

import json
import os
import socket
import time

import pytest

from kvedit import auth
from kvedit import protocol as P
from kvedit.client import KVClient, KVError
from kvedit.launch.server import start_server
from tests.fixtures_server import call, close_dealer, session_dealer, status
from tests.kv_helpers import SMALL, chunk_for, key, matches
from tests.server.test_secure_default import other_uid  # noqa: F401 (fixture)


def _spawn_as(uid: int, fn) -> tuple[int, int]:
    """Run fn() in a forked child as `uid` -> (pid, read end of the pipe its dict comes on)."""
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
    return pid, r


def _join(pid: int, r: int) -> dict:
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def _hold_handshakes(port: int, seconds: float, want: int = 300) -> dict:
    """Keep `want` data-link connections open in their handshake (the nonce read, nothing
    answered), opening new ones as the server closes them."""
    held: list[socket.socket] = []
    opened = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        held = [c for c in held if not _closed(c)]
        while len(held) < want and time.monotonic() < end:
            try:
                c = socket.create_connection(("127.0.0.1", port), timeout=2)
                c.setblocking(False)
                held.append(c)
                opened += 1
            except OSError:
                break
        time.sleep(0.05)
    for c in held:
        c.close()
    return {"opened": opened}


def _closed(c: socket.socket) -> bool:
    try:
        while True:
            if not c.recv(4096):   # the nonce is read and thrown away
                c.close()
                return True
    except BlockingIOError:
        return False
    except OSError:
        c.close()
        return True


@pytest.mark.slow   # a flood: 12 s of a stranger opening hundreds of connections
def test_a_stranger_holding_handshakes_fails_no_socket_client(tmp_path, other_uid):  # noqa: F811
    path = tmp_path / "secret"
    secret = auth.generate_secret(path)
    with start_server(0.05, secret_file=path) as s:
        with KVClient(s.url, secret=secret) as c:
            port = c.server_info().data_port
        pid, r = _spawn_as(other_uid, lambda: _hold_handshakes(port, 12.0))
        failures, done = [], 0
        try:
            time.sleep(1.5)   # the stranger has its connections open
            # a fresh data connection for every transfer: each one meets the stranger
            with KVClient(s.url, secret=secret, use_shm=False, data_idle_timeout=0.0) as c:
                c.register("m", SMALL)
                for i in range(50):
                    k = key(i, "beside-a-stranger")
                    for op in ("store", "retrieve"):
                        try:
                            if op == "store":
                                c.store("m", [k], [chunk_for(k)])
                            else:
                                with c.retrieve("m", [k]) as got:
                                    if len(got) != 1 or not matches(k, got.tensors[0]):
                                        failures.append(f"retrieve: {len(got)} chunk(s)")
                                        continue
                            done += 1
                        except KVError as e:
                            failures.append(f"{op}: {e.code}: {e}")
        finally:
            stranger = _join(pid, r)
        assert stranger.get("opened", 0) >= 300, stranger
        assert done == 100 and failures == [], failures[:5]
        with KVClient(s.url, secret=secret) as c:   # it was there: pushed out, never let in
            assert c.stats()["data_conns"] <= 1


def test_one_session_holds_at_most_its_share_of_a_total_cap():
    """A per-client cap set above the total: one session still stops at its share (1/8 by
    default) and the other sessions' retrieves go on."""
    from kvedit.layout import ModelLayout
    tiny = ModelLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16",
                       chunk_size=256)
    total = 1 << 20
    with start_server(0.2, extra_args=["--max-leased-keys-per-client", str(2 * total),
                                        "--max-leased-keys-total", str(total)]) as s:
        keys = [i.to_bytes(16, "little") for i in range(8192)]
        with KVClient(s.url) as c:
            c.register("m", tiny)
            for start in range(0, 8192, 1024):
                c.prepare_store("m", keys[start:start + 1024]).commit()
        greedy = session_dealer(s.url)
        try:
            body = P.Retrieve(model="m", keys=keys)   # 8,192 distinct keys a lease
            codes = [type(r).__name__ if not isinstance(r, P.Error) else r.code
                     for r in (call(greedy, body) for _ in range(40))]
            assert codes.count("Leased") == total // 8 // 8192, codes
            assert "over_quota" in codes
            held = status(s)["held_lease_keys"]
            assert held == total // 8, held
            with KVClient(s.url) as other:   # the rest of the total is there for others
                for i in range(100):
                    with other.retrieve("m", keys[i:i + 1]) as got:
                        assert len(got) == 1
            cfg = json.loads(_http(s.http_url + "/config"))
            assert cfg["client_caps"]["lease_keys"] == total // 8
        finally:
            close_dealer(greedy)


def _http(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


@pytest.mark.parametrize("flag,value", [("--max-client-total-share", "0"),
                                        ("--max-handshakes", "0")])
def test_bad_bounds_are_refused_at_start(flag, value):
    with pytest.raises(RuntimeError, match=flag.lstrip("-").replace("-", "[-_]")):
        start_server(0.02, extra_args=[flag, value])


def _conns(n: int):
    lst = socket.create_server(("127.0.0.1", 0))
    pairs = []
    for _ in range(n):
        c = socket.create_connection(lst.getsockname())
        s, _ = lst.accept()
        pairs.append((c, s))
    return lst, pairs


def _eof(s: socket.socket) -> bool:
    try:
        s.setblocking(False)
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_handshakes_are_bounded_per_peer_and_in_all_oldest_out():
    """kvedit/server/handshakes.py on real loopback connections: this test's user plays a
    stranger (the server's own user is set to another uid): past 2 of its handshakes the
    oldest is shut down; past 4 in all, too; a finished handshake frees its place."""
    from kvedit.server.handshakes import Handshakes
    gate = Handshakes(total=4, per_peer=2, own_uid=os.getuid() + 1)
    lst, pairs = _conns(4)
    try:
        servers = [s for _, s in pairs]
        gate.admit(servers[0])
        gate.admit(servers[1])
        assert len(gate) == 2 and gate.pushed_out == 0
        gate.admit(servers[2])              # a third of the same peer: the first goes
        assert len(gate) == 2 and gate.pushed_out == 1
        assert _eof(pairs[0][0]) and not _eof(pairs[1][0]) and not _eof(pairs[2][0])
        gate.done(servers[1])               # authenticated: no longer counted
        gate.admit(servers[3])
        assert len(gate) == 2 and gate.pushed_out == 1
        mine = Handshakes(total=3, per_peer=1)   # the server's own user: no per-peer bound
        for s in servers[1:]:
            mine.admit(s)
        assert len(mine) == 3 and mine.pushed_out == 0
    finally:
        for c, s in pairs:
            c.close()
            s.close()
        lst.close()
