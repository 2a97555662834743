"""The client's transport, sessions, authentication and fence, against real server processes.

- one transport chosen at connect (shared memory or socket), no mode switches left in callers;
- a shared secret is required on ZMQ (CURVE), the data link (HMAC handshake) and HTTP;
- stores and leases belong to the session that made them: another session's Commit/Abort/
  Release (ZMQ) and PUT/GET (data link) get not_holder;
- the fence: no write into shm slots past the store's deadline (store_expired, client side),
  and a release after the lease TTL says lease_expired.
"""
from __future__ import annotations

import ast
import secrets
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import zmq

from kvedit import auth, wire
from kvedit import protocol as P
from kvedit.client import KVClient, KVError, ServerUnavailable
from kvedit.layout import ModelLayout
from kvedit.launch.server import start_server

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ModelLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_size=256)
MODEL = "transport-model"
SECRET = "test-secret-" + secrets.token_hex(16)


def _chunks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *LAYOUT.chunk_shape, generator=g).to(torch.bfloat16)


def _keys(n: int) -> list[bytes]:
    return [secrets.token_bytes(16) for _ in range(n)]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "kvedit.secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    # at most 4 keys per request: the connector's store must split larger steps
    with start_server(0.25, chunk_size=256, secret_file=path,
                      extra_args=["--max-keys-per-request", "4"]) as server:
        with KVClient(server.url, secret=SECRET) as c:
            c.register(MODEL, LAYOUT)
        yield server


@pytest.fixture(scope="module")
def short_ttl():
    """No secret; write and lease TTLs of 1 s, so a slow client outlives them; small limits."""
    with start_server(0.25, chunk_size=256,
                      extra_args=["--write-ttl", "1", "--lease-ttl", "1",
                                  "--max-keys-per-request", "2048",
                                  "--max-message-bytes", "65536"]) as server:
        with KVClient(server.url) as c:
            c.register(MODEL, LAYOUT)
        yield server


# ---- one transport, chosen once -------------------------------------------------------------
@pytest.mark.parametrize("mode", ["shm", "socket"])
def test_both_transports_round_trip_through_one_interface(secured, mode):
    with KVClient(secured.url, use_shm=mode == "shm", secret=SECRET) as c:
        assert c.transfer_mode == mode
        keys, data = _keys(3), _chunks(3, 1)
        assert c.store(MODEL, keys[:1], data[:1]).stored == 1
        with c.prepare_store(MODEL, keys) as h:     # filled through writable(): same call both ways
            assert h.missing == [1, 2]
            for i, buf in h.writable():
                buf.copy_(data[i])
        with c.retrieve(MODEL, keys) as got:
            assert all(torch.equal(a, b) for a, b in zip(got.tensors, data))
            seg = c.segment()
            if mode == "shm":  # zero-copy views into the mapped segment
                base, end = seg[1].data_ptr(), seg[1].data_ptr() + seg[1].numel()
                assert all(base <= t.data_ptr() < end for t in got.tensors)
            else:
                assert seg is None
        assert c.delete(MODEL, keys) == 3


@pytest.mark.parametrize("mode", ["shm", "socket"])
def test_a_repeated_key_is_answered_alike_by_both_transports(secured, mode):
    """The data link's lease ends at a repeated key (the server sends each chunk once); the
    client asks for each key once and answers the repeats itself, as shared memory does."""
    with KVClient(secured.url, use_shm=mode == "shm", secret=SECRET) as c:
        keys, data = _keys(2), _chunks(2, 1)
        c.store(MODEL, keys[:1], data[:1])
        with c.retrieve(MODEL, [keys[0], keys[0], keys[1], keys[0]]) as got:
            assert len(got) == 2 and all(torch.equal(t, data[0]) for t in got.tensors)
        c.store(MODEL, keys[1:], data[1:])
        with c.retrieve(MODEL, [keys[1], keys[0], keys[1]]) as got:
            assert [torch.equal(t, data[i]) for t, i in zip(got.tensors, (1, 0, 1))] == [True] * 3
            assert len(got) == 3
        c.delete(MODEL, keys)


SWITCH_FILES = ["kvedit/client/kv_client.py", "kvedit/client/handles.py", "kvedit/client/transport.py",
                "kvedit/client/datalink.py", "kvedit/sdk/chunkmap.py", "kvedit/sdk/modify.py",
                "kvedit/sdk/context.py", "kvedit/vllm/worker_side.py", "kvedit/vllm/transfer/copier.py",
                "kvedit/vllm/link.py",
                "kvedit/sdk/source.py", "kvedit/sdk/store.py", "kvedit/sdk/output.py",
                "kvedit/sdk/contracts.py", "kvedit/sdk/driver.py",
                "kvedit/sdk/queries.py", "kvedit/query_contract.py", "kvedit/bench/connector/run.py",
                "kvedit/bench/connector/paged.py", "kvedit/bench/connector/events.py"]


def test_no_transfer_mode_switches_or_private_reaches_left():
    """Callers never compare transfer_mode, and nothing outside KVClient touches its privates."""
    for rel in SWITCH_FILES:
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                names = [n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)]
                assert "transfer_mode" not in names, f"{rel}:{node.lineno} switches on transfer_mode"
            private = ("_link", "_call", "_done", "_seg")
            if isinstance(node, ast.Attribute) and node.attr in private:
                owner = node.value
                assert isinstance(owner, ast.Name) and owner.id == "self", \
                    f"{rel}:{node.lineno} reaches into another object's .{node.attr}"


CLIENT_FILES = SWITCH_FILES[:-1] + ["kvedit/sdk/buffers.py", "kvedit/sdk/rowcopy.py",
                                    "kvedit/sdk/geometry.py", "kvedit/sdk/libc.py",
                                    "kvedit/sdk/glibc_tuning.py", "kvedit/sdk/tp.py",
                                    "kvedit/keys.py", "kvedit/protocol.py", "kvedit/wire.py"]


def test_client_code_never_imports_the_server():
    for rel in CLIENT_FILES:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(m.startswith("kvedit.server") for m in mods), f"{rel} imports {mods}"


# ---- authentication ---------------------------------------------------------------------------
@pytest.mark.parametrize("secret", [None, "a-wrong-secret-0123456789abcdef"])
def test_zmq_refuses_a_missing_or_wrong_secret(secured, secret, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    with pytest.raises(ServerUnavailable) as e:
        KVClient(secured.url, secret=secret, timeout=1.5)
    assert e.value.code == "timeout"


def test_secret_from_the_environment(secured, monkeypatch):
    monkeypatch.setenv(auth.SECRET_ENV, SECRET)
    with KVClient(secured.url, use_shm=False) as c:  # socket: ZMQ and the data link both
        keys = _keys(1)
        c.store(MODEL, keys, _chunks(1, 2))
        with c.retrieve(MODEL, keys) as got:
            assert torch.equal(got.tensors[0], _chunks(1, 2)[0])


def _data_conn(server, port: int, secret: bytes | None, session: bytes) -> socket.socket:
    conn = socket.create_connection((server.host, port), timeout=10)
    try:
        auth.client_handshake(conn, secret, session)
    except auth.AuthError:
        conn.close()
        raise
    return conn


def _data_reply(conn: socket.socket) -> tuple[int, bytes, str]:
    """(status, payload, message) of one data-link reply; ConnectionError if closed."""
    head = bytearray(wire.REPLY.size)
    wire.recv_exact(conn, head)
    magic, status, nbytes, msglen = wire.REPLY.unpack(head)
    assert magic == wire.MAGIC
    msg = bytearray(msglen)
    wire.recv_exact(conn, msg)
    payload = bytearray(nbytes)
    wire.recv_exact(conn, payload)
    return status, bytes(payload), msg.decode()


@pytest.mark.parametrize("secret", [None, b"a-wrong-secret-0123456789abcdef"])
def test_data_link_refuses_a_missing_or_wrong_secret(secured, secret):
    with KVClient(secured.url, secret=SECRET) as c:
        port = c.server_info().data_port
    if secret is not None:   # the server proves its secret first: this client hangs up
        with pytest.raises(auth.AuthError, match="did not prove"):
            _data_conn(secured, port, secret, secrets.token_bytes(16))
        return
    with _data_conn(secured, port, secret, secrets.token_bytes(16)) as conn:
        status, _, msg = _data_reply(conn)  # the answer to the handshake, before any request
        assert status == wire.FAILED and "unauthorized" in msg
        assert conn.recv(1) == b""  # and closed


def test_http_needs_the_bearer_token(secured):
    def get(path: str, token: str | None) -> int:
        req = urllib.request.Request(secured.http_url + path,
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert get("/health", None) == 200
    for path in ("/status", "/config", "/cache"):
        assert get(path, None) == 401, path
        assert get(path, "wrong-token-0123456789") == 401, path
        assert get(path, SECRET) == 401, path   # the secret itself never crosses HTTP
        assert get(path, auth.http_token(SECRET.encode())) == 200, path


def test_sdk_connect_uses_the_secret(secured, monkeypatch):
    from kvedit.sdk.context import connect
    from kvedit.sdk.errors import ConnectError

    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    with connect(secured.url, secured.http_url, MODEL, timeout=5, secret=SECRET) as ctx:
        assert ctx.layout == LAYOUT
    with pytest.raises(ConnectError, match="cannot reach"):
        connect(secured.url, secured.http_url, MODEL, timeout=1)


# ---- sessions: stores and leases belong to their holder --------------------------------------
class RawPeer:
    """A DEALER with its own session (routing id session + socket 0), CURVE with the secret."""

    def __init__(self, ctx: zmq.Context, url: str, secret: str):
        self.session = secrets.token_bytes(16)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, self.session + (0).to_bytes(4, "big"))
        auth.curve_client(self.sock, secret.encode())
        self.sock.connect(url)

    def call(self, msg):
        self.sock.send_multipart([b"r", P.encoder.encode(msg)])
        assert self.sock.poll(10_000), f"no reply to {msg}"
        return P.reply_decoder.decode(self.sock.recv_multipart()[1])


@pytest.fixture
def peers(secured):
    ctx = zmq.Context()
    a, b = RawPeer(ctx, secured.url, SECRET), RawPeer(ctx, secured.url, SECRET)
    yield a, b
    a.sock.close(0)
    b.sock.close(0)
    ctx.term()


@pytest.mark.parametrize("mode", ["shm", "socket"])
def test_a_session_spans_the_threads_of_one_client(secured, mode):
    """Each thread has its own DEALER (and data connection), all under the client's session: a
    store prepared in one thread commits from another, a lease releases from another."""
    import threading

    with KVClient(secured.url, use_shm=mode == "shm", secret=SECRET) as c:
        keys, data = _keys(2), _chunks(2, 7)
        h = c.prepare_store(MODEL, keys)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(res=h.commit(list(data))))
        t.start()
        t.join(30)
        assert out["res"].stored == 2
        leases = c.stats()["leases"]
        got = c.retrieve(MODEL, keys)
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, data))
        t = threading.Thread(target=got.release)
        t.start()
        t.join(30)
        assert c.stats()["leases"] == leases


def _stored_keys(secured, n: int) -> list[bytes]:
    keys = _keys(n)
    with KVClient(secured.url, secret=SECRET) as c:
        c.store(MODEL, keys, _chunks(n, 3))
    return keys


def test_another_session_cannot_release_commit_or_abort_over_zmq(secured, peers):
    a, b = peers
    leased = a.call(P.Retrieve(model=MODEL, keys=_stored_keys(secured, 1)))
    assert isinstance(leased, P.Leased) and leased.count == 1
    for msg in (P.Release(lease_id=leased.lease_id),):
        err = b.call(msg)
        assert isinstance(err, P.Error) and err.code == "not_holder", err
    assert isinstance(a.call(P.Release(lease_id=leased.lease_id)), P.Ok)
    slots = a.call(P.PrepareStore(model=MODEL, keys=_keys(1)))
    for msg in (P.Commit(store_id=slots.store_id), P.Abort(store_id=slots.store_id)):
        err = b.call(msg)
        assert isinstance(err, P.Error) and err.code == "not_holder", err
    assert isinstance(a.call(P.Abort(store_id=slots.store_id)), P.Ok)


def test_another_session_cannot_get_or_put_over_the_data_link(secured, peers):
    a, b = peers
    port = a.call(P.Hello(protocol=P.PROTOCOL)).data_port
    leased = a.call(P.Retrieve(model=MODEL, keys=_stored_keys(secured, 1), with_data=True))
    with _data_conn(secured, port, SECRET.encode(), b.session) as conn:
        conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.GET, leased.lease_id, 0))
        status, _, msg = _data_reply(conn)
        assert status == wire.FAILED and "not_holder" in msg, msg
    with _data_conn(secured, port, SECRET.encode(), a.session) as conn:  # the holder can
        conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.GET, leased.lease_id, 0))
        status, payload, _ = _data_reply(conn)
        assert status == wire.OK and len(payload) == LAYOUT.chunk_bytes
    slots = a.call(P.PrepareStore(model=MODEL, keys=_keys(1)))
    with _data_conn(secured, port, SECRET.encode(), b.session) as conn:
        conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.PUT, slots.store_id, LAYOUT.chunk_bytes))
        conn.sendall(bytes(LAYOUT.chunk_bytes))
        status, _, msg = _data_reply(conn)
        assert status == wire.FAILED and "not_holder" in msg, msg
    assert isinstance(a.call(P.Abort(store_id=slots.store_id)), P.Ok)


# ---- the fence -------------------------------------------------------------------------------
def _wait_past(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()) + 0.05)  # waiting out a TTL, by design


def test_late_shm_write_is_refused_client_side(short_ttl):
    with KVClient(short_ttl.url, use_shm=True) as late, KVClient(short_ttl.url) as other:
        keys, data = _keys(2), _chunks(2, 4)
        h = late.prepare_store(MODEL, keys)
        slot_views = list(h.buffers)
        _wait_past(h.deadline)
        with pytest.raises(KVError) as e:
            h.write(list(data))
        assert e.value.code == "store_expired"
        with pytest.raises(KVError) as e:
            next(h.writable())
        assert e.value.code == "store_expired"
        assert all(not v.any() for v in slot_views)  # not a byte landed
        # the store() path refuses too, and aborts its store
        h2 = late.prepare_store(MODEL, _keys(1))
        _wait_past(h2.deadline)
        with pytest.raises(KVError) as e:
            h2.commit([data[0]])
        assert e.value.code == "store_expired" and h2.done
        # another client's store is whole
        fresh = _keys(2)
        other.store(MODEL, fresh, data)
        with other.retrieve(MODEL, fresh) as got:
            assert all(torch.equal(a, b) for a, b in zip(got.tensors, data))


@pytest.mark.slow  # real-time waits past the server's TTLs
def test_release_after_the_lease_ttl_says_lease_expired(short_ttl):
    with KVClient(short_ttl.url, use_shm=True) as c:
        keys = _keys(1)
        c.store(MODEL, keys, _chunks(1, 5))
        got = c.retrieve(MODEL, keys)
        assert not got.expired()
        got.check_lease()
        time.sleep(1.0 + 1.5)  # past the server's 1 s lease TTL and its expiry sweep
        assert got.expired()
        with pytest.raises(KVError) as e:
            got.check_lease()
        assert e.value.code == "lease_expired"
        with pytest.raises(KVError) as e:
            got.release()
        assert e.value.code == "lease_expired"


@pytest.mark.slow  # real-time waits past the server's TTLs
@pytest.mark.skipif(not __import__("kvedit.sdk.buffers", fromlist=["x"])._cow_supported(),
                    reason="needs /proc/self/pagemap (Linux): kv is then mapped from shm")
def test_modify_outliving_the_lease_fails_and_keeps_the_original(short_ttl):
    """fn runs past the lease TTL on a kv mapped from the stored chunks: the bytes it read may
    be other keys' by then, so nothing is stored and the stream is unchanged."""
    from kvedit.sdk.batch import BatchedStream
    from kvedit.sdk.context import connect
    from kvedit.sdk.errors import BatchError, ModifyError
    from kvedit.sdk.stream import create_request
    from tests.server.test_sdk_modify import LAYOUT as SDK_LAYOUT, MODEL as SDK_MODEL, FakeEngine

    with KVClient(short_ttl.url) as c:
        c.register(SDK_MODEL, SDK_LAYOUT)
    engine = FakeEngine(short_ttl.url)
    try:
        with connect(short_ttl.url, None, SDK_MODEL, timeout=10) as ctx:
            batch = BatchedStream(progress=False)
            stream = create_request(ctx, engine, list(range(100, 100 + 2 * 256)), "")
            batch.add(stream)
            batch.prefill({"max_tokens": 1})
            tokens, salt, keys = list(stream.tokens), stream.cache_salt, list(stream.keys)

            def slow_drop(kv, t):
                time.sleep(2.0)  # past the 1 s lease TTL, by design
                return kv[:, :, :256] * 2, t[:256]

            with pytest.raises((ModifyError, BatchError)) as e:
                batch.modify(slow_drop)
            assert "TTL" in str(e.value) and "original KV is kept" in str(e.value)
            assert (stream.tokens, stream.cache_salt, stream.keys) == (tokens, salt, keys)
            assert ctx.client.lookup(SDK_MODEL, keys) == 2  # the original chunks are still there
            with ctx.client.retrieve(SDK_MODEL, keys) as got:
                assert all(torch.equal(t, engine.data(k)) for t, k in zip(got.tensors, keys))
            assert ctx.client.stats()["pending_stores"] == 0  # the edit's store was aborted
    finally:
        engine.client.close()


def test_oversized_requests_are_refused_client_side_with_the_limit(short_ttl):
    """Over the server's limits from ServerInfo: a clear error before sending (libzmq would drop
    a message over max_message_bytes with the connection, and the caller would see a timeout)."""
    with KVClient(short_ttl.url, timeout=5) as c:
        info = c.server_info()
        assert (info.max_keys_per_request, info.max_message_bytes) == (2048, 65536)
        with pytest.raises(KVError) as e:
            c.lookup(MODEL, [bytes(16)] * 2049)
        assert e.value.code == "too_many_keys" and "at most 2048" in e.value.message
        with pytest.raises(KVError) as e:
            c.lookup(MODEL, [secrets.token_bytes(64) for _ in range(1100)])  # ~72 KB
        assert e.value.code == "too_large" and "65536" in e.value.message
        assert c.lookup(MODEL, _keys(2048)) == 0  # at the limits: served, connection intact


@pytest.mark.slow  # real-time waits past the server's TTLs
def test_connector_load_past_the_lease_ttl_is_a_load_error(short_ttl, monkeypatch):
    """The worker's real load path (WorkerSide.load -> PagedCopier.load_run) on a CPU paged
    cache; the scatter is slowed past the lease TTL (fault injection): the release answers
    lease_expired, so every block of the run is reported for recompute."""
    from types import SimpleNamespace

    from kvedit.vllm.link import ServerLink
    from kvedit.vllm.metadata import KVEditMetadata
    from kvedit.vllm.transfer.plan import ChunkRun
    from kvedit.vllm.paged import PagedKV
    from kvedit.vllm.settings import ConnectorSettings
    from kvedit.vllm.transfer.copier import PagedCopier
    from kvedit.vllm.worker_side import WorkerSide

    block, nblocks = 128, 8
    layers = [torch.zeros(nblocks, LAYOUT.num_kv_heads, block, 2 * LAYOUT.head_dim,
                          dtype=torch.bfloat16) for _ in range(LAYOUT.num_layers)]
    paged = PagedKV(layers, "cpu", LAYOUT.head_dim, block)
    cfg = SimpleNamespace(model_config=SimpleNamespace(served_model_name=MODEL),
                          parallel_config=SimpleNamespace(rank=0, tensor_parallel_size=1))
    ws = WorkerSide(cfg, ConnectorSettings(kvedit_url=short_ttl.url), block)
    ws.paged, ws.layout = paged, LAYOUT
    ws.copier = PagedCopier(paged, LAYOUT, MODEL)
    ws.link = ServerLink(short_ttl.url, 5.0, 1.0, lambda c: None, "worker")
    try:
        keys, data = _keys(2), _chunks(2, 6)
        ws.link.client.store(MODEL, keys, data)
        run = ChunkRun(req_id="r", first=0, keys=[keys], start=0, end=512,
                       block_ids=[5, 2, 7, 0])
        ws.load(KVEditMetadata(loads=[run]))  # in time: loaded, no errors
        assert ws.take_load_errors() == set() and "r" not in ws.failed_from
        for i in range(2):
            out = torch.empty(LAYOUT.chunk_shape, dtype=torch.bfloat16)
            paged.gather(paged.slots(run.block_ids, i * 256, (i + 1) * 256), out)
            assert torch.equal(out, data[i])
        scatter = paged.scatter

        def slow_scatter(slots, src):
            time.sleep(2.5)  # past the 1 s lease TTL and the server's sweep, by design
            scatter(slots, src)
        monkeypatch.setattr(paged, "scatter", slow_scatter)
        ws.load(KVEditMetadata(loads=[run]))
        assert ws.take_load_errors() == {5, 2, 7, 0}  # all recomputed
        assert ws.failed_from["r"] == 0
    finally:
        ws.close()


def test_connector_link_takes_the_secret_file_from_its_config(secured, tmp_path, monkeypatch):
    """kv_connector_extra_config {"kvedit_secret_file": PATH} -> ServerLink (what both connector
    sides use) connects; with no secret anywhere it stays in outage (vLLM recomputes)."""
    from kvedit.vllm.link import ServerLink
    from kvedit.vllm.settings import ConnectorSettings

    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    path = tmp_path / "secret"
    path.write_text(SECRET)
    path.chmod(0o600)
    settings = ConnectorSettings.from_extra({"kvedit_url": secured.url,
                                             "kvedit_secret_file": str(path)})
    assert settings.secret().read() == SECRET.encode()
    link = ServerLink(settings.kvedit_url, 1.5, 60.0, lambda c: None, "worker",
                      secret=settings.secret())
    try:
        assert link.client is not None and link.client.get_layout(MODEL) == LAYOUT
    finally:
        link.close()
    bare = ConnectorSettings.from_extra({"kvedit_url": secured.url})
    assert bare.secret().read() is None
    link = ServerLink(bare.kvedit_url, 1.5, 60.0, lambda c: None, "worker", secret=bare.secret())
    try:
        assert link.client is None  # refused (no CURVE reply): an outage, not a crash
    finally:
        link.close()


def test_connector_store_splits_a_step_larger_than_the_key_limit(secured):
    """The worker's real store path (PagedCopier) with 10 chunks against a server taking 4 keys
    per request: stored in 3 requests, every chunk's bytes as gathered from the paged cache."""
    from kvedit.vllm.paged import PagedKV
    from kvedit.vllm.transfer.copier import PagedCopier

    block, nblocks = 128, 24
    g = torch.Generator().manual_seed(8)
    layers = [torch.randn(nblocks, LAYOUT.num_kv_heads, block, 2 * LAYOUT.head_dim,
                          generator=g).to(torch.bfloat16) for _ in range(LAYOUT.num_layers)]
    paged = PagedKV(layers, "cpu", LAYOUT.head_dim, block)
    block_ids = torch.randperm(nblocks, generator=g)[:20].tolist()
    keys = _keys(10)
    with KVClient(secured.url, secret=SECRET) as c:
        assert c.max_keys == 4
        PagedCopier(paged, LAYOUT, MODEL).store_chunks(
            c, {k: (block_ids, i) for i, k in enumerate(keys)})
        for i in range(0, 10, 4):
            part = keys[i:i + 4]
            with c.retrieve(MODEL, part) as got:
                assert len(got) == len(part)
                for j, t in enumerate(got.tensors):
                    want = torch.empty(LAYOUT.chunk_shape, dtype=torch.bfloat16)
                    n = i + j
                    paged.gather(paged.slots(block_ids, n * 256, (n + 1) * 256), want)
                    assert torch.equal(t, want)
