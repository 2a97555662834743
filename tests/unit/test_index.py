"""The object index in-process: states, leases, holders, the fence (expired ids, quarantine),
data-link transfers (begin/finish/cut), eviction past leased objects, counters, pages."""
from __future__ import annotations

import random

import pytest

from kvedit.server import index as I
from kvedit.server.index import (
    Busy, Index, LeaseExpired, NotHolder, PoolFull, StoreExpired, UnknownLease, UnknownStore)
from kvedit.server.pool import ALIGN, Allocator
from kvedit.server.shards import IntMap

START = 4096
A, B = b"a" * 16, b"b" * 16          # two client sessions (holders)
CH = ALIGN                           # one chunk: one page


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(slots: int = 16, policy: str = "LRU", lease_ttl: float = 10.0, write_ttl: float = 10.0,
         quarantine_ttl: float = 40.0, transfer_timeout: float = 30.0):
    clock = Clock()
    ix = Index(Allocator(START, slots * CH), policy, lease_ttl, write_ttl,
               quarantine_ttl=quarantine_ttl, transfer_timeout=transfer_timeout, clock=clock)
    return ix, clock


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def store(ix: Index, keys, holder=A, model="m", nbytes=CH):
    p = ix.prepare(model, 0, keys, nbytes, holder)
    ix.commit(p.store_id, holder)
    return p


# ---- states and holders -------------------------------------------------------------------
def test_writing_is_invisible_until_commit_and_present_is_not_rewritten():
    ix, _ = make()
    p = ix.prepare("m", 0, [k(1), k(2)], CH, A)
    assert p.missing == [0, 1] and p.present == 0 and len(set(p.offsets)) == 2
    assert ix.leading_ready("m", 0, [k(1)]) == 0
    assert ix.lease("m", 0, [k(1)], A).objs == []
    p2 = ix.prepare("m", 0, [k(1), k(2), k(3)], CH, B)   # in-flight keys count as present
    assert p2.missing == [2] and p2.present == 2
    c = ix.commit(p.store_id, A)
    assert [o.key for o in c.objs] == [k(1), k(2)] and c.nbytes == 2 * CH
    assert ix.leading_ready("m", 0, [k(1), k(2), k(3)]) == 2
    assert ix.counters.ready == 2 and ix.counters.writing == 1


def test_ids_are_random_and_bound_to_their_holder():
    ix, _ = make()
    ids = {ix.prepare("m", 0, [k(i)], CH, A).store_id for i in range(8)}
    ids |= {ix.lease("m", 0, [], A).lease_id for _ in range(8)}
    assert len(ids) == 16 and all(0 < i < 2**63 for i in ids)
    assert sorted(ids) != list(range(min(ids), min(ids) + 16))
    sid = ix.prepare("m", 0, [k(100)], CH, A).store_id
    for op in (ix.commit, ix.abort, ix.begin_put):
        with pytest.raises(NotHolder):
            op(sid, B)
    store(ix, [k(200)])
    lid = ix.lease("m", 0, [k(200)], A).lease_id
    for op in (ix.release, ix.begin_get):
        with pytest.raises(NotHolder):
            op(lid, B)
    ix.commit(sid, A)                 # the holder still can
    assert ix.release(lid, A).nbytes == CH
    with pytest.raises(UnknownLease):
        ix.release(lid, A)
    with pytest.raises(UnknownStore):
        ix.commit(sid, A)
    with pytest.raises(UnknownStore):
        ix.abort(12345, A)
    assert I.Refused in NotHolder.__mro__ and NotHolder.code == "not_holder"


def test_a_key_repeated_in_one_lease_is_one_leased_object():
    ix, _ = make(slots=2, policy="FIFO")
    store(ix, [k(1), k(2)])
    lid = ix.lease("m", 0, [k(1), k(1), k(2)], A).lease_id
    assert ix.counters.leased == 2 and ix.evictable() == 0
    ix.release(lid, A)
    assert ix.counters.leased == 0 and ix.evictable() == 2
    store(ix, [k(3)], holder=B)                 # FIFO: k(1) is still the oldest
    assert ix.leading_ready("m", 0, [k(1)]) == 0 and ix.leading_ready("m", 0, [k(2)]) == 1


def test_delete_while_leased_hides_and_frees_at_last_release():
    ix, _ = make()
    store(ix, [k(1)])
    l1 = ix.lease("m", 0, [k(1)], A)
    l2 = ix.lease("m", 0, [k(1)], B)
    used = ix.alloc.used
    assert ix.delete("m", 0, [k(1)]) == 1
    assert ix.leading_ready("m", 0, [k(1)]) == 0 and ix.alloc.used == used
    ix.release(l1.lease_id, A)
    assert ix.alloc.used == used
    ix.release(l2.lease_id, B)
    assert ix.alloc.used == used - CH and ix.counters.leased == 0


# ---- fence: expired ids and quarantine ---------------------------------------------------------
def test_expired_store_is_quarantined_until_the_holder_acknowledges():
    ix, clock = make(slots=4, write_ttl=5.0)
    p = ix.prepare("m", 0, [k(1)], CH, A)
    clock.t += 6
    e = ix.expire(clock())
    assert e.stores == 1 and ix.counters.expired_stores == 1
    assert ix.counters.quarantined_bytes == CH and ix.alloc.used == CH
    # the quarantined slot is not handed out: the 3 others are, then the pool is full
    offs = ix.prepare("m", 0, [k(2), k(3), k(4)], CH, B).offsets
    assert p.offsets[0] not in offs
    with pytest.raises(PoolFull):
        ix.prepare("m", 0, [k(5)], CH, B)
    with pytest.raises(NotHolder):           # someone else cannot release it
        ix.commit(p.store_id, B)
    with pytest.raises(StoreExpired):        # the late writer: told, and its slot is freed
        ix.commit(p.store_id, A)
    assert ix.counters.quarantined_bytes == 0
    assert ix.prepare("m", 0, [k(5)], CH, B).offsets == p.offsets
    with pytest.raises(StoreExpired):        # asking again still says expired
        ix.abort(p.store_id, A)


def test_expired_lease_of_a_deleted_object_is_quarantined():
    ix, clock = make(slots=4, lease_ttl=5.0)
    store(ix, [k(1), k(2)])
    lid = ix.lease("m", 0, [k(1), k(2)], A).lease_id
    ix.delete("m", 0, [k(1)])                # k(1) hidden, k(2) still live
    clock.t += 6
    assert ix.expire(clock()).leases == 1
    c = ix.counters
    assert c.leases == 0 and c.leased == 0 and c.quarantined_objects == 2   # k(2) pinned too
    assert ix.counters.ready == 1 and ix.alloc.used == 2 * CH
    with pytest.raises(LeaseExpired):
        ix.release(lid, A)
    assert ix.counters.quarantined_objects == 0 and ix.alloc.used == CH
    assert ix.evictable() == 1                # k(2) is back in the eviction order


@pytest.mark.parametrize("end", ["late_release", "session_gone", "quarantine_ttl"])
def test_expired_lease_keeps_its_live_objects_out_of_reuse_until_it_ends(end):
    """C's soak finding: an expired lease's live objects went straight back to the eviction
    order, so the next store reused their slots under the late shm reader."""
    ix, clock = make(slots=4, lease_ttl=5.0, write_ttl=100.0, quarantine_ttl=20.0)
    store(ix, [k(1), k(2)])
    lease = ix.lease("m", 0, [k(1), k(2)], A)
    clock.t += 6
    assert ix.expire(clock()).leases == 1
    c = ix.counters
    assert c.leases == 0 and c.leased == 0 and ix.evictable() == 0
    assert c.quarantined_objects == 2 and c.quarantined_bytes == 2 * CH
    # the 2 free slots are handed out (kept WRITING: not evictable), then the store is
    # refused: the late reader's slots are not evicted
    p = ix.prepare("m", 0, [k(3), k(4)], CH, B)
    assert set(p.offsets).isdisjoint(lease.offsets)
    with pytest.raises(PoolFull):
        ix.prepare("m", 0, [k(5)], CH, B)
    assert ix.leading_ready("m", 0, [k(1), k(2)]) == 2   # still there for anyone to retrieve
    assert ix.delete("m", 0, [k(1)]) == 1    # hidden, but its slot stays with the reader
    assert ix.alloc.used == 4 * CH and c.quarantined_objects == 2 and c.objects == 3
    if end == "late_release":
        with pytest.raises(LeaseExpired):
            ix.release(lease.lease_id, A)
    elif end == "session_gone":
        assert ix.session_gone(B) == 0 and c.quarantined_objects == 2   # not its holder
        assert ix.session_gone(A) == CH
    else:
        clock.t += 19
        assert ix.expire(clock()).unquarantined == 0 and c.quarantined_objects == 2
        clock.t += 1
        assert ix.expire(clock()).unquarantined == CH
    assert c.quarantined_objects == 0 and c.quarantined_bytes == 0
    assert ix.alloc.used == 3 * CH and ix.evictable() == 1   # k(1) freed, k(2) evictable again
    p = ix.prepare("m", 0, [k(5), k(6)], CH, B)   # one free slot, then k(2) is the oldest
    assert sorted(p.offsets) == sorted(lease.offsets) and c.evictions == 1
    assert ix.leading_ready("m", 0, [k(2)]) == 0


def test_releasing_a_newer_lease_does_not_end_an_expired_ones_quarantine():
    ix, clock = make(slots=2, lease_ttl=5.0, quarantine_ttl=20.0)
    store(ix, [k(1)])
    late = ix.lease("m", 0, [k(1)], A).lease_id
    clock.t += 3
    newer = ix.lease("m", 0, [k(1)], B).lease_id
    clock.t += 3
    assert ix.expire(clock()).leases == 1    # `late` only
    assert ix.counters.leased == 1 and ix.counters.quarantined_objects == 1
    ix.release(newer, B)
    assert ix.counters.leased == 0 and ix.evictable() == 0   # A may still be reading it
    ix.prepare("m", 0, [k(2)], CH, B)
    with pytest.raises(PoolFull):
        ix.prepare("m", 0, [k(3)], CH, B)
    with pytest.raises(LeaseExpired):
        ix.release(late, A)
    assert ix.evictable() == 1 and ix.counters.quarantined_objects == 0


def test_quarantine_ends_at_session_gone_or_its_deadline():
    ix, clock = make(slots=4, write_ttl=5.0, quarantine_ttl=20.0)
    ix.prepare("m", 0, [k(1)], CH, A)
    ix.prepare("m", 0, [k(2)], CH, B)
    clock.t += 6
    ix.expire(clock())
    assert ix.counters.quarantined_bytes == 2 * CH
    assert ix.session_gone(A) == CH and ix.counters.quarantined_bytes == CH
    assert ix.session_gone(A) == 0
    clock.t += 19
    assert ix.expire(clock()).unquarantined == 0
    assert ix.next_deadline() == pytest.approx(clock.t + 1)
    clock.t += 1
    assert ix.expire(clock()).unquarantined == CH
    assert ix.alloc.used == 0 and ix.next_deadline() is None


def test_recently_expired_ids_are_bounded(monkeypatch):
    monkeypatch.setattr("kvedit.server.index_types.GONE_CAP", 3)   # pending.py reads it
    ix, clock = make(write_ttl=1.0)
    sids = [ix.prepare("m", 0, [], CH, A).store_id for _ in range(5)]
    clock.t += 2
    assert ix.expire(clock()).stores == 5
    with pytest.raises(UnknownStore):        # forgotten (the oldest two)
        ix.commit(sids[0], A)
    with pytest.raises(StoreExpired):
        ix.commit(sids[4], A)


# ---- transfers -----------------------------------------------------------------------------
def test_put_transfer_is_not_expired_under_it_and_commit_is_busy():
    ix, clock = make(write_ttl=5.0, transfer_timeout=30.0)
    p = ix.prepare("m", 0, [k(1), k(2)], CH, A)
    t = ix.begin_put(p.store_id, A)
    assert [s.offset for s in t.slots] == p.offsets and t.nbytes == 2 * CH
    with pytest.raises(Busy):
        ix.begin_put(p.store_id, A)
    for op in (ix.commit, ix.abort):
        with pytest.raises(Busy):
            op(p.store_id, A)
    clock.t += 10                            # past the write TTL, inside the transfer
    assert ix.expire(clock()) == I.Expiry() and ix.counters.transfers == 1
    assert ix.finish_put(p.store_id, ok=True) is True
    assert ix.commit(p.store_id, A).nbytes == 2 * CH   # a short grace for the Commit


def test_stalled_put_is_cut_and_its_slots_come_back_at_finish():
    ix, clock = make(write_ttl=5.0, transfer_timeout=30.0)
    p = ix.prepare("m", 0, [k(1), k(2)], CH, A)
    ix.begin_put(p.store_id, A)
    clock.t += 31
    e = ix.expire(clock())
    assert e.cut == [p.store_id] and ix.counters.cut_transfers == 1
    assert ix.counters.pending_stores == 0 and ix.counters.writing == 0
    assert ix.alloc.used == 2 * CH           # the data-link thread may still write them
    with pytest.raises(StoreExpired):
        ix.commit(p.store_id, A)
    assert ix.prepare("m", 0, [k(1)], CH, B).missing == [0]   # the key is free to store again
    assert ix.finish_put(p.store_id, ok=True) is False    # bytes arrived, but too late
    assert ix.alloc.used == CH and ix.counters.transfers == 0


def test_failed_put_drops_the_store():
    ix, _ = make()
    p = ix.prepare("m", 0, [k(1)], CH, A)
    ix.begin_put(p.store_id, A)
    ix.finish_put(p.store_id, ok=False)
    assert ix.alloc.used == 0 and ix.counters.pending_stores == 0
    with pytest.raises(StoreExpired):
        ix.commit(p.store_id, A)
    ix.finish_put(p.store_id, ok=False)     # a second finish is a no-op


def test_get_transfer_release_is_busy_and_finish_releases():
    ix, clock = make(lease_ttl=5.0)
    store(ix, [k(1), k(2)])
    lid = ix.lease("m", 0, [k(1), k(2)], A).lease_id
    t = ix.begin_get(lid, A)
    assert t.nbytes == 2 * CH
    with pytest.raises(Busy):
        ix.release(lid, A)
    clock.t += 6
    assert ix.expire(clock()).leases == 0    # not expired under the transfer
    r = ix.finish_get(lid)
    assert r.nbytes == 2 * CH and r.started == t.started == 1000.0
    assert ix.counters.leases == 0 and ix.counters.leased == 0
    with pytest.raises(UnknownLease):
        ix.release(lid, A)


def test_get_failed_on_the_data_link_answers_lease_expired_to_its_holder():
    """A GET cut by the data link itself (idle timeout, peer gone): finish_get(ok=False)."""
    ix, _ = make()
    store(ix, [k(1)])
    lid = ix.lease("m", 0, [k(1)], A).lease_id
    ix.begin_get(lid, A)
    assert ix.finish_get(lid, ok=False).nbytes == CH
    c = ix.counters
    assert c.leases == 0 and c.leased == 0 and c.transfers == 0 and ix.evictable() == 1
    assert c.quarantined_objects == 0        # only the data-link thread read the slot
    with pytest.raises(NotHolder):
        ix.release(lid, B)
    with pytest.raises(LeaseExpired) as e:
        ix.release(lid, A)
    assert "data-link transfer failed" in e.value.message
    assert ix.finish_get(lid, ok=False) is None   # a second finish is a no-op


def test_stalled_get_is_cut_then_deleted_objects_free_at_finish():
    ix, clock = make(lease_ttl=5.0, transfer_timeout=20.0)
    store(ix, [k(1)])
    lid = ix.lease("m", 0, [k(1)], A).lease_id
    ix.begin_get(lid, A)
    ix.delete("m", 0, [k(1)])
    clock.t += 21
    assert ix.expire(clock()).cut == [lid]
    with pytest.raises(LeaseExpired):
        ix.release(lid, A)
    assert ix.alloc.used == CH               # still being read by the data-link thread
    assert ix.finish_get(lid, ok=False) is None
    assert ix.alloc.used == 0 and ix.counters.leased == 0


# ---- eviction --------------------------------------------------------------------------------
class _Counting(IntMap):
    examined = 0

    def __init__(self, src: IntMap):
        super().__init__()
        for rank in src:
            self[rank] = src[rank]

    def __getitem__(self, rank):
        self.examined += 1
        return super().__getitem__(rank)


@pytest.mark.parametrize("policy", ["LRU", "FIFO"])
def test_eviction_skips_many_leased_objects_at_the_head(policy):
    n, leased = 3000, 2500
    ix, _ = make(slots=n, policy=policy)
    store(ix, [k(i) for i in range(n)])
    lid = ix.lease("m", 0, [k(i) for i in range(leased)], A).lease_id
    # the leased objects are not in the eviction order at all: nothing to walk past
    assert ix.evictable() == n - leased
    order = ix.order                         # white box: every object the eviction looks at
    order._by_rank = _Counting(order._by_rank)
    p = ix.prepare("m", 0, [k(n + i) for i in range(256)], CH, B)
    assert len(p.missing) == 256 and ix.counters.evictions == 256
    assert order._by_rank.examined == 256    # not 256 + 2500 leased ones
    assert ix.leading_ready("m", 0, [k(i) for i in range(leased)]) == leased
    assert ix.leading_ready("m", 0, [k(leased + i) for i in range(256)]) == 0
    assert ix.leading_ready("m", 0, [k(leased + 256)]) == 1
    ix.release(lid, A)
    assert ix.evictable() == n - 256


def test_lru_and_fifo_order_with_leases():
    for policy, survivor in (("LRU", 0), ("FIFO", 1)):
        ix, _ = make(slots=4, policy=policy)
        store(ix, [k(i) for i in range(4)])
        ix.release(ix.lease("m", 0, [k(0)], A).lease_id, A)   # touch the oldest
        store(ix, [k(10)], holder=B)
        assert ix.counters.evictions == 1
        assert ix.leading_ready("m", 0, [k(survivor)]) == 1
        assert ix.leading_ready("m", 0, [k(1 - survivor)]) == 0


def test_present_keys_survive_the_stores_own_evictions():
    ix, _ = make(slots=4)
    store(ix, [k(i) for i in range(4)])
    p = ix.prepare("m", 0, [k(0), k(10)], CH, B)     # k(0) is the LRU victim otherwise
    assert p.present == 1 and ix.leading_ready("m", 0, [k(0)]) == 1
    assert ix.leading_ready("m", 0, [k(1)]) == 0


def test_pool_full_allocates_nothing_and_none_policy_refuses():
    ix, _ = make(slots=4, policy="none")
    store(ix, [k(i) for i in range(3)])
    with pytest.raises(PoolFull) as e:
        ix.prepare("m", 0, [k(10), k(11)], CH, A)
    assert "none" in str(e.value) and ix.alloc.used == 3 * CH
    assert ix.counters.objects == 3 and ix.counters.pending_stores == 0


def test_drop_model_refuses_while_leased_or_writing():
    ix, _ = make()
    store(ix, [k(1), k(2)], model="x")
    store(ix, [k(1)], model="y")
    lid = ix.lease("x", 0, [k(1)], A).lease_id
    with pytest.raises(Busy):
        ix.drop_model("x", 0)
    ix.release(lid, A)
    sid = ix.prepare("x", 0, [k(3)], CH, A).store_id
    with pytest.raises(Busy):
        ix.drop_model("x", 0)
    ix.abort(sid, A)
    assert ix.drop_model("x", 0) == 2 and ix.counters.ready == 1
    assert ix.page("x", None, 10).total == 0


# ---- pages -----------------------------------------------------------------------------------
def test_pages_follow_commit_order_with_a_model_filter_and_survive_deletes():
    ix, _ = make(slots=64)
    for i in range(30):
        store(ix, [k(i)], model="xy"[i % 2])
    seen, after = [], None
    while True:
        page = ix.page("x", after, 4)
        assert page.total == (15 if len(seen) < 8 else 14)
        seen += [e.key for e in page.items]
        if len(seen) == 8:                      # delete the cursor object between pages
            ix.delete("x", 0, [seen[-1]])
        if page.next_after is None:
            break
        after = page.next_after
    assert seen == [k(i) for i in range(0, 30, 2)]
    assert [e.key for e in ix.page(None, None, 100).items] == \
        [k(i) for i in range(30) if i != 14]
    assert ix.page("nope", None, 10) == I.Page([], None, 0)
    assert ix.clear("y") == 15 and ix.counters.ready == 14


# ---- counters --------------------------------------------------------------------------------
def _recount(ix: Index) -> dict:
    objs = {id(o): o for o in ix.objects.values()}
    cut = list(ix.pending.cut.values())            # cut transfers awaiting finish_*
    for p in [*ix.stores.values(), *ix.leases.values(), *cut]:
        objs.update({id(o): o for o in p.objs})
    live = list(ix.objects.values())
    q = list(ix.pending.quarantined.values())
    pins: dict[int, int] = {}                       # object -> quarantines naming it
    for e in q:
        for o in e.objs:
            pins[id(o)] = pins.get(id(o), 0) + 1
            objs[id(o)] = o
    assert all(o.pins == pins.get(i, 0) for i, o in objs.items())
    ready = sum(o.state == I.READY for o in live)
    held = [o for o in objs.values()
            if o.live or o.leases or id(o) in pins or any(o in p.objs for p in cut)]
    assert ix.alloc.used == sum(ix.alloc.rounded(o.nbytes) for o in held)   # none leaked
    assert len({o.offset for o in held}) == len(held)   # no slot given to two objects
    q_bytes = sum(ix.alloc.rounded(o.nbytes) for i, o in objs.items() if i in pins)
    return {"objects": len(live), "ready": ready, "writing": len(live) - ready,
            "leased": sum(1 for o in objs.values() if o.leases),
            "leases": len(ix.leases), "pending_stores": len(ix.stores),
            "transfers": sum(p.busy for p in [*ix.stores.values(), *ix.leases.values()])
            + sum(p.busy for p in cut),
            "quarantined_objects": len(pins), "quarantined_bytes": q_bytes,
            "pool_used": ix.alloc.used, "pool_free": ix.alloc.capacity - ix.alloc.used,
            "evictable": sum(1 for o in live
                             if o.state == I.READY and not o.leases and id(o) not in pins)}


def _recount_in_use(ix: Index) -> dict:
    """Live objects being written or leased, per (model, tp_rank): what Unregister waits for."""
    out: dict = {}
    for o in [*ix.objects.values(), *ix.queries.values()]:
        if o.state != I.READY or o.leases:
            out[(o.model, o.tp_rank)] = out.get((o.model, o.tp_rank), 0) + 1
    return out


def _recount_quota(ix: Index) -> dict:
    """What each holder holds, from the tables (quota.py must agree): a store or lease counts
    while open, cut (until finished) or quarantined."""
    pend = ix.pending
    counted = {id(p): p for p in [*pend.stores.values(), *pend.leases.values(),
                                  *pend.cut.values(),
                                  *(q.pending for q in pend.quarantined.values())]}
    held: dict[bytes, dict] = {}
    distinct: dict[bytes, dict] = {}
    for p in counted.values():
        h = held.setdefault(p.holder, {"leases": 0, "stores": 0, "lease_keys": 0,
                                       "store_bytes": 0})
        if p.kind == "store":
            h["stores"] += 1
            h["store_bytes"] += p.nbytes
        else:
            h["leases"] += 1
            h["lease_keys"] += len(p.objs)
            distinct.setdefault(p.holder, {}).update({id(o): o.slot for o in p.objs})
    for holder, h in held.items():
        h["lease_bytes"] = sum(distinct.get(holder, {}).values())
    everyone = {i: slot for d in distinct.values() for i, slot in d.items()}
    held[b"total"] = {f: sum(h[f] for h in held.values())
                      for f in ("leases", "stores", "lease_keys", "store_bytes")}
    held[b"total"]["lease_bytes"] = sum(everyone.values())   # an object once, whoever leases
    return held


def _quota_as_held(ix: Index) -> dict:
    q = ix.pending.quota
    out = {}
    for holder in (A, B):
        h = q.held(holder)
        if h is not None:
            out[holder] = {f: getattr(h, f) for f in ("leases", "stores", "lease_keys",
                                                      "store_bytes", "lease_bytes")}
    out[b"total"] = {f: getattr(q.total, f) for f in ("leases", "stores", "lease_keys",
                                                      "store_bytes", "lease_bytes")}
    return out


def _finish(ix: Index, pid: int) -> None:
    p = ix.pending.cut.get(pid) or ix.stores.get(pid) or ix.leases.get(pid)
    (ix.finish_put if p.kind == "store" else ix.finish_get)(pid, False)


@pytest.mark.parametrize("seed", range(6))
def test_counters_equal_a_recount_after_random_operations(seed):
    rng = random.Random(seed)
    ix, clock = make(slots=40, policy=rng.choice(["LRU", "FIFO"]), lease_ttl=5.0,
                     write_ttl=5.0, quarantine_ttl=12.0, transfer_timeout=8.0)
    holders = [A, B]
    stores, leases = [], []
    for step in range(1500):
        op = rng.randrange(13)
        h = rng.choice(holders)
        model = rng.choice(["x", "y"])
        try:
            if op <= 2:
                keys = [k(rng.randrange(60)) for _ in range(rng.randrange(1, 5))]
                p = ix.prepare(model, 0, keys, CH * (1 if model == "x" else 3), h)
                stores.append((p.store_id, h))
            elif op == 3 and stores:
                ix.commit(*stores.pop(rng.randrange(len(stores))))
            elif op == 4 and stores:
                ix.abort(*stores.pop(rng.randrange(len(stores))))
            elif op == 5:
                keys = [k(rng.randrange(60)) for _ in range(rng.randrange(1, 4))]
                if rng.random() < 0.3:
                    keys.insert(1, keys[0])   # a key repeated in one request
                leases.append((ix.lease(model, 0, keys, h).lease_id, h))
            elif op == 6 and leases:
                ix.release(*leases.pop(rng.randrange(len(leases))))
            elif op == 7:
                ix.delete(model, 0, [k(rng.randrange(60))])
            elif op == 8 and stores:
                sid, sh = rng.choice(stores)
                ix.begin_put(sid, sh)
                if rng.random() < 0.7:
                    ix.finish_put(sid, ok=rng.random() < 0.8)
            elif op == 9 and leases:
                lid, lh = rng.choice(leases)
                ix.begin_get(lid, lh)
                if rng.random() < 0.7:
                    ix.finish_get(lid)
            elif op == 10:
                clock.t += rng.random() * 3
                for pid in ix.expire(clock()).cut:
                    if rng.random() < 0.5:   # the data-link thread notices now (or later)
                        _finish(ix, pid)
            elif op == 11:
                r = rng.random()
                if r < 0.1:
                    ix.session_gone(h)
                elif r < 0.15:
                    ix.clear(model)
                elif r < 0.2:
                    ix.drop_model(model, 0)
            elif op == 12:   # a late shm reader: its lease expires, then stores/deletes go on
                ready = [e.key for e in ix.page(model, None, 60).items] or [k(0)]
                keys = [rng.choice(ready) for _ in range(rng.randrange(1, 4))]
                leases.append((ix.lease(model, 0, keys, h).lease_id, h))   # released later
                clock.t += 5.5                # past the lease TTL (other pendings may go too)
                for pid in ix.expire(clock()).cut:
                    _finish(ix, pid)
                if rng.random() < 0.5:
                    ix.delete(model, 0, [keys[0]])
        except I.Refused:
            pass
        c = ix.counters
        got = {key: getattr(c, key) for key in _recount(ix) if key != "evictable"}
        assert got == {key: v for key, v in _recount(ix).items() if key != "evictable"}, step
        assert ix.evictable() == _recount(ix)["evictable"]
        assert c.ready == len(ix.pages) == ix.page(None, None, 1).total
        assert _quota_as_held(ix) == _recount_quota(ix), step
        assert ix._in_use == _recount_in_use(ix), step
    # drain: everything ends; every slot comes back
    for pid in [*ix.pending.cut, *ix.stores, *ix.leases]:
        _finish(ix, pid)
    for _ in range(2):   # pendings expire, then their quarantine does
        clock.t += 1000
        ix.expire(clock())
    ix.clear()
    assert ix.alloc.used == 0 and ix.alloc.holes == 1
    assert ix.pending.quota.snapshot()["holders"] == 0   # nothing counted any more
    assert ix.counters == I.Counters(evictions=c.evictions, expired_leases=c.expired_leases,
                                     expired_stores=c.expired_stores,
                                     cut_transfers=c.cut_transfers,
                                     pool_bytes=ix.alloc.capacity, pool_free=ix.alloc.capacity)


# ---- two layouts in one pool -----------------------------------------------------------------
def test_a_large_store_evicts_one_large_object_not_many_small_ones():
    small, large = CH, 4 * CH
    ix, _ = make(slots=50)                      # 10 x (one small, one large) = 50 pages
    for i in range(10):
        store(ix, [k(i)], model="s", nbytes=small)
        store(ix, [k(i)], model="l", nbytes=large)
    assert ix.alloc.used == ix.alloc.capacity
    store(ix, [k(99)], model="l", nbytes=large, holder=B)
    # strict LRU over all sizes would evict the oldest small one first, which frees no 4 pages
    assert ix.counters.evictions == 1
    assert ix.leading_ready("s", 0, [k(0)]) == 1 and ix.leading_ready("l", 0, [k(0)]) == 0
    store(ix, [k(98)], model="s", nbytes=small, holder=B)   # a small store takes the oldest
    assert ix.counters.evictions == 2 and ix.leading_ready("s", 0, [k(0)]) == 0


def test_mixed_sizes_with_deletes_rarely_evict_while_enough_is_free():
    """Issue 9 item 10: with two layouts and deletes, first fit + one LRU order evicted on
    nearly every store while plenty of (fragmented) memory was free."""
    rng = random.Random(3)
    ix, _ = make(slots=2000)
    live, wasted = [], 0
    for i in range(6000):
        r = rng.random()
        if r < 0.3 and live:
            j = rng.randrange(len(live))
            live[j], live[-1] = live[-1], live[j]
            model, key = live.pop()
            ix.delete(model, 0, [key])
            continue
        model, nbytes = ("s", CH) if r < 0.79 else ("l", 9 * CH)
        free, before = ix.alloc.capacity - ix.alloc.used, ix.counters.evictions
        store(ix, [k(i)], model=model, nbytes=nbytes)
        live.append((model, k(i)))
        if ix.counters.evictions > before and free >= nbytes:
            wasted += ix.counters.evictions - before
    assert ix.counters.evictions > 500                       # the pool was under pressure
    assert wasted < 0.05 * ix.counters.evictions, (wasted, ix.counters.evictions)


def test_every_refusal_is_a_protocol_error_code():
    from kvedit.protocol import ERROR_CODES
    from kvedit.server.waiters import TooManyWaits
    codes = {c.code for c in I.Refused.__subclasses__()} | {TooManyWaits.code}
    assert len(codes) == 9 and codes <= ERROR_CODES


def test_the_reserve_of_a_total_is_for_sessions_holding_little():
    """quota.py's reserve on a real Index: 16 leases in all, 5 a session, the last 4 kept
    for sessions holding at most 2 (half the reserve here)."""
    from kvedit.server.quota import QuotaLimits
    lim = QuotaLimits(leases_per_client=5, leases_total=16, reserve=0.25, share=0.5)
    ix = Index(Allocator(START, 16 * CH), "LRU", 10.0, 10.0, limits=lim, clock=Clock())
    store(ix, [k(0)])
    sessions = [bytes([i]) * 16 for i in range(6)]
    for h in sessions[:3]:   # three sessions with 4 each reach the line (12)
        for _ in range(4):
            ix.lease("m", 0, [k(0)], h)
    with pytest.raises(I.OverQuota, match="--quota-reserve"):   # holds 4: refused first
        ix.lease("m", 0, [k(0)], sessions[0])
    for _ in range(2):       # a session holding little gets its share of the reserve ...
        ix.lease("m", 0, [k(0)], sessions[3])
    with pytest.raises(I.OverQuota, match="--quota-reserve"):   # ... and no more
        ix.lease("m", 0, [k(0)], sessions[3])
    for _ in range(2):       # so does the next one: 16, the total
        ix.lease("m", 0, [k(0)], sessions[4])
    with pytest.raises(I.OverQuota, match="--max-leases-total"):
        ix.lease("m", 0, [k(0)], sessions[5])
    # six sessions lease one object: the pool's total counts its slot once
    assert ix.pending.quota.total.lease_bytes == CH
