"""What one client session may hold, against a real server process (kvedit/server/quota.py).

Reproductions of an outside red-team run: a raw client looping `retrieve` of one ready key
× 8192 grew the server by ~66 KiB a lease without bound; one session's pending stores filled
the pool so that every other store got `pool_full`; a crashed client's expired slots stayed
quarantined although its session had disconnected first.
"""
from __future__ import annotations

import httpx
import pytest

from kvedit import protocol as P
from kvedit.client import KVClient, KVError
from kvedit.launch.server import start_server
from tests.fixtures_server import call, close_dealer, session_dealer, status, wait_until
from tests.kv_helpers import SMALL, chunk_for, key

CHUNK = SMALL.chunk_bytes


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _flood(sock, body: bytes, n: int) -> list:
    """Send the same retrieve n times (pipelined in batches) -> the replies."""
    out = []
    for start in range(0, n, 50):
        batch = range(start, min(n, start + 50))
        for i in batch:
            sock.send_multipart([i.to_bytes(8, "little"), body])
        for _ in batch:
            out.append(P.reply_decoder.decode(sock.recv_multipart()[1]))
    return out


@pytest.mark.slow  # a flood: 1,100 requests of 8,192 keys
def test_a_lease_flood_of_one_key_does_not_grow_the_server():
    """1,000 leases of one ready key × 8,192 (the red-team's loop): the server keeps each
    object once per lease, so it grows by a few bytes a lease, not ~66 KiB (~66 MB here)."""
    with start_server(0.02, client_pool_fraction=None) as s, KVClient(s.url) as c:
        c.register("m", SMALL)
        k = key(0, "flood")
        c.store("m", [k], [chunk_for(k)])
        flooder = session_dealer(s.url)
        try:
            body = P.encoder.encode(P.Retrieve(model="m", keys=[k] * 8192))
            _flood(flooder, body, 100)   # warm up the allocator's steady state
            before = _rss_mb(s.pid)
            replies = _flood(flooder, body, 1000)
            grown = _rss_mb(s.pid) - before
            assert grown < 25, f"server RSS grew {grown:.1f} MiB for 1000 leases"
            assert all(isinstance(r, P.Leased) and r.count == 8192 for r in replies)
            st = c.stats()
            assert st["held_leases"] == 1100 and st["leases"] == 1100
            assert st["held_lease_keys"] == 1100          # one object per lease
            assert st["held_lease_bytes"] == CHUNK         # pinned once, however often leased
            cfg = httpx.get(s.http_url + "/config", timeout=10).json()
            assert cfg["max_leases_per_client"] == 4096 and cfg["max_leases_total"] == 65536
            assert cfg["max_leased_keys_per_client"] == 1 << 18
            assert cfg["client_pool_bytes"] == int(0.25 * cfg["pool_bytes"])
        finally:
            close_dealer(flooder)


def test_lease_and_store_counts_are_capped_per_session_and_in_total():
    # a per-session cap of 30 beside a total of 50: no share of the total and no reserve
    # (the share is tests/server/test_preauth.py's, the reserve test_few_sessions.py's)
    flags = ["--max-leases-per-client", "30", "--max-leases-total", "50",
             "--max-stores-per-client", "20", "--max-leased-keys-per-client", "100",
             "--max-client-total-share", "1", "--quota-reserve", "0"]
    with start_server(0.02, extra_args=flags) as s, KVClient(s.url) as c:
        c.register("m", SMALL)
        ks = [key(i, "caps") for i in range(4)]
        c.store("m", ks, [chunk_for(k) for k in ks])
        a, b = session_dealer(s.url), session_dealer(s.url)
        try:
            body = P.encoder.encode(P.Retrieve(model="m", keys=ks[:1]))
            got = _flood(a, body, 31)
            assert all(isinstance(r, P.Leased) for r in got[:30])
            assert isinstance(got[30], P.Error) and got[30].code == "over_quota"
            assert "--max-leases-per-client" in got[30].message
            got = _flood(b, body, 21)   # the total: 30 + 20 = 50
            assert all(isinstance(r, P.Leased) for r in got[:20])
            assert got[20].code == "over_quota" and "--max-leases-total" in got[20].message
            metrics = httpx.get(s.http_url + "/metrics", timeout=10).text
            assert 'kvedit_held{what="leases"} 50.0' in metrics
            assert 'kvedit_errors_total{code="over_quota"} 2.0' in metrics
            # only the holder releases; a release makes room again
            assert call(a, P.Release(lease_id=got[0].lease_id)).code == "not_holder"
            assert isinstance(call(b, P.Release(lease_id=got[0].lease_id)), P.Ok)
            assert isinstance(call(b, P.Retrieve(model="m", keys=ks[:1])), P.Leased)
            newcomer = session_dealer(s.url)
            try:
                assert call(newcomer, P.Retrieve(model="m", keys=ks[:1])).code == "over_quota"
            finally:
                close_dealer(newcomer)
        finally:
            close_dealer(a)
            close_dealer(b)
        # stores: a pending store counts until committed or aborted
        d = session_dealer(s.url)
        try:
            ids = [call(d, P.PrepareStore(model="m", keys=[key(i, "present")])).store_id
                   for i in range(20)]
            r = call(d, P.PrepareStore(model="m", keys=[key(99, "present")]))
            assert r.code == "over_quota" and "--max-stores-per-client" in r.message
            assert isinstance(call(d, P.Abort(store_id=ids[0])), P.Ok)
            assert isinstance(call(d, P.PrepareStore(model="m", keys=[key(98, "x")])),
                              P.StoreSlots)
        finally:
            close_dealer(d)


def test_leased_keys_count_each_object_once_per_lease():
    with start_server(0.02, extra_args=["--max-leased-keys-per-client", "10"]) as s, \
            KVClient(s.url) as c:
        c.register("m", SMALL)
        ks = [key(i, "keys") for i in range(6)]
        c.store("m", ks, [chunk_for(k) for k in ks])
        d = session_dealer(s.url)
        try:
            r = call(d, P.Retrieve(model="m", keys=ks[:5] * 1000))   # 5 objects, 5000 keys
            assert isinstance(r, P.Leased) and r.count == 5000
            assert c.stats()["held_lease_keys"] == 5
            r2 = call(d, P.Retrieve(model="m", keys=ks))   # 5 + 6 > 10
            assert isinstance(r2, P.Error) and r2.code == "over_quota"
            assert "--max-leased-keys-per-client" in r2.message
            assert isinstance(call(d, P.Release(lease_id=r.lease_id)), P.Ok)
            assert isinstance(call(d, P.Retrieve(model="m", keys=ks)), P.Leased)
        finally:
            close_dealer(d)


def test_one_session_cannot_pin_the_whole_pool():
    """4 chunks of 16 in flight or leased is all one session may pin by default (1/4);
    another client's stores still find room, before and after the pinner leases."""
    with start_server(16 * CHUNK / 2**30, client_pool_fraction=None) as s, \
            KVClient(s.url) as legit:
        legit.register("m", SMALL)
        pinner = session_dealer(s.url)
        try:
            stores = []
            for i in range(4):
                r = call(pinner, P.PrepareStore(model="m", keys=[key(i, "pin")]))
                assert isinstance(r, P.StoreSlots), r
                stores.append(r.store_id)
            r = call(pinner, P.PrepareStore(model="m", keys=[key(99, "pin")]))
            assert isinstance(r, P.Error) and r.code == "over_quota", r
            assert "--max-client-pool-fraction" in r.message
            for i in range(3):   # the rest of the pool serves everyone else, evicting as usual
                ks = [key(4 * i + j, "legit") for j in range(4)]
                assert legit.store("m", ks, [chunk_for(k) for k in ks]).stored == 4
            for sid in stores:
                assert isinstance(call(pinner, P.Commit(store_id=sid)), P.Committed)
            pins = [key(i, "pin") for i in range(4)]
            lease = call(pinner, P.Retrieve(model="m", keys=pins))
            assert isinstance(lease, P.Leased) and lease.count == 4
            # leasing them again pins nothing more; one more chunk would (5 > 4)
            assert isinstance(call(pinner, P.Retrieve(model="m", keys=pins[:1])), P.Leased)
            r = call(pinner, P.PrepareStore(model="m", keys=[key(98, "pin")]))
            assert isinstance(r, P.Error) and r.code == "over_quota"
            ks = [key(j, "after") for j in range(4)]
            assert legit.store("m", ks, [chunk_for(k) for k in ks]).stored == 4
            assert legit.stats()["held_lease_bytes"] == 4 * CHUNK
        finally:
            close_dealer(pinner)


@pytest.mark.slow  # real-time waits past the server's TTLs
@pytest.mark.parametrize("fence_gone", [False, True])
def test_a_session_gone_before_expiry_is_not_quarantined(fence_gone):
    """A client holding a store and a lease disconnects (crash) before their TTL: when they
    expire, their slots are free at once, not fenced for --quarantine-ttl (60 s here), unless
    --fence-gone-sessions."""
    flags = ["--write-ttl", "1", "--lease-ttl", "1", "--quarantine-ttl", "60"]
    with start_server(16 * CHUNK / 2**30,
                      extra_args=flags + ["--fence-gone-sessions"] * fence_gone) as s, \
            KVClient(s.url) as c:
        c.register("m", SMALL)
        x = key(0, "ready")
        c.store("m", [x], [chunk_for(x)])
        crashed = session_dealer(s.url)
        slots = call(crashed, P.PrepareStore(model="m", keys=[key(1, "writing")]))
        lease = call(crashed, P.Retrieve(model="m", keys=[x]))
        assert isinstance(slots, P.StoreSlots) and isinstance(lease, P.Leased)
        close_dealer(crashed)
        assert wait_until(lambda: (st := status(s))["pending_stores"] == 0
                          and st["leases"] == 0 and st["expired_stores"] == 1)
        st = status(s)
        if fence_gone:
            assert st["quarantined_bytes"] == 2 * CHUNK
            assert st["held_stores"] == 1 and st["held_leases"] == 1
        else:
            assert st["quarantined_bytes"] == 0 and st["quarantined_objects"] == 0
            assert st["pool_used"] == CHUNK            # only x, ready
            assert st["held_stores"] == 0 and st["held_leases"] == 0 and st["holders"] == 0
        # a session still connected keeps the fence (docs/protocol.md)
        late = session_dealer(s.url)
        try:
            call(late, P.PrepareStore(model="m", keys=[key(2, "late")]))
            assert wait_until(lambda: status(s)["quarantined_bytes"] >= CHUNK)
        finally:
            close_dealer(late)
