"""Key watches against a real kvedit server: the watcher's copy follows stores, evictions,
deletes and clears; a push is never overtaken by the Committed reply of its store; lost pushes,
an unknown renewal and a restarted server turn the copy untrusted until a fresh snapshot; the
server bounds watches per session and in all, and ends them with their session."""
from __future__ import annotations

import os
import time

import pytest
import torch

from kvedit import protocol as P
from kvedit.client import KVClient
from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout
from kvedit.server import key_feed
from tests.fixtures_server import status, wait_until

LAYOUT = ModelLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float32", chunk_size=256)
POOL = 6   # chunks


def _keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def _store(c: KVClient, keys: list[bytes]) -> None:
    c.store("m", keys, [torch.zeros(LAYOUT.chunk_shape)] * len(keys))


def _synced(w, timeout: float = 10.0) -> bool:
    def done():
        w.sync()
        return w.trusted
    return wait_until(done, timeout)


@pytest.fixture
def server():
    with start_server(POOL * LAYOUT.chunk_bytes / 2**30, chunk_size=256) as s:
        with KVClient(s.url) as c:
            c.register("m", LAYOUT)
        yield s


def test_copy_follows_stores_evictions_deletes(server):
    with KVClient(server.url) as c, KVClient(server.url) as other:
        before = _keys(2)
        _store(c, before)
        w = c.watch_keys("m", [0])
        assert not w.trusted and not w.lacks([before], 0) is True   # untrusted: never "lacks"
        assert _synced(w)
        assert w.keys[0] == set(before)           # the snapshot
        new = _keys(2)
        _store(other, new)   # another client's store: the server sent the push first
        # (the push travels on another connection, whose I/O thread may lag a moment)
        assert wait_until(lambda: (w.sync(), set(new) <= w.keys[0])[1], 2.0)
        assert not w.lacks([new], 0) and w.lacks([_keys(1)], 0)
        other.delete("m", new[:1])
        assert wait_until(lambda: (w.sync(), new[0] not in w.keys[0])[1])
        # fill the pool: the oldest go by eviction, and the copy says so
        fill = _keys(POOL)
        for k in fill:
            _store(other, [k])
        assert wait_until(lambda: (w.sync(), w.keys[0] == set(fill))[1]), w.keys[0]
        ready = {k for k in before + new + fill if other.lookup("m", [k]) == 1}
        assert w.keys[0] == ready and w.trusted and w.resyncs == 0


def test_lost_push_and_unknown_renewal_resubscribe(server):
    with KVClient(server.url) as c:
        w = c.watch_keys("m", [0])
        assert _synced(w)
        # a push that skips a seq (as when the server dropped one on a full queue)
        w._on(P.KeyEvents(epoch=w.epoch, seq=w.seq + 2, added={0: [b"x" * 16]}))
        assert not w.trusted and w.resyncs == 1
        assert not w.lacks([[b"y" * 16]], 0)   # untrusted: the server is asked
        keys = _keys(2)
        _store(c, keys)
        assert _synced(w) and w.keys[0] == set(keys) and b"x" * 16 not in w.keys[0]
        # a renewal the server does not know (expired, restarted)
        w._on(P.WatchAck(epoch=w.epoch, seq=-1))
        assert not w.trusted and w.resyncs == 2
        assert _synced(w) and w.keys[0] == set(keys)
        # a message of an earlier subscription is ignored
        w._on(P.KeyEvents(epoch=w.epoch - 1, seq=w.seq + 1, removed={0: keys}))
        assert w.trusted and w.keys[0] == set(keys)


def test_renewals_keep_the_copy_trusted(server, monkeypatch):
    from kvedit.client import key_watch
    monkeypatch.setattr(key_watch, "RENEW_S", 0.05)
    with KVClient(server.url) as c:
        w = c.watch_keys("m", [0])
        assert _synced(w)
        end = time.monotonic() + 0.6
        while time.monotonic() < end:   # several renewals, each answered in order
            w.sync()
            time.sleep(0.01)
        assert w.trusted and w.resyncs == 0 and w.acked in (True, False)
        assert status(server)["key_watches"] == 1


def test_restarted_server_is_noticed():
    with start_server(POOL * LAYOUT.chunk_bytes / 2**30, chunk_size=256) as s:
        c = KVClient(s.url)
        c.register("m", LAYOUT)
        w = c.watch_keys("m", [0])
        assert _synced(w)
        port = s.port
    # same port, new server: the renewal finds no watch there, the copy is rebuilt from it
    with start_server(POOL * LAYOUT.chunk_bytes / 2**30, chunk_size=256, port=port) as s2:
        with KVClient(s2.url) as c2:
            c2.register("m", LAYOUT)
            keys = _keys(1)
            _store(c2, keys)
            assert wait_until(lambda: (w.sync(), w.trusted and keys[0] in w.keys[0])[1], 15)
            assert w.resyncs >= 1
    c.close()


def test_watch_bounds_and_session_end(server, monkeypatch):
    from kvedit.client import key_watch
    monkeypatch.setattr(key_watch, "RETRY_MIN_S", 0.3)
    with KVClient(server.url) as c:
        watches = [c.watch_keys("m", [0]) for _ in range(key_feed.MAX_PER_HOLDER)]
        for w in watches:
            assert _synced(w)
        extra = c.watch_keys("m", [0])
        assert wait_until(lambda: (extra.sync(), extra.refused == "too_many_waits")[1])
        assert not extra.trusted and not extra.lacks([_keys(1)], 0)
        assert extra.retry_at is not None and not extra.closed   # it tries again later
        assert status(server)["key_watches"] == key_feed.MAX_PER_HOLDER
        watches[0].close()   # a slot frees: the refused watch gets it on a retry
        assert _synced(extra) and extra.refused is None
        assert status(server)["key_watches"] == key_feed.MAX_PER_HOLDER
    # the session's sockets are gone: so are its watches
    assert wait_until(lambda: status(server)["key_watches"] == 0)
