"""Round trips through a real server, in shared-memory and in socket mode."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvedit.client import KVClient, KVError
from kvedit.keys import request_keys
from kvedit.layout import ModelLayout, RopeParams

LAYOUT = ModelLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_size=256,
                     rope=RopeParams(theta=1e6, rotary_dim=64))
MODEL = "roundtrip-model"


@pytest.fixture(params=["shm", "socket"])
def client(request, kv_server):
    with KVClient(kv_server.url, use_shm=request.param == "shm") as c:
        assert c.transfer_mode == request.param
        c.register(MODEL, LAYOUT)
        yield c


def _chunks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *LAYOUT.chunk_shape, generator=g).to(torch.bfloat16)


def _keys(n_tokens: int, salt: str) -> list[bytes]:
    return request_keys(MODEL, LAYOUT, list(range(n_tokens)), cache_salt=salt)


def test_store_lookup_retrieve_delete(client, request):
    keys = _keys(5 * 256 + 17, request.node.name)
    assert len(keys) == 5
    data = _chunks(5, 1)
    assert client.lookup(MODEL, keys) == 0
    assert client.store(MODEL, keys[:2], data[:2]).stored == 2
    res = client.store(MODEL, keys, list(data))
    assert (res.stored, res.present) == (3, 2)
    assert client.lookup(MODEL, keys) == 5
    with client.retrieve(MODEL, keys) as got:
        assert len(got.tensors) == 5
        for a, b in zip(got.tensors, data):
            assert a.shape == LAYOUT.chunk_shape and a.dtype == torch.bfloat16
            assert torch.equal(a, b)
    assert client.delete(MODEL, keys[3:4]) == 1
    assert client.lookup(MODEL, keys) == 3
    with client.retrieve(MODEL, keys) as got:  # leading keys only
        assert len(got.tensors) == 3
        assert torch.equal(got.tensors[2], data[2])


def test_prepare_store_handle(client, request):
    keys = _keys(3 * 256, request.node.name)
    data = _chunks(3, 2)
    client.store(MODEL, keys[1:2], data[1:2])
    with client.prepare_store(MODEL, keys) as h:
        assert h.missing == [0, 2]
        assert client.lookup(MODEL, keys[:1]) == 0  # being written: invisible
        for buf, i in zip(h.buffers, h.missing):
            buf.copy_(data[i])
    assert client.lookup(MODEL, keys) == 3
    with client.retrieve(MODEL, keys) as got:
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, data))
    # an exception inside the block aborts: nothing becomes visible
    more = _keys(4 * 256, request.node.name + "x")
    with pytest.raises(RuntimeError):
        with client.prepare_store(MODEL, more) as h:
            raise RuntimeError("boom")
    assert client.lookup(MODEL, more) == 0


def test_layout_registry(client):
    assert client.get_layout(MODEL) == LAYOUT
    assert client.get_layout("never-registered") is None
    assert LAYOUT in client.list_models()[MODEL]
    client.register(MODEL, LAYOUT)  # idempotent
    with pytest.raises(KVError) as e:
        client.register(MODEL, ModelLayout(num_layers=5, num_kv_heads=2, head_dim=64,
                                           dtype="bfloat16", chunk_size=256))
    assert e.value.code == "layout_conflict"


def test_bad_chunk_is_refused_and_aborted(client, request):
    keys = _keys(2 * 256, request.node.name)
    with pytest.raises(KVError) as e:
        client.store(MODEL, keys, [_chunks(1, 0)[0], torch.zeros(3)])
    assert e.value.code == "bad_chunk" and "chunk 1" in str(e.value)
    with pytest.raises(KVError) as e:
        client.store(MODEL, keys, _chunks(2, 0).float())
    assert "bfloat16" in str(e.value)
    assert client.lookup(MODEL, keys) == 0
    assert client.stats()["pending_stores"] == 0


def test_wait_lookup_is_answered_by_commit(client, request):
    """A server-side wait returns when another thread commits, without blocking that thread."""
    keys = _keys(2 * 256, request.node.name)
    result = {}

    def waiter():
        t0 = time.monotonic()
        result["n"] = client.lookup(MODEL, keys, wait_timeout=20.0)
        result["dt"] = time.monotonic() - t0

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.3)  # let the waiter park on the server
    client.store(MODEL, keys, _chunks(2, 3))  # same client, other thread: not blocked
    th.join(10)
    assert result["n"] == 2 and result["dt"] < 10
    t0 = time.monotonic()
    assert client.lookup(MODEL, keys + _keys(3 * 256, "absent")[2:], wait_timeout=0.3) == 2
    assert 0.25 < time.monotonic() - t0 < 5
    assert client.stats()["waiting_lookups"] == 0  # the timed-out waiter is gone
