"""Object states, TTL expiry of leases and unfinished writes, eviction policies."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvedit.client import KVClient, KVError
from kvedit.launch.server import start_server
from tests.fixtures_server import wait_until
from tests.kv_helpers import SMALL, chunk_for, key, matches

CHUNK = SMALL.chunk_bytes
POOL_CHUNKS = 16
POOL_GB = POOL_CHUNKS * CHUNK / 2**30
WHOLE_POOL = ["--max-client-pool-fraction", "1"]   # one client fills the pool (eviction tests)


@pytest.fixture(scope="module")
def ttl_server():
    with start_server(POOL_GB, extra_args=["--lease-ttl", "1", "--write-ttl", "1"]) as s:
        yield s


def test_writing_is_invisible_until_commit(kv_server):
    with KVClient(kv_server.url) as c:
        c.register("states", SMALL)
        ks = [key(i, "inv") for i in range(3)]
        h = c.prepare_store("states", ks)
        assert c.lookup("states", ks) == 0
        assert len(c.retrieve("states", ks).tensors) == 0
        # a second writer sees the in-flight keys as present, not as missing
        h2 = c.prepare_store("states", ks)
        assert h2.missing == [] and h2.present == 3
        h2.commit()
        for buf, k in zip(h.buffers, ks):
            buf.copy_(chunk_for(k))
        h.commit()
        with c.retrieve("states", ks) as r:
            assert [matches(k, t) for k, t in zip(ks, r.tensors)] == [True] * 3


def test_lease_expires_and_release_then_fails(ttl_server):
    with KVClient(ttl_server.url) as c:
        c.register("m", SMALL)
        ks = [key(i, "lease") for i in range(2)]
        c.store("m", ks, [chunk_for(k) for k in ks])
        r = c.retrieve("m", ks)
        assert c.stats()["leases"] == 1
        assert wait_until(lambda: c.stats()["leases"] == 0)
        assert c.stats()["expired_leases"] >= 1
        with pytest.raises(KVError) as e:
            r.release()
        assert e.value.code == "lease_expired" and "TTL" in str(e.value)


def test_unfinished_write_expires(ttl_server):
    with KVClient(ttl_server.url) as c:
        c.register("m", SMALL)
        used = c.stats()["pool_used"]
        h = c.prepare_store("m", [key(0, "w")])
        assert c.stats()["pool_used"] == used + CHUNK
        assert wait_until(lambda: c.stats()["pending_stores"] == 0)
        # expired, but its slot stays quarantined while this (live) writer may still touch it
        assert c.stats()["quarantined_bytes"] == CHUNK
        assert c.stats()["pool_used"] == used + CHUNK
        with pytest.raises(KVError) as e:
            h.commit()
        assert e.value.code == "store_expired" and "TTL" in str(e.value)
        # the late commit acknowledged the expiry: the slot is free again
        assert c.stats()["pool_used"] == used and c.stats()["quarantined_bytes"] == 0
        assert c.lookup("m", [key(0, "w")]) == 0


def test_killed_client_slot_is_reclaimed(ttl_server):
    """A client SIGKILLed between prepare-store and commit: its slot comes back after the TTL."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        from kvedit.client import KVClient
        from tests.kv_helpers import SMALL, key
        c = KVClient({ttl_server.url!r})
        c.register("m", SMALL)
        h = c.prepare_store("m", [key(i, "killed") for i in range(4)])
        h.buffers[0].fill_(1.0)   # half-way through writing
        print(len(h.missing), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    with KVClient(ttl_server.url) as c:
        c.register("m", SMALL)
        used = c.stats()["pool_used"]
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == -9 and p.stdout.strip() == "4", p.stderr
        assert wait_until(lambda: c.stats()["pool_used"] == used)
        ks = [key(i, "killed") for i in range(4)]
        assert c.lookup("m", ks) == 0
        assert c.store("m", ks, [chunk_for(k) for k in ks]).stored == 4
        with c.retrieve("m", ks) as r:
            assert all(matches(k, t) for k, t in zip(ks, r.tensors))


@pytest.mark.parametrize("policy", ["LRU", "FIFO"])
def test_eviction_order(policy):
    with start_server(POOL_GB, eviction=policy, extra_args=WHOLE_POOL) as s, KVClient(s.url) as c:
        c.register("m", SMALL)
        ks = [key(i, policy) for i in range(POOL_CHUNKS)]
        c.store("m", ks, [chunk_for(k) for k in ks])
        c.retrieve("m", ks[:1]).release()       # touch the oldest
        c.store("m", [key(99, policy)], [chunk_for(key(99, policy))])  # needs one slot
        assert c.stats()["evictions"] == 1
        first, second = c.lookup("m", ks[:1]), c.lookup("m", ks[1:2])
        if policy == "LRU":   # the touched one survives, the next-oldest goes
            assert (first, second) == (1, 0)
        else:                 # FIFO ignores reads
            assert (first, second) == (0, 1)


def test_leased_objects_are_not_evicted_and_none_refuses():
    with start_server(POOL_GB, eviction="LRU", extra_args=WHOLE_POOL) as s, KVClient(s.url) as c:
        c.register("m", SMALL)
        ks = [key(i, "pin") for i in range(POOL_CHUNKS)]
        c.store("m", ks, [chunk_for(k) for k in ks])
        with c.retrieve("m", ks) as r:          # everything leased: nothing evictable
            with pytest.raises(KVError) as e:
                c.store("m", [key(100, "pin")], [chunk_for(key(100, "pin"))])
            assert e.value.code == "pool_full" and "leased" in str(e.value)
            assert all(matches(k, t) for k, t in zip(ks, r.tensors))
        c.store("m", [key(100, "pin")], [chunk_for(key(100, "pin"))])  # now one goes
    with start_server(POOL_GB, eviction="none", extra_args=WHOLE_POOL) as s, KVClient(s.url) as c:
        c.register("m", SMALL)
        ks = [key(i, "none") for i in range(POOL_CHUNKS)]
        c.store("m", ks, [chunk_for(k) for k in ks])
        with pytest.raises(KVError) as e:
            c.store("m", [key(100, "none")], [chunk_for(key(100, "none"))])
        assert e.value.code == "pool_full" and "none" in str(e.value)
        assert c.lookup("m", ks) == POOL_CHUNKS  # nothing was lost
        assert c.stats()["evictions"] == 0


def test_delete_while_leased_frees_on_release(kv_server):
    with KVClient(kv_server.url) as c:
        c.register("states", SMALL)
        ks = [key(i, "dl") for i in range(2)]
        c.store("states", ks, [chunk_for(k) for k in ks])
        used = c.stats()["pool_used"]
        r = c.retrieve("states", ks)
        assert c.delete("states", ks) == 2
        assert c.lookup("states", ks) == 0
        assert c.stats()["pool_used"] == used   # still readable by the lease holder
        assert all(matches(k, t) for k, t in zip(ks, r.tensors))
        r.release()
        assert c.stats()["pool_used"] == used - 2 * CHUNK


def test_present_keys_survive_their_own_store():
    """Keys a store reports present are not evicted to make room for its missing ones."""
    with start_server(POOL_GB, eviction="LRU", extra_args=WHOLE_POOL) as s, KVClient(s.url) as c:
        c.register("m", SMALL)
        ks = [key(i, "own") for i in range(POOL_CHUNKS)]
        c.store("m", ks, [chunk_for(k) for k in ks])
        new = key(0, "new")
        res = c.store("m", [new, ks[0]], [chunk_for(new), chunk_for(ks[0])])  # ks[0] is oldest
        assert (res.stored, res.present) == (1, 1)
        assert c.lookup("m", [ks[0], new]) == 2 and c.lookup("m", ks[1:2]) == 0
