"""What a key watch may cost the server, against a real server process (kvedit/server/key_feed.py).

Reproductions of an outside red-team run: one secret holder re-subscribing a watch and never
reading grew the server by a full snapshot per subscription (+1.7 GiB after 400, no bound);
a snapshot was built in one go on the loop; `watch_keys` took any model name. Here the bytes
a watch has been sent and has not acknowledged are bounded per watch (a snapshot waits, a push
past it drops the watch, whose client is told and subscribes again), an acknowledgement counts
only as far as the kernel delivered bytes, snapshots come in parts, subscriptions are
rate-limited, and a client that leaves bytes unread past the TTL is disconnected.
Latency figures (Hello beside a watch attacker, the loop during a large delete) are measured
by `kvedit bench soak` (docs/security.md), not asserted here.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import zmq

from kvedit import protocol as P
from kvedit.client import KVClient
from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout
from kvedit.server.key_feed import PART_KEYS
from tests.fixtures_server import status, wait_until

TINY = ModelLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", chunk_size=256)
OBJECTS = 60_000          # a snapshot of ~1.1 MB: more than the 1 MiB window below
FLAGS = ["--watch-queue-mb", "1", "--watch-queue-total-mb", "4"]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _fill(c: KVClient, n: int, model: str = "t") -> None:
    """n ready objects, committed without data (a lazy pool stays empty)."""
    c.register(model, TINY)
    for start in range(0, n, 8192):
        keys = [i.to_bytes(16, "little") for i in range(start, min(n, start + 8192))]
        c.prepare_store(model, keys).commit()


def _deaf(url: str, session: bytes | None = None) -> zmq.Socket:
    """A DEALER that reads (almost) nothing: its queue holds one message and its kernel
    buffer 4 KiB, so what the server sends it stays in the server."""
    s = zmq.Context().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.setsockopt(zmq.ROUTING_ID, (session or os.urandom(16)) + bytes(4))
    s.connect(url)
    return s


def _close(s: zmq.Socket) -> None:
    ctx = s.context
    s.close(linger=0)
    ctx.term()


def _settled(server, counter: str) -> int:
    """The counter once it has stopped moving for a second."""
    last, since = None, time.monotonic()
    while time.monotonic() - since < 1.0:
        now = status(server)[counter]
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(0.2)
    return last


def _subscribe(s: zmq.Socket, epoch: int, model: str = "t", **kw) -> None:
    s.send_multipart([b"w", P.encoder.encode(P.WatchKeys(model=model, tp_ranks=[0],
                                                         epoch=epoch, **kw))])


@pytest.fixture(scope="module")
def big():
    with start_server(OBJECTS * TINY.chunk_bytes * 1.1 / 2**30 + 0.05, extra_args=FLAGS) as s:
        with KVClient(s.url, timeout=60) as c:
            _fill(c, OBJECTS)
        yield s


def test_a_subscriber_that_never_reads_is_bounded(big):
    """40 subscriptions from a socket that reads nothing: each used to queue a whole
    snapshot (~1.1 MB here, 44 MB in all); now the server stops at the watch's window and
    refuses subscriptions past the rate limit."""
    base = _rss_mb(big.pid)
    d = _deaf(big.url)
    try:
        for epoch in range(1, 41):
            _subscribe(d, epoch)
        assert wait_until(lambda: status(big)["key_watches"] == 1)
        time.sleep(1.0)   # what it would send, it has sent
        st = status(big)
        assert st["key_watch_queued_bytes"] <= 1 << 20, st
        grown = _rss_mb(big.pid) - base
        assert grown < 16, f"the server grew {grown:.1f} MiB"
        # one snapshot under way for that socket, paused at the window: not all its parts
        assert st["key_snapshots_building"] == 1
        assert st["key_snapshot_parts"] < OBJECTS // PART_KEYS, st
    finally:
        _close(d)
    assert wait_until(lambda: status(big)["key_watches"] == 0)
    assert status(big)["key_watch_queued_bytes"] == 0


def test_a_client_cannot_acknowledge_what_it_did_not_read(big):
    """Renewals claiming every message as read, from a socket that reads nothing: the server
    believes them only as far as the kernel delivered bytes, so the snapshot stays paused."""
    d = _deaf(big.url)
    try:
        _subscribe(d, 1)
        parts = _settled(big, "key_snapshot_parts")   # paused at the window
        for seen in range(0, 60):   # the seqs it would have been sent
            _subscribe(d, 1, renew=True, seen=seen)
        time.sleep(1.0)
        st = status(big)
        # what it did read (the first part, a kernel buffer) lets one more part go; believed
        # in full, the claims would have let the whole snapshot out
        assert st["key_snapshot_parts"] - parts <= 2, st
        assert st["key_snapshots_building"] == 1, st
        assert 0 < st["key_watch_queued_bytes"] <= 1 << 20
    finally:
        _close(d)


def test_subscriptions_are_rate_limited_one_snapshot_per_socket(big):
    with KVClient(big.url) as c:
        s = c.open_socket()
        for epoch in range(1, 13):
            _subscribe(s, epoch)
        codes, deadline = [], time.monotonic() + 20
        while time.monotonic() < deadline and "too_many_waits" not in codes:
            if s.poll(1000):
                msg = P.reply_decoder.decode(s.recv_multipart()[-1])
                if isinstance(msg, P.Error):
                    codes.append(msg.code)
        assert "too_many_waits" in codes, codes
        st = c.stats()
        assert st["key_watches"] == 1 and st["key_snapshots_building"] <= 1, st


def test_a_watch_of_an_unregistered_model_is_refused(big):
    with KVClient(big.url) as c:
        s = c.open_socket()
        _subscribe(s, 1, model="nobody")
        assert s.poll(10_000)
        msg = P.reply_decoder.decode(s.recv_multipart()[-1])
        assert isinstance(msg, P.Error) and msg.code == "unknown_model", msg
        assert c.stats()["key_watches"] == 0


def test_a_big_snapshot_comes_in_parts_and_is_complete(big):
    with KVClient(big.url) as c:
        before = c.stats()["key_snapshot_parts"]
        w = c.watch_keys("t", [0])
        assert wait_until(lambda: (w.sync(), w.trusted)[1], 60)
        assert len(w.keys[0]) == OBJECTS
        assert c.stats()["key_snapshot_parts"] - before >= OBJECTS // PART_KEYS
        w.close()


@pytest.mark.slow   # 80 stores of 1,024 keys and two snapshots
def test_a_watch_that_falls_behind_is_dropped_told_and_resubscribes():
    """A watcher that stops syncing while another client stores: past the window the server
    drops its watch and says so; when it syncs again it subscribes anew and its copy is the
    server's."""
    with start_server(0.2, extra_args=FLAGS) as s, KVClient(s.url) as c, \
            KVClient(s.url) as other:
        other.register("t", TINY)
        w = c.watch_keys("t", [0])
        assert wait_until(lambda: (w.sync(), w.trusted)[1])
        for i in range(80):   # 80 pushes of 1024 keys: ~1.5 MB, never acknowledged
            other.prepare_store("t", [os.urandom(16) for _ in range(1024)]).commit()
        assert wait_until(lambda: c.stats()["key_watch_drops"] >= 1)
        assert wait_until(lambda: (w.sync(), w.trusted and w.resyncs >= 1)[1], 30)
        fresh = other.watch_keys("t", [0])   # the server's keys now, by a snapshot
        assert wait_until(lambda: (fresh.sync(), fresh.trusted)[1], 30)
        w.sync()
        assert w.keys[0] == fresh.keys[0] and len(w.keys[0]) > 50_000


@pytest.mark.slow   # a real-time wait past the watch TTL
def test_bytes_left_unread_past_the_ttl_cut_the_connection():
    with start_server(0.1, extra_args=FLAGS + ["--watch-ttl", "2"]) as s:
        with KVClient(s.url) as c:
            _fill(c, 20_000)
        base = _rss_mb(s.pid)
        d = _deaf(s.url)
        try:
            _subscribe(d, 1)
            assert wait_until(lambda: status(s)["key_watch_queued_bytes"] > 0)
            assert wait_until(lambda: status(s)["key_watch_cuts"] == 1, 10)
            st = status(s)
            assert st["key_watches"] == 0 and st["key_watch_queued_bytes"] == 0, st
            assert _rss_mb(s.pid) - base < 8
        finally:
            _close(d)


def test_a_connector_refused_for_an_unknown_model_retries_until_registered(monkeypatch):
    """The scheduler side subscribes at connect, maybe before its workers registered the
    model: the refusal is retried with backoff, and the watch starts once it is there."""
    from kvedit.client import key_watch
    monkeypatch.setattr(key_watch, "RETRY_MIN_S", 0.2)
    with start_server(0.05) as s, KVClient(s.url) as c:
        w = c.watch_keys("late", [0])
        assert wait_until(lambda: (w.sync(), w.refused == "unknown_model")[1])
        first_retry = w.backoff
        assert wait_until(lambda: (w.sync(), w.backoff > first_retry)[1])   # tried again
        c.register("late", TINY)
        keys = [os.urandom(16)]
        c.store("late", keys, [torch.zeros(TINY.chunk_shape, dtype=torch.float16)])
        assert wait_until(lambda: (w.sync(), w.trusted)[1], 30)
        assert w.keys[0] == set(keys) and w.refused is None
