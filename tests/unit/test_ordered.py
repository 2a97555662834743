"""SortedInts (the index's eviction orders and cache pages) against a plain sorted list."""
from __future__ import annotations

from bisect import bisect_right

from hypothesis import given, settings, strategies as st

from kvedit.server import ordered
from kvedit.server.ordered import SortedInts

program = st.lists(st.tuples(st.sampled_from(["add", "append", "discard", "after"]),
                             st.integers(0, 400)), max_size=400)


@settings(max_examples=200, deadline=None)
@given(program)
def test_against_a_sorted_list(ops):
    old = ordered._BLOCK
    ordered._BLOCK = 4           # tiny blocks: splits and empty blocks happen all the time
    try:
        s, ref = SortedInts(), []
        for op, x in ops:
            if op == "append":   # the common case in the index: a new largest number
                x = (ref[-1] + 1 + x) if ref else x
            if op in ("add", "append") and x not in ref:
                s.add(x)
                ref.insert(bisect_right(ref, x), x)
            elif op == "discard":
                assert s.discard(x) == (x in ref)
                if x in ref:
                    ref.remove(x)
            elif op == "after":
                assert list(s.after(x)) == [v for v in ref if v > x]
            assert len(s) == len(ref) and bool(s) == bool(ref)
            assert s.first() == (ref[0] if ref else None)
            assert list(s.after(None)) == ref
            assert all(b and b[-1] == m for b, m in zip(s._blocks, s._maxes))
    finally:
        ordered._BLOCK = old


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=200), st.lists(st.integers(0, 600), max_size=200),
       st.lists(st.integers(0, 300), max_size=200))
def test_batch_update_and_discard_many(first, more, gone):
    old = ordered._BLOCK
    ordered._BLOCK = 4
    try:
        s = SortedInts()
        s.update(sorted(set(first)))
        ref = sorted(set(first))
        add = sorted(set(more) - set(ref))
        s.update(add)
        ref = sorted(set(ref) | set(add))
        rm = sorted(set(gone) & set(ref))
        s.discard_many(rm)
        ref = [v for v in ref if v not in set(rm)]
        assert list(s.after(None)) == ref and len(s) == len(ref)
        assert all(b and b[-1] == m for b, m in zip(s._blocks, s._maxes))
        assert s._maxes == sorted(s._maxes)
    finally:
        ordered._BLOCK = old
