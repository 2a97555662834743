"""The pool allocator in-process: best fit, coalescing with several object sizes, and a
property test against a plain reference model (a list of allocated intervals)."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from kvedit.server.index import Index
from kvedit.server.pool import ALIGN, Allocator

START = 4096   # the pool starts after the segment header, as in a real Arena


def _gaps(allocated: dict[int, int], start: int, capacity: int) -> list[tuple[int, int]]:
    """The free ranges implied by the allocated intervals (reference model)."""
    out, pos = [], start
    for s, n in sorted(allocated.items()):
        if s > pos:
            out.append((pos, s - pos))
        pos = s + n
    if pos < start + capacity:
        out.append((pos, start + capacity - pos))
    return out


def test_rounding_and_exact_use():
    a = Allocator(START, 10 * ALIGN)
    x = a.alloc(1)
    assert x == START and a.used == ALIGN
    y = a.alloc(ALIGN + 1)
    assert y == START + ALIGN and a.used == 3 * ALIGN
    assert a.alloc(8 * ALIGN) is None        # 7 pages left
    assert a.alloc(7 * ALIGN) == START + 3 * ALIGN
    assert a.used == a.capacity and a.largest_free() == 0


def test_coalescing_with_several_sizes_back_to_one_range():
    sizes = [1 * ALIGN, 3 * ALIGN, 9 * ALIGN]      # three layouts' chunk sizes
    cap = 400 * ALIGN
    a = Allocator(START, cap)
    rng = random.Random(7)
    live = []
    while True:
        n = rng.choice(sizes)
        off = a.alloc(n)
        if off is None:
            break
        live.append((off, n))
    assert a.used == sum(n for _, n in live) and a.capacity - a.used < max(sizes)
    rng.shuffle(live)
    for i, (off, n) in enumerate(live):
        a.free(off, n)
        assert a.ranges() == _gaps(dict(live[i + 1:]), START, cap)   # neighbours merged
    assert a.ranges() == [(START, cap)] and a.used == 0 and a.holes == 1


def test_best_fit_keeps_large_holes_for_large_objects():
    small, large = ALIGN, 9 * ALIGN
    a = Allocator(START, 40 * ALIGN)
    objs = [(a.alloc(n), n) for n in (small, large, small, large, small, large, small)]
    assert all(off is not None for off, _ in objs)
    rest = a.alloc(a.capacity - a.used)            # fill the tail too
    for off, n in (objs[1], objs[4]):              # one large hole, one small hole
        a.free(off, n)
    assert sorted(size for _, size in a.ranges()) == [small, large]
    # first fit would split the large hole (lower address); best fit takes the small one
    assert a.alloc(small) == objs[4][0]
    assert a.alloc(large) == objs[1][0]
    assert a.alloc(small) is None and rest is not None


def test_many_holes_alloc_finds_the_fitting_one():
    """300 one-page holes and one 2-page hole: an 8 KiB alloc takes the 2-page hole."""
    a = Allocator(START, 1000 * ALIGN)
    offs = [a.alloc(ALIGN) for _ in range(1000)]
    for off in offs[:600:2]:                       # 300 isolated one-page holes
        a.free(off, ALIGN)
    a.free(offs[700], ALIGN)
    a.free(offs[701], ALIGN)                       # one 2-page hole
    assert a.holes == 301
    assert a.alloc(2 * ALIGN) == offs[700]
    assert a.alloc(2 * ALIGN) is None              # no free range of 2 pages is left


ops = st.lists(st.tuples(st.booleans(), st.integers(0, 10_000), st.sampled_from([1, 2, 3, 7, 9])),
               min_size=1, max_size=300)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_property_against_reference_model(program):
    cap = 64 * ALIGN
    a = Allocator(START, cap)
    allocated: dict[int, int] = {}     # reference: start -> rounded size
    for is_alloc, pick, pages in program:
        if is_alloc or not allocated:
            n = pages * ALIGN - (pick % ALIGN)     # not page-aligned requests too
            fits = any(size >= pages * ALIGN for _, size in _gaps(allocated, START, cap))
            off = a.alloc(n)
            assert (off is not None) == fits       # None only when no free range fits
            if off is not None:
                end = off + pages * ALIGN
                assert START <= off and end <= START + cap and off % ALIGN == 0
                assert all(end <= s or s + size <= off for s, size in allocated.items())
                allocated[off] = pages * ALIGN
        else:
            off = sorted(allocated)[pick % len(allocated)]
            a.free(off, allocated.pop(off))
        assert a.used == sum(allocated.values())
        assert a.ranges() == _gaps(allocated, START, cap)   # coalesced: no two free ranges touch
        assert a.largest_free() == max((s for _, s in a.ranges()), default=0)
    for off, n in list(allocated.items()):
        a.free(off, n)
    assert a.ranges() == [(START, cap)] and a.used == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 3, 9]), st.integers(0, 2**31)), min_size=1,
                max_size=200),
       st.sampled_from(["LRU", "FIFO"]))
def test_index_never_evicts_while_a_fitting_range_is_free(program, policy):
    """Two-plus object sizes in one pool: a store evicts only when no free range fits it."""
    a = Allocator(START, 48 * ALIGN)
    ix = Index(a, policy, lease_ttl=10.0, write_ttl=10.0)
    h = b"h" * 16
    for i, (pages, r) in enumerate(program):
        nbytes = pages * ALIGN
        model = f"m{pages}"
        if r % 4 == 0 and ix.counters.ready:       # sometimes delete an old object
            entry = ix.page(None, None, 1).items[0]
            ix.delete(entry.model, entry.tp_rank, [entry.key])
            continue
        fits = a.largest_free() >= nbytes
        before = ix.counters.evictions
        p = ix.prepare(model, 0, [i.to_bytes(4, "big")], nbytes, h)
        ix.commit(p.store_id, h)
        if fits:
            assert ix.counters.evictions == before
        else:
            assert ix.counters.evictions > before


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 30), st.integers(0, 10_000)),
                min_size=1, max_size=60))
def test_alloc_many_is_many_allocs(program):
    """alloc_many gives distinct slots, fewer than asked only when no range fits one more."""
    cap = 96 * ALIGN
    a = Allocator(START, cap)
    allocated: dict[int, int] = {}
    for pages, count, pick in program:
        if pick % 3 == 0 and allocated:                # free some
            for off in sorted(allocated)[:: 1 + pick % 4]:
                a.free(off, allocated.pop(off))
            continue
        n = pages * ALIGN
        got = a.alloc_many(n, count)
        assert len(got) <= count and len(set(got)) == len(got)
        for off in got:
            assert all(off + n <= s or s + size <= off for s, size in allocated.items())
            allocated[off] = n
        if len(got) < count:
            assert a.largest_free() < n
        assert a.used == sum(allocated.values())
        assert a.ranges() == _gaps(allocated, START, cap)
