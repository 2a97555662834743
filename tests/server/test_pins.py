"""Pins against a real kvedit server: a pinned chunk survives stores that evict everything
else, and `Pins` lets go of it exactly when it should (the loading step's output, the
request's end, its deadline), never holds more than its bound, and turns a refused pin into
an unpinned hit. Also the connector's store-mode settings and the reuse tracker."""
from __future__ import annotations

import os

import pytest
import torch

from kvedit.client import KVClient, KVError
from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout
from kvedit.vllm.settings import ConnectorSettings
from kvedit.vllm.transfer.admission import SeenKeys
from kvedit.vllm.transfer.pins import Pins

LAYOUT = ModelLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype="float32", chunk_size=256)
POOL = 6   # chunks


def _keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def _fill(c, n: int) -> None:
    zeros = torch.zeros(LAYOUT.chunk_shape)
    for k in _keys(n):
        try:
            c.store("m", [k], [zeros])
        except KVError as e:
            assert e.code == "pool_full"


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def client():
    with start_server(POOL * LAYOUT.chunk_bytes / 2**30, chunk_size=256) as s, \
            KVClient(s.url) as c:
        c.register("m", LAYOUT)
        yield c


def test_a_pinned_chunk_survives_a_flood_and_is_evictable_after_unpin(client):
    hit = _keys(2)
    client.store("m", hit, [torch.ones(LAYOUT.chunk_shape)] * 2)
    lease, n = client.pin("m", hit + _keys(1))
    assert n == 2
    _fill(client, 3 * POOL)
    assert client.lookup("m", hit) == 2 and client.stats()["evictions"] > 0
    client.unpin(lease)
    client.unpin(lease)   # twice: already gone is not an error
    _fill(client, 3 * POOL)
    assert client.lookup("m", hit) == 0


def test_pins_release_at_the_loading_steps_output_end_or_deadline(client):
    clock = Clock()
    pins = Pins(max_chunks=4, ttl_s=10.0, clock=clock)
    a, b, c = _keys(2), _keys(1), _keys(1)
    client.store("m", a + b + c, [torch.ones(LAYOUT.chunk_shape)] * 4)
    assert pins.pin(client, "m", "A", [a], 2) == 2
    assert pins.pin(client, "m", "B", [b], 1) == 1
    assert pins.pin(client, "m", "C", [c], 1) == 1 and pins.chunks == 4
    assert pins.pin(client, "m", "D", [_keys(1)], 1) is None   # over the bound: unpinned
    assert client.stats()["leases"] == 3
    pins.loading("A", step=0)
    pins.step_done(client)                 # output of step 0: A's load ran
    assert "A" not in pins.held and pins.chunks == 2
    pins.loading("B", step=5)
    pins.step_done(client)                 # step 1's output: B (step 5) still loading
    assert "B" in pins.held
    pins.release(client, "B")              # the request ended
    clock.t = 11.0
    pins.expire(client)                    # C never loaded: its deadline
    assert not pins.held and pins.chunks == 0 and pins.stats.expired == 1
    assert client.stats()["leases"] == 0


def test_a_pin_that_finds_fewer_chunks_says_so_and_a_refused_pin_is_unpinned(client):
    pins = Pins(max_chunks=100, ttl_s=10.0)
    k = _keys(3)
    client.store("m", k[:1], [torch.ones(LAYOUT.chunk_shape)])
    assert pins.pin(client, "m", "A", [k], 3) == 1 and pins.stats.shorter == 1
    assert pins.pin(client, "m", "B", [k], 1, ) == 1
    assert pins.pin(client, "nope", "C", [k], 1) is None     # unknown model: refused
    assert pins.stats.unpinned == 1
    assert Pins(max_chunks=0, ttl_s=1.0).pin(client, "m", "D", [k], 1) is None   # off


def test_store_mode_and_pin_settings_are_checked_by_name():
    assert ConnectorSettings.from_extra({}).transfer.store == "evict"
    assert ConnectorSettings.from_extra({"store": "reuse"}).transfer.store == "reuse"
    for extra, msg in (({"store": "lazy"}, "store 'lazy'; expected one of ['eager', "
                                           "'evict', 'reuse']"),
                       ({"pin_max_chunks": -1}, "pin_max_chunks -1; expected a chunk count"),
                       ({"pin_ttl_s": 0}, "pin_ttl_s 0; expected seconds > 0")):
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            ConnectorSettings.from_extra(extra)


def test_seen_keys_count_a_leading_run_and_stay_bounded():
    seen = SeenKeys(max_keys=4)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    seen.sight([a, b])
    assert seen.leading([a, b], 2) == 0
    seen.sight([a, b, c])
    assert seen.leading([a, b, c], 2) == 2 and seen.leading([a, b, c], 1) == 3
    seen.sight([os.urandom(16) for _ in range(4)])   # pushes a, b, c out
    assert seen.leading([a], 1) == 0
