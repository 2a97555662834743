"""The second tier on a real Redis Cluster: 3 masters + 3 replicas of redis-server, made with
`redis-cli --cluster create` (kvedit.launch.redis_cluster), under real kvedit servers.

What is checked, against the cluster's own view (CLUSTER NODES, DBSIZE, KEYSLOT) and the
chunks' known contents (tests/kv_helpers.py): chunks spread over the masters with payload and
meta in one slot; two servers share what either stored, byte-exact; a master SIGKILLed or
SIGSTOPped mid-run (its replica promoted) and the whole cluster down then back cost no client
error and no wrong byte, no lookup waits on a failed node (--l2-lookup-wait bounds it, not the
Redis timeout), /status and /metrics name the node that failed, and L2 serves again after the
promotion; a slot migrated under the tier (ASK, TRYAGAIN,
MOVED) loses nothing. Each test starts its own cluster and stops every node by PID; without
redis-server and redis-cli they skip.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
import urllib.request

import pytest

redis = pytest.importorskip("redis", reason="the `redis` client is missing: pip install -e '.[l2]'")

from redis.crc import key_slot  # noqa: E402  (after the skip: the `l2` extra may be missing)

from kvedit.client import KVClient  # noqa: E402
from kvedit.launch.redis import INSTALL_HINT, redis_server_path  # noqa: E402
from kvedit.launch.redis_cluster import RedisClusterProcess  # noqa: E402
from kvedit.server.l2_redis import layout_tag, redis_key  # noqa: E402
from tests.kv_helpers import SMALL, chunk_for, key  # noqa: E402
from tests.l2_helpers import (MODEL, l2_server, retrieved_match, status, store,  # noqa: E402
                              wait_for)

pytestmark = [pytest.mark.skipif(redis_server_path() is None or shutil.which("redis-cli") is None,
                                 reason=INSTALL_HINT),
              pytest.mark.slow]   # a cluster of six redis-servers per test, real failovers


@pytest.fixture
def cluster():
    c = RedisClusterProcess()
    try:
        yield c
    finally:
        c.stop()


def rkey(k: bytes) -> bytes:
    return redis_key("kvedit", MODEL, layout_tag(SMALL), 0, k)


def metrics(server) -> str:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as r:
        return r.read().decode()


def test_chunks_spread_over_the_masters_and_two_servers_share_them(cluster):
    keys = [key(i, "spread") for i in range(48)]
    with l2_server(cluster.url) as a, l2_server(cluster.url) as b, \
            KVClient(a.url) as ca, KVClient(b.url) as cb:
        store(ca, keys)
        wait_for(a, lambda c: c["l2_writes"] == 48)
        per_master = cluster.keys_per_master()
        assert sum(per_master.values()) == 2 * 48 and len(per_master) == 3
        assert min(per_master.values()) >= 2 * 48 / 3 * 0.6   # every master holds its share
        for k in keys[:8]:   # payload and meta in one slot, on the master serving it
            assert key_slot(rkey(k)) == key_slot(rkey(k) + b":m")
        cb.register(MODEL, SMALL)
        assert cb.lookup(MODEL, keys) == 48          # B's L1 is empty: all from the cluster
        assert retrieved_match(cb, keys) == [True] * 48
        c = status(b)["counters"]
        assert (c["l2_hits"], c["l2_corrupt"], c["l2_errors"]) == (48, 0, 0)
        st = status(a)["l2"]
        assert sorted(st["masters"]) == sorted(f"127.0.0.1:{m.port}" for m in cluster.masters())
        assert st["down_nodes"] == [] and st["up"] is True


def _load(server_url: str, batches, stop: threading.Event, errors: list, lookups: list,
          stored: list) -> None:
    """A client storing batches and looking each one up (and a key that is nowhere) until
    `stop`: any exception is a client error; each lookup's time is kept."""
    try:
        with KVClient(server_url, timeout=30) as w:
            for b in batches:
                if stop.is_set():
                    return
                w.store(MODEL, b, [chunk_for(k) for k in b])
                stored.append(b)
                for ks in (b, [key(len(stored), "nowhere")]):
                    t0 = time.monotonic()
                    w.lookup(MODEL, ks)
                    lookups.append(time.monotonic() - t0)
                time.sleep(0.05)
    except Exception as e:
        errors.append(e)


class _UpWatch(threading.Thread):
    """Polls a server's l2_up every 20 ms: when it went down first and up last."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server, self.stop, self.went_up = server, threading.Event(), None

    def run(self):
        up = True
        while not self.stop.is_set():
            now = status(self.server)["counters"]["l2_up"] == 1
            if now and not up:
                self.went_up = time.monotonic()
            up = now
            time.sleep(0.02)


# A lookup waits for L2 at most --l2-lookup-wait, never for the Redis socket timeout (longer
# here, so a lookup held by a dead or hung node would show); the figures against the targets
# (wait + 0.5 s, serving again <= 5 s) are `kvedit bench l2 --cluster`'s, these bounds only
# catch a stall.
LOOKUP_WAIT, L2_TIMEOUT = 0.5, 3.0


def _failover_under_load(cluster, fail, recover) -> dict:
    """Servers A (storing) and B (promoting what A stored) on the cluster; `fail(master)`
    mid-run, `recover(master)` once a replica replaced it. Returns what was observed."""
    batches = [[key(i, f"fo{b}") for i in range(2)] for b in range(400)]
    errors, lookups, stored, stop = [], [], [], threading.Event()
    args = ("--l2-timeout", str(L2_TIMEOUT), "--l2-lookup-wait", str(LOOKUP_WAIT))
    with l2_server(cluster.url, 0.2, *args) as a, l2_server(cluster.url, 0.2, *args) as b, \
            KVClient(a.url) as ca, KVClient(b.url, timeout=30) as cb:
        ca.register(MODEL, SMALL)
        cb.register(MODEL, SMALL)
        t = threading.Thread(target=_load, args=(a.url, batches, stop, errors, lookups, stored))
        t.start()
        watch = _UpWatch(a)
        try:
            wait_for(a, lambda x: x["l2_writes"] >= 20)
            victim = cluster.masters()[0]
            watch.start()
            fail(victim)
            down = wait_for(a, lambda x: x["l2_up"] == 0, timeout=30)
            replaced_after = cluster.wait_replaced(victim)
            promoted_at = time.monotonic()
            recover(victim)
            up = wait_for(a, lambda x: x["l2_up"] == 1, timeout=30)
            time.sleep(1.0)                       # more stores after the failover
        finally:
            stop.set()
            watch.stop.set()
            t.join(60)
            watch.join(10)
        wait_for(a, lambda x: x["l2_queue_depth"] == 0 and x["l2_writing"] == 0, timeout=60)
        # B, whose L1 holds nothing, promotes what A stored; timed and checked byte for byte
        b_lookups, wrong = [], 0
        for batch in stored:
            t0 = time.monotonic()
            n = cb.lookup(MODEL, batch)
            b_lookups.append(time.monotonic() - t0)
            if n:
                wrong += retrieved_match(cb, batch[:n]).count(False)
        return {"errors": errors, "lookups": lookups + b_lookups, "wrong": wrong,
                "stored": stored, "down": down, "up": up, "a_log": a.log(),
                "replaced_after": replaced_after,
                "serving_again_s": watch.went_up - promoted_at,
                "b": status(b)["counters"], "victim": victim,
                "a_l1_ok": all(all(retrieved_match(ca, bb)) for bb in stored[-5:])}


def _check_failover(r: dict) -> None:
    assert r["errors"] == []                                  # no client error
    assert r["wrong"] == 0 and r["b"]["l2_corrupt"] == 0      # every byte read back is right
    assert max(r["lookups"]) < L2_TIMEOUT - 0.5               # no lookup waited on a node
    assert r["serving_again_s"] < 10.0                        # L2 back after the promotion
    assert r["a_l1_ok"]
    node = f"127.0.0.1:{r['victim'].port}"
    assert node in [d["node"] for d in r["down"]["l2"]["down_nodes"]]
    assert r["up"]["l2"]["down_nodes"] == []
    assert f"unreachable at node {node}" in r["a_log"] and "reachable again" in r["a_log"]
    assert r["b"]["l2_hits"] > 0


def test_a_master_killed_under_load_is_replaced_without_errors(cluster):
    r = _failover_under_load(cluster, lambda m: m.kill(), lambda m: m.start())
    _check_failover(r)
    assert len(cluster.masters()) == 3


def test_a_master_paused_ten_seconds_is_replaced_without_errors(cluster):
    paused_at = {}

    def pause(m):
        paused_at["t"] = time.monotonic()
        m.pause()

    def resume(m):   # SIGSTOP for 10 s in all (the replica is promoted meanwhile)
        time.sleep(max(0.0, 10.0 - (time.monotonic() - paused_at["t"])))
        m.resume()

    r = _failover_under_load(cluster, pause, resume)
    _check_failover(r)
    cluster.wait_ok()
    assert r["victim"].port not in [m.port for m in cluster.masters()]   # now a replica


def test_down_node_is_named_in_status_and_metrics(cluster):
    keys = [key(i, "named") for i in range(12)]
    with l2_server(cluster.url, 0.05, "--l2-timeout", "1") as s, KVClient(s.url) as c:
        store(c, keys[:6])
        wait_for(s, lambda x: x["l2_writes"] == 6)
        victim = cluster.master_of(rkey(keys[6]))
        victim.kill()
        t_kill = time.time()
        c.store(MODEL, keys[6:], [chunk_for(k) for k in keys[6:]])   # one lands on the victim
        st = wait_for(s, lambda x: x["l2_up"] == 0, timeout=30)
        down = {d["node"]: d for d in st["l2"]["down_nodes"]}
        assert f"127.0.0.1:{victim.port}" in down
        d = down[f"127.0.0.1:{victim.port}"]
        assert d["for_s"] >= 0 and d["since"].endswith("+00:00")
        text = metrics(s)
        assert f'kvedit_l2_node_down_seconds{{node="127.0.0.1:{victim.port}"}}' in text
        assert "\nkvedit_l2_up 0.0\n" in text
        assert c.lookup(MODEL, keys) == 12            # L1 answers
        cluster.wait_replaced(victim)
        st = wait_for(s, lambda x: x["l2_up"] == 1 and x["l2_queue_depth"] == 0, timeout=30)
        assert st["l2"]["down_nodes"] == [] and "kvedit_l2_node_down_seconds{" not in metrics(s)
        assert time.time() - t_kill < 30


def test_whole_cluster_down_then_back_catches_up(cluster):
    keys = [key(i, "all") for i in range(8)]
    with l2_server(cluster.url, 0.05, "--l2-timeout", "1") as s, KVClient(s.url) as c:
        store(c, keys[:4])
        wait_for(s, lambda x: x["l2_writes"] == 4)
        for n in cluster.nodes:
            n.kill()
        c.store(MODEL, keys[4:], [chunk_for(k) for k in keys[4:]])
        assert c.lookup(MODEL, keys + [key(99, "all")]) == 8    # no error, L1 answers
        st = wait_for(s, lambda x: x["l2_up"] == 0)
        assert st["l2"]["down_nodes"] != []
        for n in cluster.nodes:       # back with their nodes.conf: same roles, empty
            n.start()
        cluster.wait_ok()
        wait_for(s, lambda x: x["l2_up"] == 1 and x["l2_writes"] >= 8, timeout=30)
    with l2_server(cluster.url) as b, KVClient(b.url) as cb:
        cb.register(MODEL, SMALL)
        assert cb.lookup(MODEL, keys[4:]) == 4        # what was queued during the outage
        assert retrieved_match(cb, keys[4:]) == [True] * 4


def _node_id(port: int) -> str:
    r = redis.Redis(port=port)
    try:
        return r.execute_command("CLUSTER", "MYID").decode()
    finally:
        r.close()


def test_a_slot_migrated_under_the_tier_loses_nothing(cluster):
    """Reads follow ASK while the slot migrates, a write waits out TRYAGAIN (MULTI/EXEC on a
    migrating slot) and lands on the new owner, and everything follows MOVED after."""
    keys = [key(i, "mig") for i in range(6)]
    slot = key_slot(rkey(keys[0]))
    with l2_server(cluster.url) as a, KVClient(a.url) as ca:
        store(ca, keys[:1])
        wait_for(a, lambda x: x["l2_writes"] == 1)
        src = next(m for m in cluster.masters()
                   if redis.Redis(port=m.port).execute_command("CLUSTER", "COUNTKEYSINSLOT",
                                                               slot))
        dst = next(m for m in cluster.masters() if m is not src)
        s, d = redis.Redis(port=src.port), redis.Redis(port=dst.port)
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(src.port))
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(dst.port))
        for k in s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10):
            s.execute_command("MIGRATE", "127.0.0.1", dst.port, k, 0, 5000)
        with l2_server(cluster.url) as b, KVClient(b.url) as cb:
            cb.register(MODEL, SMALL)
            assert cb.lookup(MODEL, keys[:1]) == 1          # ASK: read from the importing node
            assert retrieved_match(cb, keys[:1]) == [True]
        # a chunk of the same slot (same hash tag under another model) written mid-migration
        ca.register("m2", SMALL)
        writes = status(a)["counters"]["l2_writes"]
        timer = threading.Timer(0.3, lambda: [redis.Redis(port=m.port).execute_command(
            "CLUSTER", "SETSLOT", slot, "NODE", _node_id(dst.port)) for m in cluster.masters()])
        timer.start()
        ca.store("m2", keys[:1], [chunk_for(keys[0])])
        st = wait_for(a, lambda x: x["l2_writes"] == writes + 1, timeout=10)
        timer.join()
        assert st["counters"]["l2_write_dropped"] == 0 and st["counters"]["l2_up"] == 1
        m2_key = redis_key("kvedit", "m2", layout_tag(SMALL), 0, keys[0])
        assert key_slot(m2_key) == slot and d.exists(m2_key, m2_key + b":m") == 2
        store(ca, keys[1:])                                 # MOVED from here on, or no slot
        wait_for(a, lambda x: x["l2_writes"] == writes + 6)
        s.close()
        d.close()
    with l2_server(cluster.url) as b, KVClient(b.url) as cb:
        cb.register(MODEL, SMALL)
        cb.register("m2", SMALL)
        assert cb.lookup(MODEL, keys) == 6 and cb.lookup("m2", keys[:1]) == 1
        assert retrieved_match(cb, keys) == [True] * 6
        assert status(b)["counters"]["l2_errors"] == 0


def test_cluster_with_a_password():
    keys = [key(i, "pw") for i in range(4)]
    with RedisClusterProcess(password="s3cret-pw") as c:
        with l2_server(c.url) as a, KVClient(a.url) as ca:
            store(ca, keys)
            wait_for(a, lambda x: x["l2_writes"] == 4)
            assert "s3cret-pw" not in a.log() and "s3cret-pw" not in str(status(a))
        wrong = c.url.replace("s3cret-pw", "wrong")
        with l2_server(wrong, 0.05, "--l2-timeout", "1") as b, KVClient(b.url) as cb:
            cb.register(MODEL, SMALL)
            assert cb.lookup(MODEL, keys) == 0           # refused: a miss, not an error
            wait_for(b, lambda x: x["l2_up"] == 0)
        with l2_server(c.url) as b, KVClient(b.url) as cb:
            cb.register(MODEL, SMALL)
            assert cb.lookup(MODEL, keys) == 4
            assert retrieved_match(cb, keys) == [True] * 4


def test_the_launcher_stops_every_node():
    c = RedisClusterProcess()
    pids, d = [n.pid for n in c.nodes], c.dir
    assert len(pids) == 6 and len(c.masters()) == 3
    assert {c.replica_of(m).port for m in c.masters()} | {m.port for m in c.masters()} == \
        {n.port for n in c.nodes}
    c.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not d.exists()


def test_bench_keys_per_master_counts_what_each_master_holds(cluster):
    """`kvedit bench l2 --cluster`'s keys_per_master, against the masters' own DBSIZE sum: two
    keys (payload and meta) per chunk, one entry per serving master, the deviation as stated."""
    from kvedit.bench.l2.cluster import keys_per_master

    r = keys_per_master(cluster, n=192)
    assert set(r["keys"]) == {f"127.0.0.1:{m.port}" for m in cluster.masters()}
    assert sum(r["keys"].values()) == 2 * 192
    assert r["mean"] == 2 * 192 / 3
    assert r["max_deviation"] == max(abs(k - r["mean"]) for k in r["keys"].values()) / r["mean"]
    assert all(k > 0 for k in r["keys"].values())     # the hash tags reach every master
    assert sum(cluster.keys_per_master().values()) == 0   # it cleans up after itself
