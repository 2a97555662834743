"""Captured-queries objects (kind "queries", issue 10) in a real `kvedit server` process:
byte-exact round trips in shared-memory and socket mode, replace, the size bound, eviction,
their own key space, waiting lookups, /status, /cache, /metrics, delete and unregister."""
from __future__ import annotations

import threading

import httpx
import msgspec
import numpy as np
import pytest
import torch

from kvedit import protocol as P
from kvedit.client import KVClient, KVError
from kvedit.keys import namespace, query_key
from kvedit.layout import ModelLayout
from kvedit.launch.server import start_server
from tests.fixtures_server import close_dealer, dealer
from tests.kv_helpers import SMALL, chunk_for, key

MODEL = "q-model"
MAX_QUERY_BYTES = 300_000


@pytest.fixture(scope="module")
def server():
    # 16 MiB pool: room for a few dozen 256 KiB objects, so eviction is reachable
    with start_server(1 / 64, extra_args=["--max-query-bytes", str(MAX_QUERY_BYTES)]) as s:
        yield s


@pytest.fixture(params=["shm", "socket"])
def client(request, server):
    with KVClient(server.url, use_shm=request.param == "shm") as c:
        assert c.transfer_mode == request.param
        c.register(MODEL, SMALL)
        yield c


def qkey(tag: str, window: int = 32, n: int = 100) -> bytes:
    return query_key(namespace(MODEL, SMALL, tag), list(range(n)), window)


def queries(seed: int, shape=(2, 32, 256), dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def as_tensor(raw: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(raw).view(like.dtype).view(like.shape)


def status(server) -> dict:
    return httpx.get(server.http_url + "/status", timeout=10).json()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_round_trip_is_byte_exact(client, request, dtype):
    k = qkey(request.node.name)
    q = queries(1, (4, 7, 3 * 64), dtype)   # an odd row count: no size is assumed
    client.store_queries(MODEL, k, q)
    got = client.fetch_queries(MODEL, k)
    assert got.dtype == np.uint8 and got.shape == (q.numel() * q.element_size(),)
    assert got.tobytes() == q.view(-1).view(torch.uint8).numpy().tobytes()
    assert torch.equal(as_tensor(got, q), q)


def test_non_contiguous_input_is_stored_as_its_values(client, request):
    k = qkey(request.node.name)
    q = queries(2, (32, 2, 256)).transpose(0, 1)   # [2, 32, 256], not contiguous
    assert not q.is_contiguous()
    client.store_queries(MODEL, k, q)
    assert torch.equal(as_tensor(client.fetch_queries(MODEL, k), q), q)


def test_store_replaces_even_with_another_size(client, request):
    k = qkey(request.node.name)
    client.store_queries(MODEL, k, queries(3))
    newer = queries(4, (2, 5, 256))
    client.store_queries(MODEL, k, newer)
    got = client.fetch_queries(MODEL, k)
    assert got.nbytes == newer.numel() * 2 and torch.equal(as_tensor(got, newer), newer)


def test_absent_key_is_none_and_delete_counts(client, request):
    k = qkey(request.node.name)
    assert client.fetch_queries(MODEL, k) is None
    assert client.delete_queries(MODEL, [k]) == 0
    client.store_queries(MODEL, k, queries(5))
    assert client.delete_queries(MODEL, [k, qkey("never-stored")]) == 1
    assert client.fetch_queries(MODEL, k) is None
    assert client.lookup(MODEL, [k], kind="queries") == 0


def test_size_bound_refused_with_the_flag_named(client, request, server):
    before = status(server)["queries"]
    too_big = torch.zeros(MAX_QUERY_BYTES + 1, dtype=torch.uint8)
    with pytest.raises(KVError) as e:
        client.store_queries(MODEL, qkey(request.node.name), too_big)
    assert e.value.code == "too_large"
    assert "--max-query-bytes" in e.value.message and str(MAX_QUERY_BYTES) in e.value.message
    assert status(server)["queries"] == before   # nothing allocated or kept
    # exactly at the bound is fine
    client.store_queries(MODEL, qkey(request.node.name), torch.ones(MAX_QUERY_BYTES,
                                                                    dtype=torch.uint8))
    assert client.delete_queries(MODEL, [qkey(request.node.name)]) == 1


def test_bad_input_is_refused_clearly(client, request):
    with pytest.raises(KVError) as e:
        client.store_queries(MODEL, qkey(request.node.name), torch.zeros(0))
    assert e.value.code == "bad_chunk" and "non-empty" in e.value.message
    with pytest.raises(KVError) as e:
        client.store_queries("not-registered", qkey(request.node.name), queries(6))
    assert e.value.code == "unknown_model"


def test_raw_protocol_refusals(server):
    """What a client that bypasses KVClient's checks gets: the reason and what is expected."""
    with KVClient(server.url) as c:
        c.register(MODEL, SMALL)
    s = dealer(server.url)
    try:
        def ask(msg):
            s.send_multipart([b"1", P.encoder.encode(msg)])
            return P.reply_decoder.decode(s.recv_multipart()[1])

        r = ask(P.PrepareStore(model=MODEL, keys=[b"a" * 16, b"b" * 16], kind="queries",
                               nbytes=10))
        assert (r.code, "exactly one key" in r.message) == ("malformed", True)
        r = ask(P.PrepareStore(model=MODEL, keys=[b"a" * 16], kind="queries"))   # nbytes 0
        assert r.code == "malformed" and "1.." in r.message
        r = ask(P.PrepareStore(model=MODEL, keys=[b"a" * 16], nbytes=10))   # kind kv
        assert r.code == "malformed" and "kind 'queries' only" in r.message
        s.send_multipart([b"1", msgspec.msgpack.encode(
            {"t": "prepare_store", "model": MODEL, "keys": [b"a" * 16], "kind": "weights"})])
        r = P.reply_decoder.decode(s.recv_multipart()[1])
        assert r.code == "malformed" and "kind" in r.message
    finally:
        close_dealer(s)


def test_kinds_have_separate_key_spaces(client, request):
    """The same key bytes name a kv chunk and a queries object independently."""
    k = key(0, request.node.name)
    chunk = chunk_for(k)
    client.store(MODEL, [k], [chunk])
    q = queries(7)
    client.store_queries(MODEL, k, q)
    assert client.lookup(MODEL, [k]) == 1 and client.lookup(MODEL, [k], kind="queries") == 1
    with client.retrieve(MODEL, [k]) as got:
        assert torch.equal(got.tensors[0], chunk)   # the chunk was not replaced
    assert client.delete(MODEL, [k]) == 1            # kind kv: leaves the queries object
    assert torch.equal(as_tensor(client.fetch_queries(MODEL, k), q), q)
    assert client.delete_queries(MODEL, [k]) == 1


def test_waiting_lookup_is_answered_by_the_store(client, request, server):
    k = qkey(request.node.name)
    stored = threading.Event()

    def later():
        with KVClient(server.url) as other:
            stored.wait(5)
            other.store_queries(MODEL, k, queries(8))

    t = threading.Thread(target=later)
    t.start()
    try:
        stored.set()
        assert client.lookup(MODEL, [k], wait_timeout=30, kind="queries") == 1
    finally:
        t.join()
    assert client.lookup(MODEL, [k], kind="kv") == 0   # a kv lookup of that key: none
    client.delete_queries(MODEL, [k])


def test_status_cache_and_metrics_list_queries(server, request):
    with KVClient(server.url) as c:
        c.register(MODEL, SMALL)
        before = status(server)
        ks = [qkey(f"{request.node.name}/{i}") for i in range(3)]
        qs = [queries(10 + i, (2, 10 + i, 128)) for i in range(3)]
        for k, q in zip(ks, qs):
            c.store_queries(MODEL, k, q)
        kv_key = key(1, request.node.name)
        c.store(MODEL, [kv_key], [chunk_for(kv_key)])
        after = status(server)
        sizes = [q.numel() * 2 for q in qs]
        assert after["queries"]["objects"] - before["queries"]["objects"] == 3
        assert after["queries"]["bytes"] - before["queries"]["bytes"] == sum(sizes)
        assert after["objects"]["ready"] - before["objects"]["ready"] == 4
        assert after["counters"]["query_objects"] == after["queries"]["objects"]
        page = httpx.get(server.http_url + "/cache", params={"model": MODEL, "limit": 1000},
                         timeout=10).json()
        listed = {i["key"]: i for i in page["items"]}
        for k, n in zip(ks, sizes):
            assert listed[k.hex()]["kind"] == "queries" and listed[k.hex()]["bytes"] == n
        assert listed[kv_key.hex()]["kind"] == "kv"
        assert listed[kv_key.hex()]["bytes"] == SMALL.chunk_bytes
        metrics = httpx.get(server.http_url + "/metrics", timeout=10).text
        assert f'kvedit_ready_objects{{kind="queries"}} {after["queries"]["objects"]}.0' \
            in metrics
        assert f'kvedit_query_bytes {after["queries"]["bytes"]}.0' in metrics
        assert c.delete_queries(MODEL, ks) == 3
        c.delete(MODEL, [kv_key])
        assert status(server)["queries"] == before["queries"]


def test_queries_are_evicted_like_other_objects(server, request):
    """LRU across kinds: filling the pool with chunks evicts old queries objects (and the
    other way round); what is left is byte-exact."""
    with KVClient(server.url) as c:
        c.register(MODEL, SMALL)
        pool = status(server)["pool"]["bytes"]
        n_q = 4
        qks = [qkey(f"{request.node.name}/{i}") for i in range(n_q)]
        qs = [queries(20 + i, (2, 64, 1024)) for i in range(n_q)]   # 256 KiB each
        for k, q in zip(qks, qs):
            c.store_queries(MODEL, k, q)
        st0 = status(server)
        ev0 = st0["evictions"]
        # chunks worth the whole pool: every older object has to go
        n_kv = pool // SMALL.chunk_bytes
        kks = [key(i, request.node.name) for i in range(n_kv)]
        for i in range(0, n_kv, 8):
            c.store(MODEL, kks[i:i + 8], [chunk_for(k) for k in kks[i:i + 8]])
        st = status(server)
        assert st["evictions"] - ev0 >= n_q
        assert [c.fetch_queries(MODEL, k) for k in qks] == [None] * n_q
        # (smaller queries objects of other tests may stay: a store evicts objects whose
        # slot fits it first, see Index._evict_one)
        assert st0["queries"]["objects"] - st["queries"]["objects"] == n_q
        assert st0["queries"]["bytes"] - st["queries"]["bytes"] == sum(q.numel() * 2 for q in qs)
        # now queries push chunks out, and survive byte-exact
        c.store_queries(MODEL, qks[0], qs[0])
        assert status(server)["evictions"] > st["evictions"]
        assert torch.equal(as_tensor(c.fetch_queries(MODEL, qks[0]), qs[0]), qs[0])
        c.delete_queries(MODEL, qks)
        c.delete(MODEL, kks)


def test_unregister_deletes_queries_objects(server, request):
    with KVClient(server.url) as c:
        c.register("q-unreg", SMALL)
        k = qkey(request.node.name)
        c.store_queries("q-unreg", k, queries(30))
        assert c._call(P.Unregister(model="q-unreg")).n == 1
        c.register("q-unreg", SMALL)
        assert c.fetch_queries("q-unreg", k) is None


def test_older_peers_still_decode(server):
    """Fields added for queries are left out while at their default (omit_defaults): a kv
    reply has no `sizes`, a kv request encodes no `kind`, so peers that predate them and
    forbid unknown fields keep working."""
    assert b"kind" not in P.encoder.encode(P.Retrieve(model="m", keys=[b"k"]))
    assert b"nbytes" not in P.encoder.encode(P.PrepareStore(model="m", keys=[b"k"]))
    with KVClient(server.url) as c:
        c.register(MODEL, SMALL)
        k = key(2, "older")
        c.store(MODEL, [k], [chunk_for(k)])
    s = dealer(server.url)
    try:
        # a request as an older client encodes it: no kind field at all
        s.send_multipart([b"1", msgspec.msgpack.encode(
            {"t": "retrieve", "model": MODEL, "keys": [k], "tp_rank": 0, "with_data": False})])
        reply = msgspec.msgpack.decode(s.recv_multipart()[1])
        assert reply["t"] == "leased" and reply["count"] == 1 and "sizes" not in reply
        s.send_multipart([b"2", P.encoder.encode(P.Release(lease_id=reply["lease_id"]))])
        assert P.reply_decoder.decode(s.recv_multipart()[1]) == P.Ok()
    finally:
        close_dealer(s)


def test_default_bound_holds_every_window_the_contract_allows():
    """Without --max-query-bytes the bound is MAX_WINDOW rows of the model's queries: with the
    old fixed 256 MiB, KVzip's 4084-row pass of a 4k context on Qwen2.5-1.5B (28 layers x 12
    query heads x 128 x bf16 = 86,016 bytes a row: 351 MB) was refused, and the SDK found no
    queries. Raw prepare/abort: the pool is lazy, nothing is written."""
    from kvedit.query_contract import MAX_WINDOW, QueryShape

    qwen = ModelLayout(num_layers=28, num_kv_heads=2, head_dim=128, dtype="bfloat16",
                       chunk_size=128, num_q_heads=12)
    legacy = ModelLayout(num_layers=28, num_kv_heads=2, head_dim=128, dtype="bfloat16",
                         chunk_size=128)   # registered without its query heads
    full = QueryShape.of(qwen, MAX_WINDOW).nbytes
    assert full == 4096 * 86_016 > 256 << 20
    with start_server(0.5, chunk_size=128) as srv:
        with KVClient(srv.url) as c:
            c.register("qwen", qwen)
            c.register("legacy", legacy)
        s = dealer(srv.url)
        try:
            def ask(msg):
                s.send_multipart([b"1", P.encoder.encode(msg)])
                return P.reply_decoder.decode(s.recv_multipart()[1])

            def prepare(model, nbytes):
                return ask(P.PrepareStore(model=model, keys=[b"q" * 16], kind="queries",
                                          nbytes=nbytes))

            for nbytes in (4084 * 86_016, full):   # the H200 eval's pass, the largest window
                r = prepare("qwen", nbytes)
                assert isinstance(r, P.StoreSlots), r
                assert isinstance(ask(P.Abort(store_id=r.store_id)), P.Ok)
            r = prepare("qwen", full + 1)
            assert r.code == "too_large" and f"--max-query-bytes 0 = {MAX_WINDOW} rows" in r.message
            r = prepare("legacy", (256 << 20) + 1)   # no query heads: the old fixed bound
            assert r.code == "too_large" and str(256 << 20) in r.message
        finally:
            close_dealer(s)
