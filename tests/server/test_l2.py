"""The Redis second tier (issue 12) against a real redis-server and real kvedit servers.

Each test starts its own redis-server on a free loopback port (persistence off) and stops it
by PID; without redis-server installed they skip (`make setup` installs it).
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from kvedit.client import KVClient
from kvedit.server.l2_redis import layout_tag, redis_key
from kvedit.launch.server import free_port, start_server
from kvedit.launch.redis import INSTALL_HINT, RedisProcess, redis_server_path
from tests.kv_helpers import SMALL, chunk_for, key, matches
from tests.l2_helpers import (CHUNK, MODEL, POOL_4, in_redis, l2_server, retrieved_match, status,
                              store, wait_for)

pytest.importorskip("redis", reason="the `redis` client is missing: pip install -e '.[l2]'")
# slow: every test starts its own redis-server and kvedit servers (~1.5-2.5 s each)
pytestmark = [pytest.mark.skipif(redis_server_path() is None, reason=INSTALL_HINT),
              pytest.mark.slow]

# ---- round trip, fall-through, promotion -------------------------------------------------
def test_round_trip_byte_exact_through_a_second_server(redis_srv):
    keys = [key(i, "rt") for i in range(6)]
    with l2_server(redis_srv.url) as a, l2_server(redis_srv.url) as b, \
            KVClient(a.url) as ca, KVClient(b.url) as cb:
        store(ca, keys)
        wait_for(a, lambda c: c["l2_writes"] == 6)
        assert in_redis(redis_srv.url, keys) == [True] * 6
        cb.register(MODEL, SMALL)
        assert cb.lookup(MODEL, keys) == 6          # B's L1 is empty: all from L2
        assert retrieved_match(cb, keys) == [True] * 6
        c = status(b)["counters"]
        assert (c["l2_hits"], c["l2_promoted_bytes"], c["l2_corrupt"]) == (6, 6 * CHUNK, 0)
        assert c["ready"] == 6 and c["l2_writes"] == 0   # promoted, not written back


def test_fall_through_after_eviction_promotes_into_l1(redis_srv):
    first, second = [key(i, "ev1") for i in range(4)], [key(i, "ev2") for i in range(4)]
    with l2_server(redis_srv.url, POOL_4) as s, KVClient(s.url) as c:
        store(c, first)
        wait_for(s, lambda x: x["l2_writes"] == 4)
        store(c, second)                            # evicts `first` from L1
        st = wait_for(s, lambda x: x["l2_writes"] == 8)
        assert st["counters"]["evictions"] == 4
        assert c.lookup(MODEL, first, wait_timeout=0) == 4   # falls through, promoted
        assert retrieved_match(c, first) == [True] * 4
        assert status(s)["counters"]["l2_hits"] == 4


def test_parked_lookup_answered_when_chunks_arrive_from_l2(redis_srv):
    keys = [key(i, "park") for i in range(5)]
    with l2_server(redis_srv.url) as a, KVClient(a.url) as ca:
        store(ca, keys[:3])
        wait_for(a, lambda c: c["l2_writes"] == 3)
    # B waits up to 30 s for L2 on a no-wait lookup; the client gives up after 10 s, so an
    # answer means the probe's end answered it (keys 3, 4 are in no tier), not the deadline.
    with l2_server(redis_srv.url, 0.05, "--l2-lookup-wait", "30") as b, \
            KVClient(b.url, timeout=10) as cb:
        cb.register(MODEL, SMALL)
        assert cb.lookup(MODEL, keys) == 3
        assert status(b)["counters"]["l2_misses"] == 1
        # a waiting lookup (the SDK's) is answered by the L2 promotion plus a later store
        got = {}
        t = threading.Thread(target=lambda: got.update(
            n=KVClient(b.url, timeout=30).lookup(MODEL, keys, wait_timeout=20)))
        t.start()
        wait_for(b, lambda c: c["waiting_lookups"] == 1)
        cb.store(MODEL, keys[3:], [chunk_for(k) for k in keys[3:]])
        t.join(30)
        assert got == {"n": 5}
        assert retrieved_match(cb, keys) == [True] * 5


def test_lookup_wait_zero_promotes_in_the_background(redis_srv):
    keys = [key(i, "bg") for i in range(3)]
    with l2_server(redis_srv.url) as a, KVClient(a.url) as ca:
        store(ca, keys)
        wait_for(a, lambda c: c["l2_writes"] == 3)
    with l2_server(redis_srv.url, 0.05, "--l2-lookup-wait", "0") as b, KVClient(b.url) as cb:
        cb.register(MODEL, SMALL)
        assert cb.lookup(MODEL, keys) == 0          # answered from L1 at once
        wait_for(b, lambda c: c["l2_hits"] == 3)    # ... while the chunks are promoted
        assert cb.lookup(MODEL, keys) == 3
        assert retrieved_match(cb, keys) == [True] * 3


def test_corrupt_or_truncated_records_are_misses(redis_srv):
    import redis
    keys = [key(i, "bad") for i in range(4)]
    with l2_server(redis_srv.url) as a, KVClient(a.url) as ca:
        store(ca, keys)
        wait_for(a, lambda c: c["l2_writes"] == 4)
    r = redis.Redis.from_url(redis_srv.url)
    rk = [redis_key("kvedit", MODEL, layout_tag(SMALL), 0, k) for k in keys]
    flipped = bytearray(r.get(rk[2]))
    flipped[12345] ^= 1
    r.set(rk[2], bytes(flipped))                    # same length, one bit off
    r.set(rk[3], r.get(rk[3])[:-7])                 # truncated
    r.close()
    with l2_server(redis_srv.url) as b, KVClient(b.url) as cb:
        cb.register(MODEL, SMALL)
        assert cb.lookup(MODEL, keys) == 2
        assert cb.lookup(MODEL, keys[3:]) == 0
        c = status(b)["counters"]
        assert c["l2_corrupt"] == 2 and c["l2_hits"] == 2
        assert c["ready"] == 2 and c["writing"] == 0   # the failed fills were dropped
        assert retrieved_match(cb, keys[:2]) == [True, True]


def test_models_and_layouts_do_not_collide(redis_srv):
    keys = [key(i, "coll") for i in range(2)]
    other = SMALL.__class__(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float32",
                            chunk_size=256, tp_size=2)
    assert layout_tag(other) != layout_tag(SMALL)
    with l2_server(redis_srv.url) as a, KVClient(a.url) as ca:
        store(ca, keys)
        wait_for(a, lambda c: c["l2_writes"] == 2)
    with l2_server(redis_srv.url) as b, KVClient(b.url) as cb:
        cb.register("other-model", SMALL)
        assert cb.lookup("other-model", keys) == 0   # same chunk keys, another model
        cb.register(MODEL, SMALL)
        assert cb.lookup(MODEL, keys) == 2


def test_ttl_and_prefix_flags(redis_srv):
    import redis
    keys = [key(i, "ttl") for i in range(2)]
    with l2_server(redis_srv.url, 0.05, "--l2-ttl", "100", "--l2-prefix", "team7") as a, \
            KVClient(a.url) as ca:
        store(ca, keys)
        wait_for(a, lambda c: c["l2_writes"] == 2)
    r = redis.Redis.from_url(redis_srv.url)
    try:
        rk = redis_key("team7", MODEL, layout_tag(SMALL), 0, keys[0])
        assert 0 < r.ttl(rk) <= 100 and 0 < r.ttl(rk + b":m") <= 100
        assert sorted(r.keys("*")) == sorted(
            k for kk in keys for k in (redis_key("team7", MODEL, layout_tag(SMALL), 0, kk),
                                       redis_key("team7", MODEL, layout_tag(SMALL), 0, kk)
                                       + b":m"))
    finally:
        r.close()


# ---- degradation -------------------------------------------------------------------------
@pytest.mark.slow  # real-time waits for Redis to go down, back off and come back
def test_redis_sigkilled_mid_run_then_restarted_catches_up(redis_srv):
    batches = [[key(i, f"kill{b}") for i in range(2)] for b in range(12)]
    errors, done = [], threading.Event()
    with l2_server(redis_srv.url, 0.05, "--l2-timeout", "1") as s, KVClient(s.url) as c:
        c.register(MODEL, SMALL)
        killed = threading.Event()

        def run():
            try:
                with KVClient(s.url) as w:
                    for i, b in enumerate(batches):
                        if i == 4:
                            killed.wait(10)     # the rest are stored while Redis is gone
                        w.store(MODEL, b, [chunk_for(k) for k in b])
                        assert w.lookup(MODEL, b) == 2
                        assert w.lookup(MODEL, [key(i, "never")]) == 0
            except Exception as e:      # any client error fails the test
                errors.append(e)
            finally:
                done.set()

        t = threading.Thread(target=run)
        t.start()
        wait_for(s, lambda x: x["l2_writes"] >= 8)
        redis_srv.kill()                                # SIGKILL: its data is gone
        killed.set()
        done.wait(60)
        t.join(10)
        assert errors == []
        st = wait_for(s, lambda x: x["l2_up"] == 0)
        assert st["l2"]["up"] is False and st["counters"]["l2_outages"] == 1
        assert [retrieved_match(c, b) for b in batches] == [[True, True]] * 12   # L1 intact
        redis_srv.start()                               # same port, empty
        st = wait_for(s, lambda x: x["l2_up"] == 1 and x["l2_queue_depth"] == 0)
        assert st["counters"]["l2_errors"] >= 1 and st["counters"]["l2_write_dropped"] == 0
        # caught up: what was stored during the outage is in the new Redis
        assert in_redis(redis_srv.url, [k for b in batches[4:] for k in b]) == [True] * 16
        # and reads work again on the reader's connection: drop from L1, promote from Redis
        hits = st["counters"]["l2_hits"]
        assert c.delete(MODEL, batches[5]) == 2
        assert c.lookup(MODEL, batches[5]) == 2
        assert retrieved_match(c, batches[5]) == [True, True]
        assert status(s)["counters"]["l2_hits"] == hits + 2
        assert "unreachable" in s.log() and "reachable again" in s.log()


def test_hung_redis_times_out_and_lookups_answer_from_l1(redis_srv):
    """SIGSTOP: Redis accepts nothing and answers nothing (a slow Redis). Lookups that would
    fall through are answered within --l2-timeout (no error), stores go on, and once Redis
    runs again the queued writes land."""
    keys = [key(i, "hung") for i in range(4)]
    with l2_server(redis_srv.url, 0.05, "--l2-timeout", "1", "--l2-lookup-wait", "1") as s, \
            KVClient(s.url, timeout=10) as c:
        store(c, keys[:2])
        wait_for(s, lambda x: x["l2_writes"] == 2)
        redis_srv.pause()
        try:
            assert c.lookup(MODEL, keys) == 2           # the probe hangs; L1 answers
            c.store(MODEL, keys[2:], [chunk_for(k) for k in keys[2:]])
            assert c.lookup(MODEL, keys) == 4
            st = wait_for(s, lambda x: x["l2_up"] == 0)
            assert st["counters"]["l2_errors"] >= 1
        finally:
            redis_srv.resume()
        wait_for(s, lambda x: x["l2_up"] == 1 and x["l2_writes"] == 4)
    assert in_redis(redis_srv.url, keys) == [True] * 4


@pytest.mark.slow  # real-time waits for Redis to go down, back off and come back
def test_server_stops_cleanly_while_redis_hangs(redis_srv):
    keys = [key(i, "stop") for i in range(2)]
    s = l2_server(redis_srv.url, 0.05, "--l2-timeout", "3")
    try:
        with KVClient(s.url) as c:
            store(c, keys[:1])
            wait_for(s, lambda x: x["l2_writes"] == 1)
            redis_srv.pause()
            c.store(MODEL, keys[1:], [chunk_for(keys[1])])   # its write hangs in the writer
            assert c.lookup(MODEL, [key(9, "stop")]) == 0    # so does this probe
    finally:
        rc = s.stop(timeout=10)   # SIGTERM; SIGKILL after 10 s would give -9
        redis_srv.resume()
    assert rc == 0


def test_full_redis_refusing_writes_is_counted_not_fatal():
    """maxmemory 1 MiB with noeviction: Redis answers OOM to the writes (it is up). They are
    dropped and counted, logged once; the server keeps serving from L1."""
    keys = [key(i, "oom") for i in range(8)]
    with RedisProcess(maxmemory_mb=1, maxmemory_policy="noeviction") as r, \
            l2_server(r.url) as s, KVClient(s.url) as c:
        store(c, keys)
        st = wait_for(s, lambda x: x["l2_writes"] + x["l2_write_dropped"] == 8)
        assert st["counters"]["l2_write_dropped"] >= 4 and st["counters"]["l2_up"] == 1
        assert st["counters"]["l2_errors"] == st["counters"]["l2_write_dropped"]
        assert retrieved_match(c, keys) == [True] * 8
        assert s.log().count("refused a write") == 1


def test_redis_password_auth(tmp_path):
    keys = [key(i, "auth") for i in range(2)]
    with RedisProcess(password="s3cret-pw") as r:
        with l2_server(r.url) as a, KVClient(a.url) as ca:
            store(ca, keys)
            wait_for(a, lambda c: c["l2_writes"] == 2)
            assert "s3cret-pw" not in json.dumps(status(a)) and "s3cret-pw" not in a.log()
        wrong = r.url.replace("s3cret-pw", "wrong")
        with l2_server(wrong, 0.05, "--l2-timeout", "1") as b, KVClient(b.url) as cb:
            cb.register(MODEL, SMALL)
            assert cb.lookup(MODEL, keys) == 0            # refused by Redis: a miss, no error
            st = wait_for(b, lambda c: c["l2_up"] == 0)
            assert st["counters"]["l2_errors"] >= 1
        with l2_server(r.url) as b, KVClient(b.url) as cb:
            cb.register(MODEL, SMALL)
            assert cb.lookup(MODEL, keys) == 2


@pytest.mark.slow  # real-time waits for Redis to go down, back off and come back
def test_write_behind_queue_is_bounded_and_drops_the_oldest(redis_srv):
    keys = [key(i, "bound") for i in range(10)]
    redis_srv.kill()
    with l2_server(redis_srv.url, 0.05, "--l2-write-queue-mb", "1", "--l2-timeout", "1") as s, \
            KVClient(s.url) as c:
        c.register(MODEL, SMALL)
        c.lookup(MODEL, keys[:1])                       # the failed probe marks L2 down
        wait_for(s, lambda x: x["l2_up"] == 0)
        for k in keys:                                  # one store each: ten queued writes
            c.store(MODEL, [k], [chunk_for(k)])
        st = status(s)
        assert st["l2"]["queue"] == {"depth": 4, "bytes": 4 * CHUNK, "max_bytes": 1 << 20}
        assert st["counters"]["l2_write_dropped"] == 6
        redis_srv.start()
        wait_for(s, lambda x: x["l2_writes"] == 4 and x["l2_queue_depth"] == 0)
        assert in_redis(redis_srv.url, keys) == [False] * 6 + [True] * 4   # the newest four


@pytest.mark.slow  # real-time waits for Redis to go down, back off and come back
def test_evicted_before_written_keeps_its_bytes(redis_srv):
    """Redis down, L1 of four chunks, eight stored: the four evicted while their writes
    wait are copied into the queue, so after Redis returns all eight are in L2."""
    keys = [key(i, "evq") for i in range(8)]
    redis_srv.kill()
    with l2_server(redis_srv.url, POOL_4, "--l2-timeout", "1") as s, KVClient(s.url) as c:
        c.register(MODEL, SMALL)
        c.lookup(MODEL, keys[:1])
        wait_for(s, lambda x: x["l2_up"] == 0)
        for k in keys:
            c.store(MODEL, [k], [chunk_for(k)])
        assert status(s)["counters"]["evictions"] == 4
        redis_srv.start()
        wait_for(s, lambda x: x["l2_writes"] == 8)
    assert in_redis(redis_srv.url, keys) == [True] * 8


def test_unreachable_l2_at_start_serves_from_l1():
    url = f"redis://127.0.0.1:{free_port()}/0"          # nothing listens there
    keys = [key(i, "nol2") for i in range(3)]
    with l2_server(url, 0.05, "--l2-timeout", "1") as s, KVClient(s.url) as c:
        store(c, keys)
        assert c.lookup(MODEL, keys + [key(9, "nol2")]) == 3
        assert retrieved_match(c, keys) == [True] * 3
        st = wait_for(s, lambda x: x["l2_up"] == 0)
        assert st["counters"]["l2_errors"] >= 1
        assert c.lookup(MODEL, [key(9, "nol2")]) == 0   # down: answered from L1 at once


def test_write_on_evict_writes_only_evicted_chunks(redis_srv):
    first, second = [key(i, "woe1") for i in range(4)], [key(i, "woe2") for i in range(4)]
    with l2_server(redis_srv.url, POOL_4, "--l2-write-on", "evict") as s, \
            KVClient(s.url) as c:
        store(c, first)
        assert status(s)["counters"]["l2_writes"] == 0
        store(c, second)
        wait_for(s, lambda x: x["l2_writes"] == 4)
        assert in_redis(redis_srv.url, first + second) == [True] * 4 + [False] * 4


# ---- HTTP, metrics, flags ----------------------------------------------------------------
def test_status_metrics_and_config(redis_srv):
    keys = [key(i, "met") for i in range(3)]
    secret_url = redis_srv.url.replace("redis://", "redis://user:hunter2@")
    with l2_server(redis_srv.url) as a, KVClient(a.url) as ca:
        store(ca, keys)
        wait_for(a, lambda c: c["l2_writes"] == 3)
    with l2_server(redis_srv.url) as b, KVClient(b.url) as cb:
        cb.register(MODEL, SMALL)
        assert cb.lookup(MODEL, keys + [key(7, "met")]) == 3
        st = status(b)
        assert {k: st["l2"][k] for k in ("up", "probes", "hits", "misses", "writes",
                                         "errors")} == \
            {"up": True, "probes": 1, "hits": 3, "misses": 1, "writes": 0, "errors": 0}
        with urllib.request.urlopen(b.http_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("kvedit_l2_")}
        assert values["kvedit_l2_hits_total"] == 3 and values["kvedit_l2_misses_total"] == 1
        assert values["kvedit_l2_probes_total"] == 1
        assert values["kvedit_l2_up"] == 1 and values["kvedit_l2_queue_depth"] == 0
    with start_server(0.05, extra_args=["--l2-url", secret_url, "--l2-timeout", "1"]) as s:
        with urllib.request.urlopen(s.http_url + "/config", timeout=10) as r:
            cfg = json.load(r)
        assert "hunter2" not in json.dumps(cfg) and cfg["l2_url"].startswith("redis://user:***@")
        assert "hunter2" not in s.log()


def test_the_write_behind_queue_is_bounded_by_the_pool_by_default(redis_srv):
    """Without --l2-write-queue-mb the bound is an eighth of the pool (16 MiB to 1 GiB): a
    fixed 1 GiB let copies of evicted chunks behind a restarting Redis grow the server by ~1
    GiB whatever its pool. Its bytes are in /metrics."""
    for pool_gb, bound in ((0.25, 32 << 20), (0.01, 16 << 20)):
        with l2_server(redis_srv.url, pool_gb) as s:
            assert status(s)["l2"]["queue"]["max_bytes"] == bound
            with urllib.request.urlopen(s.http_url + "/config", timeout=10) as r:
                assert json.load(r)["l2_queue_bytes"] == bound
            with urllib.request.urlopen(s.http_url + "/metrics", timeout=10) as r:
                assert "\nkvedit_l2_queue_bytes 0.0\n" in r.read().decode()


@pytest.mark.parametrize("flags, message", [
    (["--l2-url", "http://127.0.0.1:1"], "--l2-url"),
    (["--l2-url", "redis://127.0.0.1:1", "--l2-write-queue-mb", "-1"], "--l2-write-queue-mb"),
    (["--l2-url", "redis://127.0.0.1:1", "--l2-prefix", "a:b"], "--l2-prefix"),
    (["--l2-url", "redis://127.0.0.1:1", "--l2-ttl", "0.5"], "--l2-ttl"),
    (["--l2-url", "redis://127.0.0.1:1", "--l2-write-on", "never"], "--l2-write-on"),
])
def test_bad_l2_flags_are_refused_at_start(flags, message):
    p = subprocess.run([sys.executable, "-m", "kvedit.server.cli", "--l1-size-gb", "0.01",
                        "--shm-name", "", "--port", str(free_port()),
                        "--http-port", str(free_port()), *flags],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and message in p.stderr


def test_layout_with_rope_parameters_round_trips(redis_srv):
    """Registered layouts carry RoPE parameters (a dict inside): keys are still named."""
    from kvedit.layout import RopeParams
    lay = SMALL.__class__(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float32",
                          chunk_size=256, rope=RopeParams(theta=1e6, rotary_dim=64,
                                                          rope_type="llama3",
                                                          scaling={"factor": 8.0}))
    keys = [key(i, "rope") for i in range(2)]
    with l2_server(redis_srv.url) as a, l2_server(redis_srv.url) as b, \
            KVClient(a.url) as ca, KVClient(b.url) as cb:
        ca.register("r", lay)
        ca.store("r", keys, [chunk_for(k, lay) for k in keys])
        wait_for(a, lambda c: c["l2_writes"] == 2)
        cb.register("r", lay)
        assert cb.lookup("r", keys) == 2
        with cb.retrieve("r", keys) as got:
            assert [matches(k, t, lay) for k, t in zip(keys, got.tensors)] == [True, True]
