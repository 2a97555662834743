"""The index's parts on their own: the eviction order (eviction.py), the commit order
(pages.py) and stores/leases in flight (pending.py). test_index.py drives them together
through the Index facade; these pin down the contract each part offers the facade."""
from __future__ import annotations

import pytest

from kvedit.server.eviction import EvictionOrder
from kvedit.server.index_types import (
    READY, Busy, Counters, LeaseExpired, NotHolder, Obj, StoreExpired, UnknownStore)
from kvedit.server.pages import CommitOrder
from kvedit.server.pending import Pendings

A, B = b"a" * 16, b"b" * 16
PAGE = 4096


def ready(key: int, slot: int = PAGE, model: str = "m") -> Obj:
    return Obj(model, 0, key.to_bytes(16, "big"), offset=key * PAGE, nbytes=slot, slot=slot,
               state=READY)


# ---- eviction order --------------------------------------------------------------------
def test_victim_is_the_oldest_that_fits_else_the_oldest_of_all():
    order = EvictionOrder("FIFO")
    small = [ready(i) for i in range(3)]
    large = [ready(10 + i, 4 * PAGE) for i in range(2)]
    order.stamp(small[:1] + large + small[1:])   # ranks: s0, L0, L1, s1, s2
    order.enter(small + large)
    assert len(order) == 5
    assert order.victim(4 * PAGE) is large[0]    # the oldest large one, not s0
    assert order.victim(2 * PAGE) is large[0]    # a large slot takes 2 pages too
    assert order.victim(PAGE) is small[0]        # oldest of the sizes that fit
    order.leave(large)
    assert order.victim(4 * PAGE) is small[0]    # none fits: the oldest of all
    assert not large[0].evictable and small[0].evictable


def test_only_evictable_objects_enter_and_a_left_object_returns_to_its_place():
    order = EvictionOrder("FIFO")
    objs = [ready(i) for i in range(4)]
    order.stamp(objs)
    objs[1].leases, objs[2].pins, objs[3].live = 1, 1, False
    order.enter(objs)
    assert len(order) == 1 and order.victim(PAGE) is objs[0]
    objs[1].leases = 0
    order.enter([objs[1]])
    order.leave([objs[0]])
    order.touch([objs[0]])                       # FIFO: its place stays its commit
    order.enter([objs[0]])
    assert order.victim(PAGE) is objs[0]


def test_lru_touch_moves_to_the_newest_end_and_none_never_names_a_victim():
    lru = EvictionOrder("LRU")
    objs = [ready(i) for i in range(3)]
    lru.stamp(objs)
    lru.touch(objs[:1])
    lru.enter(objs)
    assert lru.victim(PAGE) is objs[1]
    none, other = EvictionOrder("none"), ready(9)
    none.stamp([other])
    none.enter([other])
    assert len(none) == 1 and none.victim(PAGE) is None


# ---- commit order ----------------------------------------------------------------------
def test_commit_order_pages_by_model_and_forgets_removed_objects():
    pages = CommitOrder()
    objs = [ready(i, model="xy"[i // 3 % 2]) for i in range(9)]
    for lo in range(0, 9, 3):                    # three commits of three
        for j, o in enumerate(objs[lo:lo + 3]):
            o.seq = 1 + lo + j
        pages.add(objs[lo:lo + 3])
    assert len(pages) == 9
    assert pages.ready("y") == objs[3:6]
    p = pages.page("x", None, 4)
    assert [e.seq for e in p.items] == [1, 2, 3, 7] and p.next_after == 7 and p.total == 6
    p = pages.page("x", 7, 4)
    assert [e.seq for e in p.items] == [8, 9] and p.next_after is None
    p = pages.page(None, 2, 3)
    assert [e.seq for e in p.items] == [3, 4, 5] and p.next_after == 5 and p.total == 9
    for o in objs[3:6]:
        pages.remove(o)
    assert pages.ready("y") == [] and pages.page("y", None, 5).total == 0
    assert len(pages) == 6 and pages.ready() == objs[:3] + objs[6:]


# ---- stores and leases in flight ---------------------------------------------------------
class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def pendings(let_go=None):
    clock, counters, freed = Clock(), Counters(), []

    def let_go_default(objs):
        freed.extend(objs)
        return sum(o.slot for o in objs)
    p = Pendings(counters, clock, let_go or let_go_default, lease_ttl=10.0, write_ttl=5.0,
                 quarantine_ttl=20.0, transfer_timeout=30.0)
    return p, clock, counters, freed


def test_deadlines_come_due_in_order_and_a_transfer_replaces_the_ttl():
    pend, clock, c, _ = pendings()
    store = pend.open("store", A, [ready(1)])
    lease = pend.open("lease", B, [ready(2)])
    assert (c.pending_stores, c.leases) == (1, 1) and pend.next_deadline() == 105.0
    pend.begin_transfer("store", store.id, A)
    assert c.transfers == 1 and pend.next_deadline() == 110.0   # the store's TTL is off
    with pytest.raises(Busy):
        pend.idle("store", store.id, A, "busy now")
    assert pend.pop_due(109.0) is None
    due = pend.pop_due(200.0)
    assert (due.what, due.pending) == ("lease", lease)
    pend.expire(lease)
    due = pend.pop_due(200.0)
    assert (due.what, due.pending) == ("transfer", store)      # at its transfer deadline
    pend.cut_transfer(store)
    assert pend.pop_due(200.0) is None and not pend.is_open(store)
    assert (c.expired_leases, c.expired_stores, c.cut_transfers) == (1, 1, 1)
    assert pend.finish_transfer("store", store.id) is store and c.transfers == 0
    assert pend.finish_transfer("store", store.id) is None     # finished once


def test_a_late_call_is_told_why_and_acknowledges_the_quarantine():
    pend, clock, c, freed = pendings()
    objs = [ready(1), ready(2, 3 * PAGE)]
    lease = pend.open("lease", A, objs)
    clock.t += 11
    due = pend.pop_due(clock())
    pend.expire(due.pending)
    pend.quarantine(due.pending, clock())
    assert (c.quarantined_objects, c.quarantined_bytes) == (2, 4 * PAGE)
    assert [o.pins for o in objs] == [1, 1] and freed == []
    with pytest.raises(NotHolder):
        pend.held("lease", lease.id, B)
    assert c.quarantined_objects == 2                           # not B's to acknowledge
    with pytest.raises(LeaseExpired, match="passed its TTL"):
        pend.held("lease", lease.id, A)
    assert freed == objs and [o.pins for o in objs] == [0, 0]
    assert (c.quarantined_objects, c.quarantined_bytes) == (0, 0)
    assert pend.next_deadline() is None                         # its deadline went stale
    with pytest.raises(UnknownStore):
        pend.held("store", 12345, A)


def test_quarantine_ends_at_its_deadline_or_when_the_session_goes():
    pend, clock, c, freed = pendings()
    s1 = pend.open("store", A, [ready(1)])
    s2 = pend.open("store", A, [ready(2)])
    s3 = pend.open("store", B, [ready(3)])
    clock.t += 6
    while (due := pend.pop_due(clock())) is not None:
        pend.expire(due.pending)
        pend.quarantine(due.pending, clock())
    assert c.quarantined_objects == 3 and pend.next_deadline() == clock.t + 20
    assert pend.session_gone(A) == 2 * PAGE
    assert sorted(o.key for o in freed) == [o.key for o in s1.objs + s2.objs]
    with pytest.raises(StoreExpired):                           # still fenced
        pend.held("store", s1.id, A)
    clock.t += 20
    due = pend.pop_due(clock())
    assert (due.what, due.id) == ("quarantine", s3.id)
    assert pend.unquarantine(due.id) == PAGE and freed[-1] is s3.objs[0]
    assert c.quarantined_objects == 0 and pend.next_deadline() is None


def test_a_new_id_is_never_zero_nor_one_in_use_or_remembered(monkeypatch):
    draws = iter([0, 7, 7, 8, 7, 8, 9])
    monkeypatch.setattr("kvedit.server.pending.secrets.randbits", lambda bits: next(draws))
    pend, clock, *_ = pendings()
    first = pend.open("store", A, [])
    assert first.id == 7                          # 0 is skipped
    assert pend.open("lease", A, []).id == 8      # 7 is a live store
    clock.t += 6
    pend.expire(pend.pop_due(clock()).pending)    # store 7 ended: remembered, fenced
    assert pend.open("lease", A, []).id == 9      # not 7 (fenced) nor 8 (live)
