"""Restarts of a server that made its own secret, against real server processes
(kvedit/rundir.py, kvedit/auth.py SecretSource, kvedit/client/kv_client.py).

Reproductions of an outside red-team run: a restarted server made a new secret, and the
vLLM connector never reconnected (none in 15 s; with --secret-file it took 0.2 s), and
`--l2-mac` turned all of L2 into misses after each restart, with no warning. Here the secret
an earlier server on the port left is reused (same user, mode 0600), clients carry on across
a restart, and when the secret does change (its file removed) every client kind reads it
again and reconnects by itself; the L2 records stay valid across a restart, and a server that
cannot keep them says so at start.
"""
from __future__ import annotations

import os
import time

import pytest

from kvedit.client import KVClient
from kvedit.client.handles import ServerUnavailable
from kvedit.launch.redis import INSTALL_HINT, redis_server_path
from kvedit.sdk.context import connect
from kvedit.vllm.link import ServerLink
from kvedit.vllm.settings import ConnectorSettings
from tests.fixtures_server import wait_until
from tests.kv_helpers import SMALL, chunk_for, key, matches
from tests.server.test_secure_default import plain_server, rundir  # noqa: F401 (fixture)


def _roundtrip(c: KVClient, tag: str) -> None:
    ks = [key(i, tag) for i in range(2)]
    c.store("m", ks, [chunk_for(k) for k in ks])
    with c.retrieve("m", ks) as r:
        assert [matches(k, t) for k, t in zip(ks, r.tensors)] == [True, True]


def test_the_made_secret_survives_a_restart_and_clients_carry_on(rundir):  # noqa: F811
    s = plain_server()
    clients = []
    try:
        path = rundir / f"{s.port}.secret"
        secret = path.read_bytes().strip()
        clients = [KVClient(s.url, use_shm=shm, timeout=5) for shm in (True, False)]
        for c in clients:
            c.register("m", SMALL)
            _roundtrip(c, f"before-{c.transfer_mode}")
        s.restart()
        assert path.read_bytes().strip() == secret
        assert "reused the secret an earlier server on this port left" in s.log()
        t0 = time.monotonic()
        for c in clients:   # the same clients, no reconnect of their own: it just works
            _roundtrip(c, f"after-{c.transfer_mode}")
        assert time.monotonic() - t0 < 5   # not a timeout and a retry
    finally:
        for c in clients:
            c.close()
        s.stop()


def test_clients_read_a_changed_secret_again_and_reconnect(rundir):  # noqa: F811
    """The file removed between two runs: the next server draws a new secret. A KVClient
    (shared memory and socket), a key watch and an SDK context read it again and go on."""
    s = plain_server()
    clients, ctx = [], None
    try:
        path = rundir / f"{s.port}.secret"
        old = path.read_bytes().strip()
        clients = [KVClient(s.url, use_shm=shm, timeout=3) for shm in (True, False)]
        for c in clients:
            c.register("m", SMALL)
        w = clients[0].watch_keys("m", [0])
        assert wait_until(lambda: (w.sync(), w.trusted)[1])
        ctx = connect(s.url, s.http_url, "m", timeout=10)
        s.stop()
        path.unlink()
        s = plain_server(port=s.port, http_port=s.http_port)
        assert path.read_bytes().strip() != old and "made a secret" in s.log()
        for c in clients:
            c.register("m", SMALL)   # the first call times out, reads the secret, retries
            _roundtrip(c, f"changed-{c.transfer_mode}")
            assert c.credentials == 1
        ks = [key(0, "watched")]
        clients[1].store("m", ks, [chunk_for(ks[0])])
        assert wait_until(lambda: (w.sync(), w.trusted and ks[0] in w.keys[0])[1], 30)
        assert ctx.client.lookup("m", ks) == 1   # the SDK's client re-read it too
    finally:
        if ctx is not None:
            ctx.close()
        for c in clients:
            c.close()
        s.stop()


@pytest.mark.slow   # two more server starts; the fast tier has the clients' side above
@pytest.mark.parametrize("changed", [False, True], ids=["same-secret", "new-secret"])
def test_the_connector_link_reconnects_by_itself(rundir, changed):  # noqa: F811
    """kvedit.vllm.link as the connector runs it (secret from the runtime directory): after a
    restart, with the same secret it carries on; with a new one its outage ends by itself."""
    s = plain_server()
    connected = []
    try:
        settings = ConnectorSettings.from_extra({"kvedit_url": s.url})
        link = ServerLink(s.url, 1.0, 0.2, lambda c: (c.register("m", SMALL),
                                                      connected.append(c)), "scheduler",
                          secret=settings.secret())
        try:
            assert link.client is not None
            s.stop()
            if changed:
                (rundir / f"{s.port}.secret").unlink()
            s = plain_server(port=s.port, http_port=s.http_port)
            t0 = time.monotonic()

            def serving() -> bool:
                c = link.client
                if c is None:
                    return False
                try:
                    c.lookup("m", [key(0, "probe")])
                    return True
                except (ServerUnavailable, OSError) as e:
                    link.failed(e)   # as the connector's call sites do
                    return False
            assert wait_until(serving, 20)
            took = time.monotonic() - t0
            assert took < (5 if changed else 2.5), took
            assert connected   # registered on connect (and again on a restart)
        finally:
            link.close()
    finally:
        s.stop()


@pytest.mark.slow   # a redis-server of its own, as the L2 tests
@pytest.mark.skipif(redis_server_path() is None, reason=INSTALL_HINT)
def test_l2_mac_records_stay_valid_across_a_restart(rundir, redis_srv):  # noqa: F811
    """Records signed with the made secret before a restart are found after it; a server
    that had to draw a new secret says at start why older records are misses."""
    from kvedit.client.l2_wait import wait_l2_written

    extra = ("--l2-url", redis_srv.url, "--l2-mac")
    s = plain_server(extra=extra)
    try:
        path = rundir / f"{s.port}.secret"
        secret = path.read_bytes().decode().strip()
        ks = [key(i, "l2") for i in range(3)]
        with KVClient(s.url) as c:
            c.register("m", SMALL)
            c.store("m", ks, [chunk_for(k) for k in ks])
        wait_l2_written(s.http_url, secret=secret)
        assert "L2 records signed by earlier servers" in s.log()   # the first start: new
        s.restart()   # an empty L1; the same secret
        assert "L2 records signed by earlier servers" not in s.log()
        with KVClient(s.url) as c:
            c.register("m", SMALL)
            assert c.lookup("m", ks) == 3   # promoted from L2: the MACs hold
            with c.retrieve("m", ks) as r:
                assert [matches(k, t) for k, t in zip(ks, r.tensors)] == [True] * 3
    finally:
        s.stop()


@pytest.mark.slow   # three server starts
def test_a_secret_file_with_another_mode_is_not_reused(rundir):  # noqa: F811
    s = plain_server()
    try:
        path = rundir / f"{s.port}.secret"
        old = path.read_bytes()
        s.stop()
        os.chmod(path, 0o644)   # readable by others: perhaps read already
        s = plain_server(port=s.port, http_port=s.http_port)
        assert path.read_bytes() != old
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert "has mode 644, not 600" in s.log()
    finally:
        s.stop()
