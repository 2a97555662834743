"""The HTTP listener's per-peer rate of new connections (kvedit/server/http_accept.py)."""
from __future__ import annotations

from kvedit.server import http_accept
from kvedit.server.http_accept import ConnRate

OWN = ("uid", 1000)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_peer_gets_a_second_s_worth_then_the_rate():
    clock = Clock()
    rate = ConnRate(10, OWN, clock)
    peer = ("addr", "10.0.0.7")
    assert [rate.admit(peer) for _ in range(12)] == [True] * 10 + [False] * 2
    clock.t += 0.25                       # 2.5 tokens back
    assert [rate.admit(peer) for _ in range(3)] == [True, True, False]
    assert rate.shed == 3
    assert rate.admit(("addr", "10.0.0.8"))   # another peer has its own bucket


def test_the_own_user_is_never_shed():
    rate = ConnRate(1, OWN, Clock())
    assert all(rate.admit(OWN) for _ in range(100)) and rate.shed == 0


def test_peers_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(http_accept, "MAX_BUCKETS", 4)
    clock = Clock()
    rate = ConnRate(2, OWN, clock)
    for i in range(4):
        rate.admit(("addr", f"10.0.0.{i}"))
    rate.admit(("addr", "10.0.0.9"))      # all busy: the one seen longest ago goes
    assert len(rate.buckets) == 4 and ("addr", "10.0.0.0") not in rate.buckets
    clock.t += 5                          # every bucket full again: all forgotten at once
    rate.admit(("addr", "10.0.1.1"))
    assert list(rate.buckets) == [("addr", "10.0.1.1")]
