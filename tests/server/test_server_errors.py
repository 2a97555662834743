"""Bad input gets a clear error reply; the server keeps running and keeps committed data."""
from __future__ import annotations

import msgspec
import pytest

from kvedit import protocol as P
from kvedit import wire
from kvedit.client import KVClient, KVError
from kvedit.layout import ModelLayout
from tests.fixtures_server import SEED_KEYS as KEYS
from tests.fixtures_server import ask, link, link_error, status, wait_until
from tests.fixtures_server import assert_seed_intact as assert_data_intact
from tests.kv_helpers import SMALL, chunk_for, key


@pytest.fixture(scope="module")
def server(seeded_server):
    return seeded_server


@pytest.mark.parametrize("frames, code, words", [
    ([b"r1"], "malformed", "expected frames"),
    ([b"r1", b"\xc1garbage"], "malformed", "cannot decode"),
    ([b"r1", msgspec.msgpack.encode({"t": "teleport", "to": "mars"})], "malformed", "teleport"),
    ([b"r1", msgspec.msgpack.encode({"t": "lookup", "model": 3, "keys": []})], "malformed",
     "model"),
    ([b"r1", msgspec.msgpack.encode({"t": "lookup", "model": "m", "keys": [b""]})], "bad_key",
     "expected 1..64"),
    ([b"r1", msgspec.msgpack.encode({"t": "hello"}), b"extra"], "malformed", "extra frame"),
    ([b"x" * 17, msgspec.msgpack.encode({"t": "hello"})], "malformed", "request id"),
])
def test_malformed_messages(server, raw, frames, code, words):
    _, reply = ask(raw, *frames)
    assert isinstance(reply, P.Error) and reply.code == code and words in reply.message
    assert_data_intact(server)


def test_request_id_is_echoed(raw):
    rid, reply = ask(raw, b"abc", P.encoder.encode(P.Stats()))
    assert rid == b"abc" and isinstance(reply, P.StatsReply)


@pytest.mark.parametrize("msg, code, words", [
    (P.Lookup(model="ghost", keys=KEYS), "unknown_model", "'ghost'"),
    (P.PrepareStore(model="m", keys=KEYS, tp_rank=3), "unknown_model", "tp_rank 3"),
    (P.Commit(store_id=987654), "unknown_store", "987654"),
    (P.Abort(store_id=987654), "unknown_store", "987654"),
    (P.Release(lease_id=424242), "unknown_lease", "424242"),
    (P.PrepareStore(model="m", keys=[key(i, "big") for i in range(100)]), "too_large",
     "larger than the pool"),
    (P.Register(model="m", layout=ModelLayout(num_layers=0, num_kv_heads=1, head_dim=64,
                                              dtype="float32", chunk_size=256)),
     "bad_layout", "num_layers"),
    (P.Register(model="x", layout=ModelLayout(num_layers=1, num_kv_heads=1, head_dim=64,
                                              dtype="float64", chunk_size=256)),
     "bad_layout", "float64"),
    (P.Register(model="x", layout=ModelLayout(num_layers=1, num_kv_heads=1, head_dim=64,
                                              dtype="float32", chunk_size=16)),
     "bad_layout", "--chunk-size 256"),
    (P.Register(model="x", layout=ModelLayout(num_layers=1024, num_kv_heads=64, head_dim=128,
                                              dtype="float32", chunk_size=256)),
     "too_large", "larger than the whole pool"),
])
def test_error_replies(server, raw, msg, code, words):
    _, reply = ask(raw, b"1", P.encoder.encode(msg))
    assert isinstance(reply, P.Error), reply
    assert reply.code == code and words in reply.message, reply.message
    assert_data_intact(server)


def test_data_link_bad_requests(server):
    with link(server) as conn:
        conn.sendall(b"HTTP/1.1 GET / xxxxxxxxxxxxxxx")
        assert link_error(conn).startswith("malformed: bad data-link request")
    with link(server) as conn:
        conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.GET, 31337, 0))
        assert link_error(conn).startswith("unknown_lease: GET: lease 31337 is unknown")
    with KVClient(server.url) as c:
        h = c.prepare_store("m", [key(7, "link")])
        sid = h.store_id
        with link(server) as conn:  # another session: not the holder
            conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.PUT, sid, SMALL.chunk_bytes))
            assert link_error(conn).startswith("not_holder: ")
        with link(server, session=c.session) as conn:  # the peer vanishes mid-transfer
            conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.PUT, sid, SMALL.chunk_bytes))
            conn.sendall(b"\0" * 1000)
        assert wait_until(lambda: status(server)["transfers"] == 0)  # the server saw it go
        with pytest.raises(KVError) as e:  # the failed transfer voided the store
            h.commit()
        assert e.value.code == "store_expired", e.value
        assert c.lookup("m", [key(7, "link")]) == 0
        h = c.prepare_store("m", [key(8, "link")])
        with link(server, session=c.session) as conn:  # announces the wrong size
            conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.PUT, h.store_id, 5))
            assert f"expected {SMALL.chunk_bytes}" in link_error(conn)
    assert_data_intact(server)


def test_client_side_errors(server):
    with KVClient(server.url, use_shm=False) as c:
        with pytest.raises(KVError) as e:
            c.store("m", KEYS[:2], [chunk_for(KEYS[0])])
        assert e.value.code == "bad_chunk" and "one chunk per key" in str(e.value)
        with pytest.raises(KVError) as e:
            c.store("nobody", KEYS[:1], [chunk_for(KEYS[0])])
        assert e.value.code == "unknown_model" and "registered: ['m[tp_rank 0]']" in str(e.value)
    assert_data_intact(server)
