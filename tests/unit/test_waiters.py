"""Parked lookups in-process: bounds per client and in total, drop_client, deadlines, re-park."""
from __future__ import annotations

import pytest

from kvedit import protocol as P
from kvedit.server.waiters import TooManyWaits, Waiter, Waiters

A, B = b"a" * 16, b"b" * 16


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def waiter(holder: bytes, keys, deadline: float, sock: int = 0) -> Waiter:
    req = P.Lookup(model="m", keys=list(keys), wait_timeout=deadline)
    return Waiter(holder + sock.to_bytes(4, "big"), b"r", req, deadline, holder=holder)


def test_bounds_per_client_and_in_total():
    ws = Waiters(max_per_client=3, max_total=5)
    for i in range(3):
        ws.add(waiter(A, [k(i)], 10.0, sock=i), 0)    # three sockets of one session
    with pytest.raises(TooManyWaits) as e:
        ws.add(waiter(A, [k(9)], 10.0), 0)
    assert e.value.code == "too_many_waits" and "3" in e.value.message
    ws.add(waiter(B, [k(0)], 10.0), 0)
    ws.add(waiter(B, [k(1)], 10.0), 0)
    with pytest.raises(TooManyWaits) as e:            # B is under its own bound, the total is not
        ws.add(waiter(B, [k(2)], 10.0), 0)
    assert "5" in e.value.message
    assert len(ws) == 5 and ws.count(A) == 3 and ws.count(B) == 2
    assert [w.holder for w in ws.take(("m", 0, k(0)))] == [A, B]   # answered: room again
    assert len(ws) == 3 and ws.count(A) == 2
    ws.add(waiter(A, [k(8)], 10.0), 0)


def test_bound_on_parked_keys():
    ws = Waiters(max_keys=10)
    ws.add(waiter(A, [k(i) for i in range(6)], 10.0), 0)
    with pytest.raises(TooManyWaits) as e:
        ws.add(waiter(B, [k(i) for i in range(5)], 10.0), 0)
    assert "keys" in e.value.message and ws.keys == 6
    ws.add(waiter(B, [k(i) for i in range(4)], 10.0), 0)
    wa, wb = ws.take(("m", 0, k(0)))               # both were parked on k(0)
    assert ws.keys == 0 and len(ws) == 0
    ws.park(wa, 1)                                 # re-parked: counted again
    assert ws.keys == 6


def test_a_waiter_without_a_holder_counts_under_its_socket():
    w = Waiter(b"sock-1", b"r", P.Lookup(model="m", keys=[k(0)], wait_timeout=1.0), 1.0)
    assert w.holder == b"sock-1"


def test_drop_client_removes_only_that_clients_lookups():
    ws = Waiters()
    wa = [waiter(A, [k(i), k(i + 1)], 10.0 + i) for i in range(4)]
    wb = waiter(B, [k(0)], 5.0)
    for w in wa:
        ws.add(w, 0)
    ws.add(wb, 0)
    assert ws.keys == 9
    assert ws.drop_client(A) == wa and ws.drop_client(A) == []
    assert len(ws) == 1 and ws.count(A) == 0 and ws.keys == 1
    assert ws.take(("m", 0, k(0))) == [wb]
    assert ws.take(("m", 0, k(1))) == []             # A's were unparked everywhere
    assert ws.next_deadline() is None and ws.expired(100.0) == []


def test_deadlines_in_order_and_re_park_keeps_the_deadline():
    ws = Waiters()
    w1 = waiter(A, [k(0), k(1), k(2)], 30.0)
    w2 = waiter(B, [k(5)], 20.0)
    ws.add(w1, 0)
    ws.add(w2, 0)
    assert ws.next_deadline() == 20.0
    # k(0) became ready: w1 is woken, counts again and parks on its next missing key
    (w,) = ws.take(("m", 0, k(0)))
    assert w is w1 and w1.parked_on is None and len(ws) == 1
    ws.park(w1, 1)
    assert w1.parked_on == ("m", 0, k(1)) and len(ws) == 2
    assert ws.expired(19.9) == []
    assert ws.expired(20.0) == [w2]
    assert ws.next_deadline() == 30.0 and ws.expired(31.0) == [w1]
    assert len(ws) == 0 and ws.take(("m", 0, k(1))) == []


def test_many_waiters_on_one_key_are_woken_once():
    ws = Waiters()
    many = [waiter(A, [k(7)], 50.0, sock=i) for i in range(100)]
    for w in many:
        ws.add(w, 0)
    assert ws.take(("m", 0, k(7))) == many and ws.take(("m", 0, k(7))) == []
    assert len(ws) == 0 and ws.next_deadline() is None


def test_answered_waiters_do_not_grow_the_deadline_heap():
    ws = Waiters()
    for i in range(20_000):     # each parked, then answered by a commit long before its deadline
        ws.add(waiter(A, [k(i)], 1e9 + i), 0)
        ws.take(("m", 0, k(i)))
    assert len(ws) == 0 and len(ws._deadlines) <= 1024 + 1
    w = waiter(A, [k(1), k(2)], 5.0)
    ws.add(w, 0)
    ws.take(("m", 0, k(1)))
    ws.next_deadline()          # drops w's entry while it is taken ...
    ws.park(w, 1)               # ... so re-parking gives it one again
    assert ws.expired(6.0) == [w]


def test_packed_keys_read_like_the_list_they_replace():
    from kvedit.server.waiters import PackedKeys
    keys = [b"a", b"bb" * 8, b"", b"c" * 64, b"d"]
    packed = PackedKeys(keys)
    assert len(packed) == 5 and list(packed) == keys
    assert [packed[i] for i in range(5)] == keys and packed[-1] == b"d"
    assert packed[1:4] == keys[1:4] and packed[3:] == keys[3:]
