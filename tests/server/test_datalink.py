"""Issue 9 items 1 and 7: the data link cannot be used to pin slots or threads.

Each test is a reproduction from the issue against a real server process with short
deadlines (flags), speaking the data-link wire format directly where a client would not.
"""
from __future__ import annotations

import secrets
import socket

import pytest

from kvedit import auth, wire
from kvedit import protocol as P
from kvedit.client import KVClient
from kvedit.launch.server import start_server
from tests.fixtures_server import (call, close_dealer, data_port, link, link_error,
                                   session_dealer, status, wait_until)
from tests.kv_helpers import SMALL, chunk_for, key, matches

CHUNK = SMALL.chunk_bytes           # 256 KiB
POOL_CHUNKS = 80
LEASED = 64                         # 16 MiB: more than the kernel buffers hold, so a GET stalls
FLAGS = ["--lease-ttl", "2", "--write-ttl", "2", "--transfer-idle-timeout", "1",
         "--handshake-timeout", "1", "--data-idle-timeout", "2", "--max-data-conns", "4",
         "--quarantine-ttl", "30", "--max-client-pool-fraction", "1"]   # one session leases 80%


@pytest.fixture(scope="module")
def server():
    with start_server(POOL_CHUNKS * CHUNK / 2**30, shm=False, extra_args=FLAGS) as s:
        with KVClient(s.url) as c:
            c.register("m", SMALL)
        yield s


def _fill_pool_with_new_stores(server, tag: str, n: int) -> None:
    """Store n fresh chunks (needs the leased/pending ones gone when n > free)."""
    with KVClient(server.url) as c:
        ks = [key(i, tag) for i in range(n)]
        for i in range(0, n, 8):
            assert c.store("m", ks[i:i + 8], [chunk_for(k) for k in ks[i:i + 8]]).stored == \
                len(ks[i:i + 8])
        with c.retrieve("m", ks[-8:]) as r:
            assert all(matches(k, t) for k, t in zip(ks[-8:], r.tensors))


def test_stalled_get_is_cut_and_its_lease_reclaimed(server):
    """Lease most of the pool with_data, send GET with a tiny receive buffer, never read."""
    ks = [key(i, "stall-get") for i in range(LEASED)]
    with KVClient(server.url) as c:
        for i in range(0, LEASED, 16):
            c.store("m", ks[i:i + 16], [chunk_for(k) for k in ks[i:i + 16]])
    session = secrets.token_bytes(16)
    d = session_dealer(server.url, session)
    try:
        leased = call(d, P.Retrieve(model="m", keys=ks, with_data=True))
        assert isinstance(leased, P.Leased) and leased.count == LEASED
        conn = socket.socket()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.settimeout(10)
        conn.connect((server.host, data_port(server)))
        auth.client_handshake(conn, None, session)
        conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.GET, leased.lease_id, 0))
        # never read: the server's send stalls; the idle timeout cuts it, the lease goes
        assert wait_until(lambda: status(server)["leases"] == 0)
        # the owner's release now says the lease is over (not busy, not silently ok)
        reply = call(d, P.Release(lease_id=leased.lease_id))
        # cut by the data link (idle) or by the index deadline: lease_expired either way
        assert isinstance(reply, P.Error) and reply.code == "lease_expired", reply
        conn.close()
    finally:
        close_dealer(d)
    # the 64 leased chunks are evictable again: 40 new chunks fit only by evicting them
    _fill_pool_with_new_stores(server, "after-get", 40)


def test_half_sent_put_is_cut_and_its_store_reclaimed(server):
    with KVClient(server.url, use_shm=False) as c:
        ks = [key(i, "half-put") for i in range(32)]
        h = c.prepare_store("m", ks)
        assert status(server)["writing"] == 32
        conn = link(server, session=c.session)
        conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.PUT, h.store_id, 32 * CHUNK))
        conn.sendall(b"\x01" * (16 * CHUNK))   # half, then stall
        assert wait_until(lambda: status(server)["pending_stores"] == 0)
        d = session_dealer(server.url, c.session, thread_no=9)  # the holder's late Commit
        try:
            reply = call(d, P.Commit(store_id=h.store_id))
        finally:
            close_dealer(d)
        assert isinstance(reply, P.Error) and reply.code == "store_expired", reply
        assert c.lookup("m", ks) == 0
        conn.close()
    # its slots came back at once (only the server wrote them: nothing to quarantine)
    assert status(server)["writing"] == 0 and status(server)["quarantined_bytes"] == 0
    _fill_pool_with_new_stores(server, "after-put", 40)


@pytest.mark.slow  # real-time waits past the handshake deadline
def test_short_handshake_is_cut():
    """Fewer bytes than the handshake (or a request header) never hold a thread for long."""
    with start_server(0.01, extra_args=FLAGS) as s:
        conn = link(s, handshake=False)
        nonce = bytearray(wire.NONCE_BYTES)
        wire.recv_exact(conn, nonce)
        conn.sendall(b"x" * 10)              # < session + MAC: the server waits 1 s, closes
        assert conn.recv(1) == b""           # closed by the server (the socket timeout is 10 s)
        conn.close()
        conn = link(s)                       # handshake done, then a partial request header
        conn.sendall(b"KVD1")
        assert conn.recv(1) == b""           # --data-idle-timeout 2 s
        conn.close()
        assert wait_until(lambda: status(s)["data_conns"] == 0)


def test_connection_cap_refuses_with_an_error():
    with start_server(0.01, extra_args=FLAGS) as s:
        held = [link(s) for _ in range(4)]
        assert wait_until(lambda: status(s)["data_conns"] == 4)
        extra = link(s, handshake=False)
        msg = link_error(extra)              # the reply comes instead of the nonce
        assert msg.startswith("busy: too many data-link connections"), msg
        extra.close()
        for c in held:
            c.close()
        assert wait_until(lambda: status(s)["data_conns"] == 0)
        with KVClient(s.url, use_shm=False) as c:   # and the link serves again
            c.register("m", SMALL)
            c.store("m", [key(0, "cap")], [chunk_for(key(0, "cap"))])
            with c.retrieve("m", [key(0, "cap")]) as r:
                assert matches(key(0, "cap"), r.tensors[0])


def test_transfers_are_bound_to_the_holder_session(server):
    with KVClient(server.url, use_shm=False) as c:
        ks = [key(0, "holder")]
        c.store("m", ks, [chunk_for(ks[0])])
        h = c.prepare_store("m", [key(1, "holder")])
        with link(server) as conn:           # a stranger's session
            conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.PUT, h.store_id, CHUNK))
            assert link_error(conn).startswith("not_holder: ")
        h.abort()
        d = session_dealer(server.url, c.session, thread_no=7)  # same session, other socket
        try:
            leased = call(d, P.Retrieve(model="m", keys=ks, with_data=True))
            with link(server) as conn:
                conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.GET, leased.lease_id, 0))
                assert link_error(conn).startswith("not_holder: ")
            with link(server, session=c.session) as conn:   # the holder gets the bytes
                conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.GET, leased.lease_id, 0))
                head = bytearray(wire.REPLY.size)
                wire.recv_exact(conn, head)
                magic, st, n, _ = wire.REPLY.unpack(head)
                assert (magic, st, n) == (wire.MAGIC, wire.OK, CHUNK)
                data = bytearray(n)
                wire.recv_exact(conn, data)
            assert bytes(data) == chunk_for(ks[0]).numpy().tobytes()
        finally:
            close_dealer(d)


def test_wrong_secret_is_unauthorized(tmp_path):
    path = tmp_path / "secret"
    secret = auth.generate_secret(path)
    with start_server(0.01, secret_file=path, extra_args=FLAGS) as s:
        with KVClient(s.url, secret=secret) as c:
            port = c.server_info().data_port
        with socket.create_connection((s.host, port), timeout=10) as conn:
            # another secret: the server's proof fails and the client hangs up first
            with pytest.raises(auth.AuthError, match="did not prove"):
                auth.client_handshake(conn, b"not-the-secret-0123456789",
                                      secrets.token_bytes(16))
        with socket.create_connection((s.host, port), timeout=10) as conn:
            auth.client_handshake(conn, None, secrets.token_bytes(16))   # no secret at all
            assert link_error(conn).startswith("unauthorized: ")
        with socket.create_connection((s.host, port), timeout=10) as conn:
            auth.client_handshake(conn, secret, secrets.token_bytes(16))
            conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.GET, 12345, 0))
            assert link_error(conn).startswith("unknown_lease: ")


def test_dripping_bytes_does_not_extend_the_handshake_deadline():
    with start_server(0.01, extra_args=FLAGS) as s:   # --handshake-timeout 1
        conn = link(s, handshake=False)
        nonce = bytearray(wire.NONCE_BYTES)
        wire.recv_exact(conn, nonce)
        closed = False
        for _ in range(40):                  # one byte every 0.2 s: 8 s if it were per byte
            try:
                conn.sendall(b"x")
                conn.settimeout(0.2)
                if conn.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed, "the server kept a dripping handshake open past its deadline"
        conn.close()


@pytest.mark.slow  # real-time waits past the transfer deadline
def test_a_dripping_put_is_cut_at_the_transfer_deadline():
    """A PUT that always makes a little progress is not saved by the idle timeout."""
    flags = ["--transfer-timeout", "2", "--transfer-idle-timeout", "60"]
    with start_server(0.01, shm=False, extra_args=flags) as s, \
            KVClient(s.url, use_shm=False) as c:
        c.register("m", SMALL)
        h = c.prepare_store("m", [key(0, "drip")])
        conn = link(s, session=c.session)
        conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.PUT, h.store_id, CHUNK))
        cut = False
        for _ in range(100):                 # a byte every 0.2 s: 20 s, far past 2 s
            try:
                conn.sendall(b"\x01")
                conn.settimeout(0.2)
                if conn.recv(1) in (b"", b"K"):   # closed, or the error reply's magic
                    cut = True
                    break
            except TimeoutError:
                continue
            except OSError:
                cut = True
                break
        assert cut, "a dripping PUT outlived --transfer-timeout"
        conn.close()
        assert wait_until(lambda: status(s)["pending_stores"] == 0 and
                          status(s)["transfers"] == 0)
        d = session_dealer(s.url, c.session, thread_no=3)
        try:
            reply = call(d, P.Commit(store_id=h.store_id))
        finally:
            close_dealer(d)
        assert isinstance(reply, P.Error) and reply.code == "store_expired", reply
