"""A few client sessions together cannot take a total from everyone else, against real server
processes (kvedit/server/quota.py, key_feed.py).

Reproductions of an outside red-team run: the per-session shares of the total caps stopped
one session, not a few. Two sessions with three quarters of the pool each pinned all of it
(a legitimate store got `pool_full` 120 times of 120); eight sessions with an eighth each
reached the total of leased keys in 1.2 s; two sessions' unread key watches filled the
watches' shared queue and kept every other watch waiting. Here a session pins at most a
quarter of the pool, the last quarter of every total is kept for sessions that hold little
(the ones holding most are refused first), a data-link lease counts a repeated key once, and
the watch queue has a share per session, the watch waiting longest cut first.
"""
from __future__ import annotations

import secrets
import time

import pytest
import zmq

from kvedit import protocol as P
from kvedit.client import KVClient, KVError
from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout
from tests.fixtures_server import call, close_dealer, session_dealer
from tests.kv_helpers import SMALL, chunk_for, key, matches

TINY = ModelLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", chunk_size=256)
CHUNK = SMALL.chunk_bytes


def _legit_ops(c: KVClient, n: int, tag: str) -> list[str]:
    """n stores and n retrieves of a client holding nothing between its requests -> the
    refusals it got."""
    refused = []
    for i in range(n):
        k = key(i, tag)
        try:
            c.store("m", [k], [chunk_for(k)])
            with c.retrieve("m", [k]) as got:
                if len(got) != 1 or not matches(k, got.tensors[0]):
                    refused.append(f"retrieve {i}: {len(got)} chunk(s)")
        except KVError as e:
            refused.append(f"{i}: {e.code}: {e.message[:120]}")
    return refused


def test_eight_pinning_sessions_leave_room_for_another():
    """8 sessions each prepare stores until refused, on a pool of 32 chunks: 100 stores and
    100 retrieves of a legitimate client beside them all succeed (before: 2 sessions pinned
    the pool and every legitimate store got pool_full)."""
    with start_server(32 * CHUNK / 2**30, client_pool_fraction=None) as s, \
            KVClient(s.url) as legit:
        legit.register("m", SMALL)
        attackers = [session_dealer(s.url) for _ in range(8)]
        try:
            pinned = 0
            for j, d in enumerate(attackers):
                for i in range(40):
                    r = call(d, P.PrepareStore(model="m", keys=[key(100 * j + i, "pin")]))
                    if isinstance(r, P.Error):
                        assert r.code in ("over_quota", "pool_full"), r
                        break
                    pinned += 1
            refused = _legit_ops(legit, 100, "legit")
            assert refused == [], (len(refused), refused[:3])
            assert pinned <= 30, pinned   # at most 3 x 8 + 5 x 1 of 32: the rest is legit's
            st = legit.stats()
            assert st["held_store_bytes"] == pinned * CHUNK
        finally:
            for d in attackers:
                close_dealer(d)


@pytest.mark.slow   # 256 retrieves of 8,192 keys
def test_eight_leasing_sessions_leave_the_leased_keys_total_to_others():
    """8 sessions lease 8,192 keys again and again until refused: together they stay under
    the reserve line of --max-leased-keys-total, and a legitimate client's 100 stores and
    retrieves all succeed (before: the 8 took the whole total; every retrieve got
    over_quota)."""
    with start_server(0.2, extra_args=["--max-keys-per-request", "8192"]) as s, \
            KVClient(s.url, timeout=60) as c:
        c.register("t", TINY)
        keys = [i.to_bytes(16, "little") for i in range(8192)]
        for start in range(0, 8192, 1024):
            c.prepare_store("t", keys[start:start + 1024]).commit()
        c.register("m", SMALL)
        attackers = [session_dealer(s.url) for _ in range(8)]
        body = P.encoder.encode(P.Retrieve(model="t", keys=keys))
        try:
            for d in attackers:
                for i in range(40):
                    d.send_multipart([i.to_bytes(4, "big"), body])
                codes = [P.reply_decoder.decode(d.recv_multipart()[1]) for _ in range(40)]
                assert any(isinstance(r, P.Error) and r.code == "over_quota" for r in codes)
            held = c.stats()["held_lease_keys"]
            refused = _legit_ops(c, 100, "beside-leases")
            assert refused == [], (len(refused), refused[:3])
            assert held <= (3 << 21) // 4 + 2 * (1 << 16), held   # the line + two shares
        finally:
            for d in attackers:
                close_dealer(d)


def test_a_data_link_lease_counts_a_repeated_key_once():
    with start_server(0.02) as s, KVClient(s.url) as c:
        c.register("m", SMALL)
        k = key(0, "once")
        c.store("m", [k], [chunk_for(k)])
        d = session_dealer(s.url)
        try:
            r = call(d, P.Retrieve(model="m", keys=[k] * 8192, with_data=True))
            assert isinstance(r, P.Leased) and r.count == 1, r   # up to the first repeat
            assert c.stats()["held_lease_keys"] == 1
            r = call(d, P.Retrieve(model="m", keys=[k] * 8192))   # shm: repeats, kept once
            assert r.count == 8192 and c.stats()["held_lease_keys"] == 2
        finally:
            close_dealer(d)


def _stuck_watch(url: str, session: bytes, no: int) -> zmq.Socket:
    """A watch of model "w" on a socket that never reads (one message, 4 KiB of buffer)."""
    d = session_dealer(url, session, no)
    d.setsockopt(zmq.RCVHWM, 1)
    d.setsockopt(zmq.RCVBUF, 4096)
    d.send_multipart([b"w", P.encoder.encode(P.WatchKeys(model="w", tp_ranks=[0], epoch=1))])
    return d


def _trusted_within(c: KVClient, seconds: float, unread_s: float = 0.0) -> bool:
    """Whether a watch of "w" gets its whole snapshot within `seconds`, its first
    `unread_s` of them unread (so it acknowledges nothing while the server sends)."""
    w = c.watch_keys("w", [0])
    time.sleep(unread_s)
    end = time.monotonic() + seconds
    while time.monotonic() < end and not w.trusted:
        w.sync()
        time.sleep(0.05)
    return w.trusted


@pytest.mark.slow   # 2^18 watched keys; waits for stuck watches to count as stuck
def test_stuck_watches_leave_the_watch_queue_to_others():
    """Two sessions with 4 never-read watches each hold two shares of the watches' queue
    (before: all of it); with six more stuck sessions filling it, the watch waiting longest
    is cut so that a connector-style watch of another session still gets its snapshot
    (before: it waited for --watch-ttl, here 60 s)."""
    n = 1 << 18
    with start_server(1.2, extra_args=["--max-keys-per-request", "65536",
                                       "--watch-ttl", "60"]) as s, \
            KVClient(s.url, timeout=60) as c:
        c.register("w", TINY)
        for start in range(0, n, 1 << 16):
            c.prepare_store("w", [i.to_bytes(16, "little")
                                  for i in range(start, start + (1 << 16))]).commit()
        stuck = []
        try:
            for _ in range(2):
                session = secrets.token_bytes(16)
                stuck += [_stuck_watch(s.url, session, t) for t in range(4)]
            time.sleep(3)
            queued = c.stats()["key_watch_queued_bytes"]
            assert queued <= 2 * (4 << 20), queued   # two shares, not all 32 MiB
            with KVClient(s.url, timeout=60) as other:
                assert _trusted_within(other, 20)
            stuck += [_stuck_watch(s.url, secrets.token_bytes(16), 0) for _ in range(6)]
            time.sleep(3)
            # full: 8 sessions stop within a part of their 4 MiB shares (~30.4 MiB of 32),
            # so less room is left than the 5 MiB snapshot below needs
            assert c.stats()["key_watch_queued_bytes"] > (32 << 20) - (3 << 20)
            with KVClient(s.url, timeout=60) as other:
                # unread for 1 s: the server fills the room left and must cut a stuck watch
                # to send more (a reader acknowledging 1 MiB at a time could otherwise race
                # its acknowledgements through the room and need no cut)
                assert _trusted_within(other, 30, unread_s=1.0)
            assert c.stats()["key_watch_reclaimed"] >= 1
        finally:
            for d in stuck:
                close_dealer(d)
