"""The SDK side of query-aware editing against a real kvedit server (no vLLM).

A fake engine plays the vLLM connector: it stores the prompt's full chunks (as in
test_sdk_modify) and, when the request's sampling params carry
`kv_transfer_params={"kvedit_capture_queries": W}`, a queries object [L, rows, Hq*D] under
`kvedit.keys.query_key` (computed here independently of the SDK). What the real connector
captures is checked against transformers by tests/engine/test_query_capture*.py; the path through a
real vLLM is tests/engine/test_sdk_queries_vllm.py.
"""
from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest
import torch

from kvedit.client import KVClient, KVError
from kvedit.keys import namespace, query_key, request_keys
from kvedit.layout import ModelLayout
from kvedit.request_params import CAPTURE_FIELD, STORE_FIELD, RequestAsks, with_asks
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.context import connect
from kvedit.sdk.errors import MissingQueries, ModifyError
from kvedit.sdk.openai import OpenAICompletion
from kvedit.sdk.stream import create_request
from tests.fixtures_server import sdk_context

C = 256
Q_HEADS = 4   # GQA: twice the KV heads; the connector registers it in the layout
LAYOUT = ModelLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_size=C,
                     num_q_heads=Q_HEADS)
MODEL = "sdk-queries-model"


class FakeEngine:
    """post_completion storing chunks like the connector, and queries when asked."""

    def __init__(self, url: str):
        self.client = KVClient(url)
        self.asked: list[dict | None] = []   # kv_transfer_params of each request
        self.refused: list[KVError] = []     # queries stores the server refused

    def chunk(self, key: bytes) -> torch.Tensor:
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
        return torch.randn(LAYOUT.chunk_shape, generator=g).to(torch.bfloat16)

    @staticmethod
    def queries(key: bytes, rows: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 2)
        shape = (LAYOUT.num_layers, rows, Q_HEADS * LAYOUT.head_dim)
        return torch.randn(shape, generator=g).to(torch.bfloat16)

    async def __call__(self, prompt, params, cache_salt):
        ktp = params.get("kv_transfer_params")
        self.asked.append(ktp)
        keys = request_keys(MODEL, LAYOUT, prompt, cache_salt)
        await asyncio.to_thread(self.client.store, MODEL, keys, [self.chunk(k) for k in keys])
        window = (ktp or {}).get(CAPTURE_FIELD, 0)
        if window:
            qk = query_key(namespace(MODEL, LAYOUT, cache_salt), prompt, window)
            rows = min(window, len(prompt))
            try:
                await asyncio.to_thread(self.client.store_queries, MODEL, qk,
                                        self.queries(qk, rows))
            except KVError as e:   # as the connector: logged, the request is still served
                self.refused.append(e)
        for _ in range(params.get("max_tokens", 1)):
            await asyncio.sleep(0)
            yield 7


@pytest.fixture(scope="module")
def ctx(kv_server):
    with sdk_context(kv_server, MODEL, LAYOUT) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def engine(kv_server):
    e = FakeEngine(kv_server.url)
    yield e
    e.client.close()


_seed = iter(range(10_000))


def prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(5000 + next(_seed))
    return torch.randint(0, 8000, (n,), generator=g).tolist()


def qkey_of(tokens, window: int, salt: str = "") -> bytes:
    return query_key(namespace(MODEL, LAYOUT, salt), tokens, window)


def drop_last_chunk(kv, tokens):
    return kv[:, :, :-C].clone(), tokens[:-C]


class Recorder:
    """fn(kv, tokens, queries=..., query_start=...) that records what it got."""

    def __init__(self):
        self.got: list[dict] = []

    def __call__(self, kv, tokens, queries=None, query_start=None):
        self.got.append({"queries": None if queries is None else queries.clone(),
                         "query_start": query_start, "tokens": list(tokens)})
        return drop_last_chunk(kv, tokens)


def query_objects(kv_server) -> int:
    return httpx.get(kv_server.http_url + "/status", timeout=10).json()["queries"]["objects"]


def test_fn_declaring_queries_gets_them_then_they_are_deleted(ctx, engine, kv_server):
    p, window = prompt(3 * C + 40), 32
    s = create_request(ctx, engine, p, capture_queries=window)
    batch = BatchedStream([s], progress=False)
    batch.prefill({"max_tokens": 1})
    assert engine.asked[-1] == {CAPTURE_FIELD: window, STORE_FIELD: "eager"}
    qk = qkey_of(p, window)
    assert ctx.client.lookup(MODEL, [qk], kind="queries") == 1
    before = query_objects(kv_server)
    fn = Recorder()
    batch.modify(fn)
    got = fn.got[0]
    q = got["queries"]
    assert q.dtype == torch.bfloat16   # the model dtype, not upcast
    assert tuple(q.shape) == (LAYOUT.num_layers, window, Q_HEADS * LAYOUT.head_dim)
    assert torch.equal(q, FakeEngine.queries(qk, window))
    assert got["query_start"] == len(p) - window   # row 0's prompt position
    assert ctx.client.fetch_queries(MODEL, qk) is None   # deleted after the edit
    assert query_objects(kv_server) == before - 1
    assert s.queries is None


def test_window_longer_than_the_prompt_gives_every_prompt_row(ctx, engine):
    p, window = prompt(C + 30), 400
    s = create_request(ctx, engine, p, capture_queries=window)
    batch = BatchedStream([s], progress=False)
    batch.prefill({"max_tokens": 1})
    fn = Recorder()
    batch.modify(lambda kv, tokens, queries: fn(kv, tokens, queries=queries))
    assert fn.got[0]["queries"].shape[1] == len(p)
    assert fn.got[0]["query_start"] is None   # this fn does not take query_start


def test_fn_without_queries_is_not_given_them_but_they_are_still_deleted(ctx, engine):
    p = prompt(2 * C + 5)
    s = create_request(ctx, engine, p, capture_queries=16)
    batch = BatchedStream([s], progress=False)
    batch.prefill({"max_tokens": 1})
    seen = []

    def plain(kv, tokens, **kwargs):   # **kwargs alone does not ask for queries
        seen.append(sorted(kwargs))
        return drop_last_chunk(kv, tokens)

    batch.modify(plain)
    assert seen == [["layout"]]
    assert ctx.client.fetch_queries(MODEL, qkey_of(p, 16)) is None


def test_needs_queries_attribute_decides(ctx, engine):
    p = prompt(2 * C + 9)

    class Never:
        needs_queries = False

        def __call__(self, kv, tokens, queries=None):
            assert queries is None
            return drop_last_chunk(kv, tokens)

    class Always:
        needs_queries = True

        def __init__(self):
            self.kwargs = None

        def __call__(self, kv, tokens, **kwargs):
            self.kwargs = kwargs
            return drop_last_chunk(kv, tokens)

    never = BatchedStream([create_request(ctx, engine, p, "never", capture_queries=8)],
                          progress=False)
    never.prefill({"max_tokens": 1})
    never.modify(Never())
    always, batch = Always(), BatchedStream(
        [create_request(ctx, engine, p, "always", capture_queries=8)], progress=False)
    batch.prefill({"max_tokens": 1})
    batch.modify(always)
    assert sorted(always.kwargs) == ["layout", "queries", "query_start"]
    assert always.kwargs["query_start"] == len(p) - 8


def test_missing_queries_name_the_stream_and_change_nothing(ctx, engine):
    p = prompt(2 * C + 3)
    # never asked: the error comes at once
    s = create_request(ctx, engine, p, "never-asked", name="no-capture")
    batch = BatchedStream([s], progress=False)
    batch.prefill({"max_tokens": 1})
    assert engine.asked[-1] == {STORE_FIELD: "eager"}   # every SDK request: stored as computed
    with pytest.raises(MissingQueries) as e:
        batch.modify(Recorder())
    assert "no-capture" in str(e.value) and "capture_queries=W" in str(e.value)
    assert e.value.stream is s and s.tokens == p   # unchanged
    # asked, but the object is gone (evicted or deleted): the error names the key
    s2 = create_request(ctx, engine, p, "gone", name="evicted", capture_queries=8)
    batch = BatchedStream([s2], progress=False)
    batch.prefill({"max_tokens": 1})
    qk = qkey_of(p, 8, "gone")
    assert ctx.client.delete_queries(MODEL, [qk]) == 1
    keys = list(s2.keys)
    with pytest.raises(MissingQueries) as e:
        batch.modify(Recorder(), wait_timeout=0.5)
    assert "evicted" in str(e.value) and qk.hex() in str(e.value)
    assert s2.tokens == p and s2.keys == keys
    assert ctx.client.lookup(MODEL, keys) == len(keys)   # the original KV is kept


def test_streams_of_one_prompt_share_the_object_until_the_last_edit(ctx, engine):
    """A fresh stream created with the same prompt, salt and W (never prefilled itself, as
    kvedit eval does) finds the object; it is deleted only after the last stream's edit."""
    p, window = prompt(2 * C + 20), 24
    first = create_request(ctx, engine, p, "shared", capture_queries=window)
    BatchedStream([first], progress=False).prefill({"max_tokens": 1})
    qk = qkey_of(p, window, "shared")
    a = create_request(ctx, engine, p, "shared", capture_queries=window)
    b = create_request(ctx, engine, p, "shared", capture_queries=window)
    fn = Recorder()
    BatchedStream([a], progress=False).modify(fn)
    assert fn.got[-1]["queries"].shape[1] == window
    assert ctx.client.lookup(MODEL, [qk], kind="queries") == 1   # first and b still hold it
    BatchedStream([b], progress=False).modify(fn)
    BatchedStream([first], progress=False).modify(fn)
    assert ctx.client.fetch_queries(MODEL, qk) is None


def test_batch_default_window_and_per_stream_override(ctx, engine):
    p1, p2, p3 = prompt(C + 10), prompt(C + 11), prompt(C + 12)
    n = len(engine.asked)
    batch = BatchedStream([create_request(ctx, engine, p1),
                           create_request(ctx, engine, p2, capture_queries=0),
                           create_request(ctx, engine, p3, capture_queries=5)],
                          progress=False, capture_queries=12)
    batch.prefill({"max_tokens": 1})
    asked = sorted((a or {}).get(CAPTURE_FIELD, 0) for a in engine.asked[n:])
    assert asked == [0, 5, 12]
    assert ctx.client.lookup(MODEL, [qkey_of(p1, 12)], kind="queries") == 1
    assert ctx.client.lookup(MODEL, [qkey_of(p2, 12)], kind="queries") == 0
    fn = Recorder()
    with pytest.raises(MissingQueries):   # p2's stream turned capture off
        batch.modify(fn)
    widths = sorted(g["queries"].shape[1] for g in fn.got)
    assert widths == [5, 12]


def test_run_pipeline_captures_too(ctx, engine):
    p = prompt(2 * C + 1)
    batch = BatchedStream([create_request(ctx, engine, p, "run")], progress=False,
                          capture_queries=10)
    fn = Recorder()
    batch.run({"max_tokens": 1}, fn, {"max_tokens": 2})
    assert fn.got[0]["queries"].shape[1] == 10
    assert ctx.client.fetch_queries(MODEL, qkey_of(p, 10, "run")) is None


def with_capture(params, window: int):
    return with_asks(params, RequestAsks(capture=window))


def test_capture_params_reach_the_openai_body():
    body = OpenAICompletion("http://x", "m").body(
        [1, 2], with_capture({"max_tokens": 1, "kv_transfer_params": {"other": 1}}, 64), "")
    assert body["kv_transfer_params"] == {"other": 1, CAPTURE_FIELD: 64}
    assert with_capture(None, 3) == {"kv_transfer_params": {CAPTURE_FIELD: 3}}


@pytest.mark.parametrize("bad", [-1, 4097, 2.5, True, "32"])
def test_bad_window_is_refused(ctx, bad):
    with pytest.raises(ValueError, match="capture_queries must be a number of prompt tokens"):
        create_request(ctx, lambda *a: iter(()), [1, 2, 3], capture_queries=bad)
    with pytest.raises(ValueError, match="capture_queries"):
        BatchedStream(capture_queries=bad)


def test_socket_mode_context_gets_the_same_queries(kv_server, engine):
    """fetch through the data link (use_shm=False) gives fn the same tensor."""
    with connect(kv_server.url, kv_server.http_url, MODEL, timeout=10, use_shm=False) as sctx:
        assert sctx.client.transfer_mode == "socket"
        p, window = prompt(C + 64), 20
        batch = BatchedStream([create_request(sctx, engine, p, "sock", capture_queries=window)],
                              progress=False)
        batch.prefill({"max_tokens": 1})
        fn = Recorder()
        batch.modify(fn)
        qk = qkey_of(p, window, "sock")
        assert torch.equal(fn.got[0]["queries"], FakeEngine.queries(qk, window))
        assert sctx.client.fetch_queries(MODEL, qk) is None


def test_capture_params_for_vllm_sampling_params():
    """A post_completion driving vLLM's offline LLM gets the window where vLLM reads it:
    SamplingParams.extra_args["kv_transfer_params"]; the caller's params are not changed."""
    from vllm import SamplingParams

    mine = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"other": 2}})
    asked = with_capture(mine, 48)
    assert asked.extra_args["kv_transfer_params"] == {"other": 2, CAPTURE_FIELD: 48}
    assert mine.extra_args == {"kv_transfer_params": {"other": 2}}
    assert with_capture(SamplingParams(max_tokens=1), 8).extra_args == {
        "kv_transfer_params": {CAPTURE_FIELD: 8}}



def test_the_registered_layout_decides_the_queries_shape(kv_server, ctx, engine):
    """The queries object's shape comes from the layout the connector registered
    (num_q_heads), never from its byte size: an object of another width is refused, and a
    registration without num_q_heads (an older connector) is refused naming why; the
    stream is unchanged either way."""
    p, window = prompt(C + 8), 8
    s = create_request(ctx, engine, p, "narrow", capture_queries=window)
    BatchedStream([s], progress=False).prefill({"max_tokens": 1})
    narrow = torch.zeros(LAYOUT.num_layers, window, 2 * LAYOUT.head_dim, dtype=torch.bfloat16)
    ctx.client.store_queries(MODEL, qkey_of(p, window, "narrow"), narrow)   # 2 query heads
    keys = list(s.keys)
    with pytest.raises(ModifyError, match=r"not \[3, 8, 64\] bfloat16") as e:
        BatchedStream([s], progress=False).modify(Recorder())
    assert not isinstance(e.value, MissingQueries) and s.keys == keys and s.tokens == p

    older, lay = "sdk-queries-older-connector", msgspec.structs.replace(LAYOUT, num_q_heads=0)
    with KVClient(kv_server.url) as c:
        c.register(older, lay)
        keys = request_keys(older, lay, p)
        c.store(older, keys, [torch.zeros(LAYOUT.chunk_shape, dtype=torch.bfloat16)] * len(keys))
        c.store_queries(older, query_key(namespace(older, lay, ""), p, window),
                        torch.zeros(LAYOUT.num_layers, window, Q_HEADS * LAYOUT.head_dim,
                                    dtype=torch.bfloat16))
    with connect(kv_server.url, None, older, timeout=5) as octx:
        assert octx.layout.num_q_heads == 0   # readable: the layout itself is fine
        t = create_request(octx, None, p, capture_queries=window)
        with pytest.raises(ModifyError, match="does not say its query heads") as e:
            BatchedStream([t], progress=False).modify(Recorder())
        assert "restart vLLM with this kvedit's connector" in str(e.value) and t.tokens == p
        m = BatchedStream([t], progress=False).modify(drop_last_chunk)   # no queries: fine
        assert m.chunks_deleted == 1


def test_a_pass_whose_queries_the_server_refuses_fails_in_reconstruct():
    """The connector captures a reconstruction pass's queries and the server refuses the
    object (here --max-query-bytes under it; on an H200 the old fixed 256 MiB against a
    351 MB window): vLLM still answers, so the pass used to "succeed" and every KVzip modify
    failed one wait_timeout later with MissingQueries naming no cause. Now the pass itself
    fails, saying what may refuse queries, and the stream holds none."""
    from kvedit.launch.server import start_server
    from kvedit.sdk.kvzip import ReconstructError, pass_prompt, reconstruct

    with start_server(1 / 16, chunk_size=C, extra_args=["--max-query-bytes", "100000"]) as srv, \
            sdk_context(srv, MODEL, LAYOUT) as ctx:
        engine = FakeEngine(srv.url)
        try:
            s = create_request(ctx, engine, prompt(2 * C + 10), "refused", name="refused")
            batch = BatchedStream([s], progress=False)
            batch.prefill({"max_tokens": 1})
            repeat = prompt(6)
            _, window = pass_prompt(s, repeat)
            assert LAYOUT.num_layers * Q_HEADS * LAYOUT.head_dim * 2 == 384   # bytes a row
            assert window * 384 > 100_000
            with pytest.raises(ReconstructError, match=r"\(refused\): its reconstruction pass "
                                                       r"ran, but the kvedit server has no "
                                                       r"captured queries.*--max-query-bytes"
                               ) as e:
                reconstruct(batch, repeat, wait_timeout=0.5)
            assert f"window {window}: {window} rows, {window * 384} bytes" in str(e.value)
            assert [r.code for r in engine.refused] == ["too_large"]
            assert s.queries is None and not ctx.query_refs
        finally:
            engine.client.close()


def test_the_context_pass_gives_the_contexts_own_last_rows(ctx, engine, kv_server):
    """capture_context: one request of the stream's region alone asking for its last rows,
    whose queries the stream then holds; modify hands them over with the position of row 0
    inside the context, and they are deleted after the edit."""
    from kvedit.sdk.context_pass import ContextPassError, capture_context

    p = prompt(3 * C + 40)           # a question of 40 tokens after three chunks
    s = create_request(ctx, engine, p, cache_salt="ctxpass", name="ctxpass")
    batch = BatchedStream([s], progress=False)
    batch.prefill({"max_tokens": 1})
    asked = len(engine.asked)
    m = capture_context(batch, rows=48)
    assert engine.asked[asked][CAPTURE_FIELD] == 48   # the pass asked for 48 rows ...
    region = p[:3 * C]
    qk = query_key(namespace(MODEL, LAYOUT, "ctxpass"), region, 48)   # ... of the region
    assert s.queries is not None and s.queries.key == qk and m.num_streams == 1
    fn = Recorder()
    batch.modify(fn)
    got = fn.got[0]
    assert torch.equal(got["queries"], FakeEngine.queries(qk, 48))
    assert got["query_start"] == 3 * C - 48   # inside the context, never the question
    assert ctx.client.fetch_queries(MODEL, qk) is None
    short = create_request(ctx, engine, prompt(C - 5), name="short")
    with pytest.raises(ContextPassError, match=r"\(short\): it holds no full chunk"):
        capture_context(BatchedStream([short], progress=False), rows=16)
    with pytest.raises(ContextPassError, match=r"rows must be in \[1, 4096\]"):
        capture_context(BatchedStream([s], progress=False), rows=0)
