"""Queries objects in the index, in-process: replace while leased or being written, their own
key space, and the query counters through every way an object leaves (delete, replace,
eviction, clear, unregister, expiry)."""
from __future__ import annotations

from kvedit.server.index import Index
from kvedit.server.pool import ALIGN, Allocator

START = 4096
A, B = b"a" * 16, b"b" * 16
K = b"q" * 16


def make(pages: int = 8, policy: str = "LRU") -> Index:
    return Index(Allocator(START, pages * ALIGN), policy, 10.0, 10.0, quarantine_ttl=40.0)


def put(ix: Index, key: bytes, nbytes: int, holder: bytes = A, kind: str = "queries"):
    p = ix.prepare("m", 0, [key], nbytes, holder, kind=kind)
    ix.commit(p.store_id, holder)
    return p


def consistent(ix: Index) -> None:
    """The query counters equal what the tables hold; pool bytes add up."""
    c = ix.counters
    ready_q = [o for o in ix.queries.values() if o.state == "ready"]
    assert c.query_objects == len(ready_q)
    assert c.query_bytes == sum(o.nbytes for o in ready_q)
    assert c.objects == len(ix.objects) + len(ix.queries)
    assert c.pool_used + c.pool_free == c.pool_bytes
    assert c.pool_used == ix.alloc.used


def test_replace_while_leased_keeps_the_old_slot_until_release():
    ix = make()
    old = put(ix, K, 100)
    lease = ix.lease("m", 0, [K], B, "queries")
    assert lease.offsets == old.offsets
    new = put(ix, K, 3 * ALIGN)      # replace with another size while B reads the old one
    assert new.missing == [0] and new.offsets != old.offsets
    consistent(ix)
    assert ix.counters.query_bytes == 3 * ALIGN and ix.alloc.used == 4 * ALIGN
    ix.release(lease.lease_id, B)    # now the old slot is freed
    assert ix.alloc.used == 3 * ALIGN
    assert ix.lease("m", 0, [K], A, "queries").offsets == new.offsets
    consistent(ix)


def test_replace_of_a_key_being_written_reports_it_present():
    ix = make()
    first = ix.prepare("m", 0, [K], 100, A, kind="queries")
    second = ix.prepare("m", 0, [K], 100, B, kind="queries")
    assert (second.missing, second.present) == ([], 1)
    ix.commit(second.store_id, B)
    ix.commit(first.store_id, A)
    assert ix.leading_ready("m", 0, [K], "queries") == 1
    consistent(ix)


def test_kinds_are_separate_key_spaces():
    ix = make()
    put(ix, K, ALIGN, kind="kv")
    put(ix, K, 200)
    assert ix.leading_ready("m", 0, [K]) == 1 and ix.leading_ready("m", 0, [K], "queries") == 1
    assert ix.delete("m", 0, [K], "queries") == 1
    assert ix.leading_ready("m", 0, [K]) == 1 and ix.leading_ready("m", 0, [K], "queries") == 0
    assert [e.kind for e in ix.page(None, None, 10).items] == ["kv"]
    consistent(ix)


def test_counters_through_eviction_clear_and_unregister():
    ix = make(pages=4)
    for i in range(4):
        put(ix, bytes([i]) * 16, ALIGN - i)          # 4 one-page queries objects: pool full
    assert ix.counters.query_objects == 4
    put(ix, b"k" * 16, ALIGN, kind="kv")              # evicts the oldest queries object
    assert ix.counters.evictions == 1 and ix.leading_ready("m", 0, [bytes([0]) * 16],
                                                           "queries") == 0
    consistent(ix)
    items = ix.page("m", None, 10).items
    assert sorted(e.kind for e in items) == ["kv", "queries", "queries", "queries"]
    assert ix.clear("m") == 4
    assert ix.counters.query_objects == 0 and ix.counters.query_bytes == 0
    consistent(ix)
    put(ix, K, 50)
    assert ix.drop_model("m", 0) == 1
    consistent(ix)


def test_expired_queries_store_is_quarantined_and_uncounted():
    clock = [1000.0]
    ix = Index(Allocator(START, 4 * ALIGN), "LRU", 10.0, 10.0, quarantine_ttl=40.0,
               clock=lambda: clock[0])
    ix.prepare("m", 0, [K], 100, A, kind="queries")
    clock[0] += 11
    assert ix.expire(clock[0]).stores == 1
    assert ix.leading_ready("m", 0, [K], "queries") == 0 and not ix.queries
    assert ix.counters.quarantined_objects == 1
    consistent(ix)
    clock[0] += 41
    ix.expire(clock[0])
    assert ix.alloc.used == 0
    consistent(ix)
