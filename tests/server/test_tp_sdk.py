"""The SDK's tensor-parallel path against a real kvedit server, without vLLM.

The test plays the connector: it registers one layout per rank and stores each rank's heads
of a known full KV under that rank's keys (as vLLM's workers would after a prefill), cut the
way vLLM splits heads (tests.unit.test_sdk_tp.VLLM_SPLIT, written out per case). Then the SDK's
modify runs as a user would call it. What is checked: fn gets every head in model order;
each rank ends up holding exactly its heads of fn's result; the old chunks go on every rank;
a store failing on rank 1 leaves rank 0 without any edited chunk and the stream unchanged;
captured queries are gathered per rank; connect() refuses what it cannot gather, saying why.
(tests/engine/test_tp_vllm.py does the same through real TP=1 and TP=2 vLLM engines.)
"""
from __future__ import annotations

import uuid

import msgspec
import pytest
import torch

from kvedit import protocol as P
from kvedit.client import KVClient
from kvedit.client.handles import KVError
from kvedit.keys import namespace, query_key, request_keys
from kvedit.layout import ModelLayout
from kvedit.sdk import store
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.context import connect
from kvedit.sdk.errors import ConnectError, MissingQueries, ModifyError
from kvedit.sdk.stream import create_request
from kvedit.launch.server import start_server
from tests.fixtures_server import call, close_dealer, dealer
from tests.unit.test_sdk_tp import VLLM_SPLIT

C = 256
D = 8
L = 2
N_CHUNKS = 3


@pytest.fixture(scope="module")
def server():
    with start_server(0.25, chunk_size=C, shm=True) as s:
        yield s


@pytest.fixture
def client(server):
    with KVClient(server.url) as c:
        yield c


Q_HEADS = 8   # the model's query heads, split over the ranks without replicas


def layouts(tp: int, total: int, said: bool = True) -> list[ModelLayout]:
    return [ModelLayout(num_layers=L, num_kv_heads=max(1, total // tp), head_dim=D,
                        dtype="float32", chunk_size=C, tp_rank=r, tp_size=tp,
                        total_kv_heads=total if said else 0, num_q_heads=Q_HEADS // tp)
            for r in range(tp)]


def cut(kv: torch.Tensor, heads: list[int]) -> torch.Tensor:
    return torch.cat([kv[..., h * D:(h + 1) * D] for h in heads], dim=-1)


def full_kv(total: int, tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, L, tokens, total * D, generator=g)


def chunks(kv: torch.Tensor) -> list[torch.Tensor]:
    return [kv[:, :, i * C:(i + 1) * C].contiguous() for i in range(kv.shape[2] // C)]


def prefill(client, model: str, lays, tokens, salt, kv, total: int) -> list[list[bytes]]:
    """Play the connector: register every rank, store its heads of kv under its keys."""
    per_rank = []
    for lay in lays:
        client.register(model, lay)
        keys = request_keys(model, lay, tokens, salt)
        client.store(model, keys, chunks(cut(kv, VLLM_SPLIT[lay.tp_size, total][lay.tp_rank])),
                     tp_rank=lay.tp_rank)
        per_rank.append(keys)
    return per_rank


def stored(client, model: str, lays, tokens, salt) -> list[torch.Tensor | None]:
    """Each rank's chunks of tokens as one tensor (None if any is missing)."""
    out = []
    for lay in lays:
        keys = request_keys(model, lay, tokens, salt)
        with client.retrieve(model, keys, tp_rank=lay.tp_rank) as got:
            out.append(torch.cat([t.clone() for t in got.tensors], dim=2)
                       if len(got.tensors) == len(keys) else None)
    return out


def never(prompt, params, salt):
    raise AssertionError("modify must not call the engine")


def tokens_of(seed: int, n: int = N_CHUNKS * C + 17) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 8000, (n,), generator=g).tolist()


def model_name() -> str:
    return f"tp-{uuid.uuid4().hex[:8]}"


# ---- the layout field ----------------------------------------------------------------------
class _LayoutBefore(msgspec.Struct, frozen=True, kw_only=True):
    """ModelLayout as it was before total_kv_heads (an older peer)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    chunk_size: int
    tp_rank: int = 0
    tp_size: int = 1
    rope: object = None


def test_total_kv_heads_is_left_out_when_not_said_and_older_peers_decode_it():
    new = ModelLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", chunk_size=C,
                      tp_rank=1, tp_size=4)
    old = _LayoutBefore(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32",
                        chunk_size=C, tp_rank=1, tp_size=4)
    enc, dec = msgspec.msgpack.encode, msgspec.msgpack.decode
    assert b"total_kv_heads" not in enc(new)   # not said: not sent
    said = new.with_total_kv_heads(2)
    assert said.total_kv_heads == 2 and b"total_kv_heads" in enc(said)
    assert dec(enc(said), type=_LayoutBefore) == old   # an older peer ignores it
    assert dec(enc(new), type=_LayoutBefore) == old
    assert dec(enc(old), type=ModelLayout) == new      # from an older peer: 0, not said
    rank0 = ModelLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32",
                        chunk_size=C)
    assert dec(enc(rank0), type=_LayoutBefore).tp_size == 1   # defaults left out, filled in
    one = ModelLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", chunk_size=C)
    assert one.with_total_kv_heads(2) is one   # one rank: nothing to say


@pytest.mark.parametrize("total, msg", [
    (3, "cannot be split over tp_size 4"),
    (8, "gives 2 heads per rank; layout.num_kv_heads is 1"),
    (-2, "expected a positive count"),
])
def test_server_refuses_a_total_that_vllm_cannot_split(client, total, msg):
    lay = msgspec.structs.replace(layouts(4, 2)[1], total_kv_heads=total)
    with pytest.raises(ValueError, match=msg):
        lay.validate()
    with pytest.raises(KVError, match=msg) as e:
        client.register(model_name(), lay)
    assert e.value.code == "bad_layout"


# ---- connect -------------------------------------------------------------------------------
def test_connect_reads_every_rank_and_the_connectors_total(server, client):
    model = model_name()
    for lay in layouts(4, 2):
        client.register(model, lay)
    with connect(server.url, model_name=model, timeout=5) as ctx:
        assert ctx.tp.size == 4 and ctx.tp.heads.replicas == 2
        assert ctx.layout.tp_rank == 0   # streams' keys are rank 0's
        assert (ctx.tp.layout.num_kv_heads, ctx.tp.layout.tp_size) == (2, 1)
        assert ctx.tp.layout.num_q_heads == Q_HEADS   # the ranks' query heads, summed
    with pytest.raises(ConnectError, match=r"registered total_kv_heads \[2\], not 4"):
        connect(server.url, model_name=model, timeout=5, total_kv_heads=4)


def test_connect_refuses_what_it_cannot_gather(server, client):
    older = model_name()   # a connector from before total_kv_heads
    for lay in layouts(2, 4, said=False):
        client.register(older, lay)
    with pytest.raises(ConnectError, match=r"pass connect\(\.\.\., total_kv_heads=N\)"):
        connect(server.url, model_name=older, timeout=5)
    with connect(server.url, model_name=older, timeout=5, total_kv_heads=4) as ctx:
        assert ctx.tp.heads.heads_per_rank == 2
    with pytest.raises(ConnectError, match="gives 1 per rank; the layouts say 2"):
        connect(server.url, model_name=older, timeout=5, total_kv_heads=2)

    half = model_name()   # rank 1 never registers
    client.register(half, layouts(2, 4)[0])
    with pytest.raises(ConnectError, match="rank 1 never registered its layout"):
        connect(server.url, model_name=half, timeout=0.5)

    one = model_name()
    client.register(one, ModelLayout(num_layers=L, num_kv_heads=2, head_dim=D,
                                     dtype="float32", chunk_size=C))
    with pytest.raises(ConnectError, match="one rank of 2 KV heads"):
        connect(server.url, model_name=one, timeout=5, total_kv_heads=4)


# ---- modify over ranks ---------------------------------------------------------------------
@pytest.mark.parametrize("tp, total", [(2, 8), (4, 2)])
def test_modify_gathers_for_fn_and_stores_each_ranks_heads(server, client, tp, total):
    model, salt, toks = model_name(), "s", tokens_of(tp)
    lays = layouts(tp, total)
    kv = full_kv(total, len(toks) // C * C, seed=tp)
    old = prefill(client, model, lays, toks, salt, kv, total)
    seen = {}

    def fn(kv_in, tokens, layout):
        seen["kv"], seen["layout"] = kv_in.clone(), layout
        keep = list(range(C)) + list(range(2 * C, 3 * C))   # drop chunk 1
        return kv_in[:, :, keep] * 2 + 1, [tokens[i] for i in keep]

    with connect(server.url, model_name=model, timeout=5) as ctx:
        s = create_request(ctx, never, toks, salt)
        m = BatchedStream([s], progress=False).modify(fn)
        assert torch.equal(seen["kv"], kv)                    # every head, model order
        assert seen["layout"].num_kv_heads == total and seen["layout"].hidden == total * D
        edited = kv[:, :, list(range(C)) + list(range(2 * C, 3 * C))] * 2 + 1
        # chunk 0 keeps its tokens with new bytes: one fresh salt for every rank
        assert m.salt_changes == 1 and s.cache_salt.startswith("s~kvedit-")
        got = stored(client, model, lays, s.tokens, s.cache_salt)
        for r in range(tp):
            assert torch.equal(got[r], cut(edited, VLLM_SPLIT[tp, total][r])), f"rank {r}"
        assert m.chunks_deleted == N_CHUNKS
        for r in range(tp):   # the old chunks are gone on every rank
            assert client.lookup(model, old[r], tp_rank=r) == 0, f"rank {r}"


def test_identity_edit_stores_nothing_and_keeps_every_rank(server, client):
    model, salt, toks = model_name(), "", tokens_of(11)
    lays = layouts(2, 8)
    kv = full_kv(8, len(toks) // C * C, seed=11)
    old = prefill(client, model, lays, toks, salt, kv, 8)
    with connect(server.url, model_name=model, timeout=5) as ctx:
        s = create_request(ctx, never, toks, salt)
        m = BatchedStream([s], progress=False).modify(lambda kv_, t: (kv_, t))
        assert (m.chunks_stored, m.chunks_reused, m.salt_changes, m.chunks_deleted) == \
            (0, N_CHUNKS, 0, 0)
        if ctx.pool.cow:   # the gathered kv is write-tracked like one rank's: nothing compared
            assert m.chunks_compared == 0
        assert [client.lookup(model, old[r], tp_rank=r) for r in range(2)] == [N_CHUNKS] * 2


def test_an_in_place_change_to_one_ranks_heads_switches_every_rank_to_a_fresh_salt(server,
                                                                                     client):
    """Same tokens, one byte of rank 1's heads changed in place: the chunk is compared on
    every rank (rank 0's bytes are equal, rank 1's are not), and every rank stores the edit
    under one fresh salt; the original chunks stay readable until they are dropped."""
    model, salt, toks = model_name(), "s", tokens_of(13)
    lays = layouts(2, 8)
    kv = full_kv(8, len(toks) // C * C, seed=13)
    prefill(client, model, lays, toks, salt, kv, 8)

    def poke(kv_in, tokens):
        kv_in[1, 0, C + 5, 4 * D + 1] += 1.0   # V, layer 0, chunk 1, head 4 (rank 1's)
        return kv_in, tokens

    with connect(server.url, model_name=model, timeout=5) as ctx:
        s = create_request(ctx, never, toks, salt)
        m = BatchedStream([s], progress=False).modify(poke, keep_old=True)
        assert m.salt_changes == 1 and m.chunks_stored == N_CHUNKS
        assert m.chunks_compared >= 2   # chunk 1 on both ranks (before the salt switch)
        edited = kv.clone()
        edited[1, 0, C + 5, 4 * D + 1] += 1.0
        got = stored(client, model, lays, s.tokens, s.cache_salt)
        for r in range(2):
            assert torch.equal(got[r], cut(edited, VLLM_SPLIT[2, 8][r])), f"rank {r}"
        before = stored(client, model, lays, toks[:N_CHUNKS * C], salt)
        assert torch.equal(before[1], cut(kv, VLLM_SPLIT[2, 8][1]))   # kept (keep_old)


def test_a_store_failing_on_rank_1_leaves_rank_0_unedited(server, client):
    model, salt, toks = model_name(), "s", tokens_of(21)
    lays = layouts(2, 8)
    kv = full_kv(8, len(toks) // C * C, seed=21)
    prefill(client, model, lays, toks, salt, kv, 8)
    keep = list(range(C)) + list(range(2 * C, 3 * C))

    def fn(kv_in, tokens):
        sock = dealer(server.url)   # rank 1's registration goes away under the edit
        try:
            assert isinstance(call(sock, P.Unregister(model=model, tp_rank=1)), P.Count)
        finally:
            close_dealer(sock)
        return kv_in[:, :, keep], [tokens[i] for i in keep]

    with connect(server.url, model_name=model, timeout=5) as ctx:
        s = create_request(ctx, never, toks, salt)
        before = (list(s.keys), list(s.tokens), s.cache_salt)
        with pytest.raises(ModifyError, match="no rank uses it, the original KV is kept"):
            BatchedStream([s], progress=False).modify(fn)
        assert (s.keys, s.tokens, s.cache_salt) == before
        new0 = request_keys(model, lays[0], [toks[i] for i in keep], salt)
        assert client.lookup(model, new0[1:], tp_rank=0) == 0   # rank 0's edit was aborted
        got = stored(client, model, lays[:1], toks[:N_CHUNKS * C], salt)[0]
        assert torch.equal(got, cut(kv, [0, 1, 2, 3]))               # its original is intact


def test_a_failed_commit_deletes_what_earlier_ranks_committed(server, client):
    """The commit phase: rank 0 committed, rank 1's store is gone -> rank 0's new chunks
    are deleted again, the error reaches the caller."""
    model, toks = model_name(), tokens_of(31)
    lays = layouts(2, 4)
    for lay in lays:
        client.register(model, lay)
    with connect(server.url, model_name=model, timeout=5) as ctx:
        per_rank = ctx.rank_keys_for(toks, "")
        handles = [client.prepare_store(model, keys, tp_rank=r)
                   for r, keys in enumerate(per_rank)]
        for r, h in enumerate(handles):
            h.write([torch.zeros(lays[r].chunk_shape)] * len(h.missing))
        handles[1].abort()   # lost between the two commits
        with pytest.raises(KVError):
            store._commit_all(ctx, per_rank, handles)
        assert client.lookup(model, per_rank[0], tp_rank=0) == 0


def test_captured_queries_are_gathered_per_rank(server, client):
    model, salt, toks, w = model_name(), "q", tokens_of(41), 16
    lays = layouts(2, 8)
    kv = full_kv(8, len(toks) // C * C, seed=41)
    prefill(client, model, lays, toks, salt, kv, 8)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(L, w, 8 * D, generator=g)   # 8 query heads, 4 on each rank
    keys = [query_key(namespace(model, lay, salt), toks, w) for lay in lays]
    client.store_queries(model, keys[0], q[..., :4 * D].contiguous(), tp_rank=0)
    seen = {}

    def fn(kv_in, tokens, queries, query_start):
        seen["q"], seen["start"] = queries.clone(), query_start
        return kv_in, tokens

    with connect(server.url, model_name=model, timeout=5) as ctx:
        s = create_request(ctx, never, toks, salt, capture_queries=w)
        with pytest.raises(MissingQueries, match="tensor-parallel rank 1 has no captured"):
            BatchedStream([s], progress=False).modify(fn, wait_timeout=0.2)
        client.store_queries(model, keys[1], q[..., 4 * D:].contiguous(), tp_rank=1)
        BatchedStream([s], progress=False).modify(fn)
        assert torch.equal(seen["q"], q) and seen["start"] == len(toks) - w
        # the edit used them up: deleted on every rank
        for r in range(2):
            assert client.lookup(model, [keys[r]], tp_rank=r, kind="queries") == 0, f"rank {r}"


def test_releasing_a_stream_deletes_its_chunks_and_queries_on_every_rank(server, client):
    model, salt, toks, w = model_name(), "rel", tokens_of(51), 8
    lays = layouts(4, 2)
    old = prefill(client, model, lays, toks, salt, full_kv(2, len(toks) // C * C), 2)
    qkeys = [query_key(namespace(model, lay, salt), toks, w) for lay in lays]
    for r, k in enumerate(qkeys):
        client.store_queries(model, k, torch.zeros(L, w, D), tp_rank=r)
    with connect(server.url, model_name=model, timeout=5) as ctx:
        s = create_request(ctx, never, toks, salt, capture_queries=w)
        assert BatchedStream([s], progress=False).release() == N_CHUNKS
    for r in range(4):
        assert client.lookup(model, old[r], tp_rank=r) == 0, f"rank {r}"
        assert client.lookup(model, [qkeys[r]], tp_rank=r, kind="queries") == 0, f"rank {r}"


def test_new_kv_output_is_cut_per_rank(server, client):
    """An fn that builds its result with new_kv gets a tensor of the gathered width; each
    rank stores its heads of it."""
    model, salt, toks = model_name(), "", tokens_of(61)
    lays = layouts(2, 8)
    kv = full_kv(8, len(toks) // C * C, seed=61)
    prefill(client, model, lays, toks, salt, kv, 8)

    def fn(kv_in, tokens, new_kv):
        out = new_kv((2, L, 2 * C, kv_in.shape[3]))
        torch.cat([kv_in[:, :, :C], kv_in[:, :, 2 * C:3 * C]], dim=2, out=out)
        return out, tokens[:C] + tokens[2 * C:3 * C]

    with connect(server.url, model_name=model, timeout=5) as ctx:
        s = create_request(ctx, never, toks, salt)
        m = BatchedStream([s], progress=False).modify(fn)
        assert (m.chunks_reused, m.chunks_stored, m.salt_changes) == (1, 1, 0)
        edited = torch.cat([kv[:, :, :C], kv[:, :, 2 * C:3 * C]], dim=2)
        got = stored(client, model, lays, s.tokens, s.cache_salt)
        for r in range(2):
            assert torch.equal(got[r], cut(edited, VLLM_SPLIT[2, 8][r])), f"rank {r}"
