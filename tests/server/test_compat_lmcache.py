"""kvedit.compat.lmcache (LMCache SDK 0.5.x's surface) against a real kvedit server, no vLLM.

An LMCache-style post_completion plays vLLM with kvedit's connector: it returns a list of
`TokenEvent(token_id, text)` (LMCache's protocol allows any iterable, a blocking one too),
stores the full chunks the engine computed (prompt and generated tokens but the last) with
data derived from their key, and, when the request's sampling params carry kvedit's
capture field, the queries object of the prompt. So what the edit function receives, what
each request sends and what the stream reports can be checked exactly; the path through a
real vLLM is tests/engine/test_compat_lmcache_vllm.py.
"""
from __future__ import annotations

import json

import pytest
import torch

import kvedit.compat.lmcache as lmc_sdk
from kvedit.client import KVClient
from kvedit.compat.lmcache.errors import (LMCacheBatchedStreamError,
                                          LMCacheRequestStreamError, LMCacheSDKError)
from kvedit.keys import namespace, query_key, request_keys
from kvedit.layout import ModelLayout

C = 256
Q_HEADS = 4   # registered with the layout, as kvedit's connector does (num_q_heads)
LAYOUT = ModelLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", chunk_size=C,
                     num_q_heads=Q_HEADS)
MODEL = "compat-lmcache-model"
KIND = lmc_sdk.LMCacheSDKCacheKind
CAPTURE = "kvedit_capture_queries"   # the field kvedit's connector reads (docs/queries.md)
STORE = {"kvedit_store": "eager"}     # every SDK request asks its chunks stored as computed


class Engine:
    """LMCache-style post_completion(prompt_token_ids, sampling_params, cache_salt)."""

    def __init__(self, url: str, stop_after: int | None = None):
        self.client = KVClient(url)
        self.requests: list[tuple[list[int], dict, str]] = []
        self.stop_after = stop_after    # an EOS after this many tokens

    @staticmethod
    def chunk(key: bytes) -> torch.Tensor:
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
        return torch.randn(LAYOUT.chunk_shape, generator=g)

    @staticmethod
    def queries(key: bytes, rows: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 2)
        return torch.randn(LAYOUT.num_layers, rows, Q_HEADS * LAYOUT.head_dim, generator=g)

    def __call__(self, prompt_token_ids, sampling_params, cache_salt):
        prompt = list(prompt_token_ids)
        self.requests.append((prompt, dict(sampling_params), cache_salt))
        n = sampling_params.get("max_tokens", 16)
        if self.stop_after is not None:
            n = min(n, self.stop_after)
        computed = prompt + [7] * max(0, n - 1)
        keys = request_keys(MODEL, LAYOUT, computed, cache_salt)
        self.client.store(MODEL, keys, [self.chunk(k) for k in keys])
        window = (sampling_params.get("kv_transfer_params") or {}).get(CAPTURE, 0)
        if window:
            qk = query_key(namespace(MODEL, LAYOUT, cache_salt), prompt, window)
            self.client.store_queries(MODEL, qk, self.queries(qk, min(window, len(prompt))))
        return [lmc_sdk.request.TokenEvent(token_id=7, text="x") for _ in range(n)]


@pytest.fixture(scope="module")
def server(kv_server):
    with KVClient(kv_server.url) as c:
        c.register(MODEL, LAYOUT)
    return kv_server


@pytest.fixture(scope="module")
def kv_ctx(server):
    ctx = lmc_sdk.connect(KIND.KV, server.url, server.http_url, MODEL, timeout=10)
    yield ctx
    ctx.close()


@pytest.fixture(scope="module")
def q_ctx(server):
    ctx = lmc_sdk.qcache.connect(server.url, server.http_url, MODEL, timeout=10)
    yield ctx
    ctx.close()


@pytest.fixture
def engine(server):
    e = Engine(server.url)
    yield e
    e.client.close()


_seed = iter(range(10_000))


def prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(9000 + next(_seed))
    return torch.randint(0, 8000, (n,), generator=g).tolist()


def stored_kv(tokens, salt: str = "") -> torch.Tensor:
    keys = request_keys(MODEL, LAYOUT, tokens, salt)
    return torch.cat([Engine.chunk(k) for k in keys], dim=2)


def stored_queries(p: list[int], salt: str = "") -> torch.Tensor:
    qk = query_key(namespace(MODEL, LAYOUT, salt), p, len(p))
    return Engine.queries(qk, len(p))


def batch_of(contexts, engine, prompts, salt: str = ""):
    batch = lmc_sdk.batch.LMCacheBatchedStream()
    for p in prompts:
        batch.add(lmc_sdk.request.create_request(contexts, engine, p, salt))
    return batch


def test_contexts_of_both_kinds(server, kv_ctx, q_ctx):
    assert (kv_ctx.kind, q_ctx.kind) == (KIND.KV, KIND.QUERY)
    assert kv_ctx.chunk_size == q_ctx.chunk_size == C and kv_ctx.mq_timeout == 10.0
    assert kv_ctx.model_name == q_ctx.model_name == MODEL
    kv_ctx.register_caches()   # connect already read the layout: nothing to do
    with pytest.raises(LMCacheSDKError, match="not supported.*update"):
        kv_ctx.store(torch.zeros(LAYOUT.chunk_shape), list(range(C)))
    with pytest.raises(LMCacheSDKError, match="not supported.*retrieve"):
        kv_ctx.retrieve(list(range(C)))
    ctx = lmc_sdk.kvcache.connect(server.url, server.http_url, MODEL, timeout=10)
    ctx.close()
    ctx.close()   # idempotent
    assert ctx.closed
    with pytest.raises(LMCacheSDKError, match="closed"):
        ctx.register_caches()


def test_connect_names_what_is_wrong(server):
    with pytest.raises(LMCacheSDKError, match="'no-such-model' is not registered.*"
                                              + MODEL):
        lmc_sdk.connect(KIND.QUERY, server.url, server.http_url, "no-such-model", timeout=0.5)
    with pytest.raises(LMCacheSDKError, match="ZMQ.*gRPC"):
        lmc_sdk.connect(KIND.KV, "grpc://127.0.0.1:1", server.http_url, MODEL)


def test_prefill_modify_decode_with_kv_and_query(kv_ctx, q_ctx, engine):
    """The LMCache flow on unaligned prompts: prefill asks capture of the whole prompt, fn
    gets KV [2, L, T, D] and QUERY [1, L, T, Hq*D] from position 0, the edit's tail waits in
    suffix_tokens, decode sends the edited sequence, the reports add up."""
    prompts = [prompt(2 * C + 37), prompt(3 * C + 101), prompt(2 * C + 5)]
    batch = batch_of([kv_ctx, q_ctx], engine, prompts, salt="flow")
    sids = list(batch.request_streams)
    pre = batch.prefill({"temperature": 0.0})
    asked = {tuple(r[0]): (r[1]["max_tokens"], r[1]["kv_transfer_params"])
             for r in engine.requests}   # the requests run concurrently, in any order
    assert asked == {tuple(p): (1, {**STORE, CAPTURE: len(p)}) for p in prompts}
    d = pre.to_dict()
    assert d["title"] == "Batched Stream Metrics (prefill)"
    assert d["metrics"]["config"] == {"num_request_streams": 3}
    res = d["metrics"]["results"]
    assert res["input_tokens"] == sum(map(len, prompts))
    assert res["input_tput"] == pytest.approx(res["input_tokens"] / res["duration"])
    assert res["duration"] == pre.kvedit[0].duration
    assert [batch.perf_metrics[s].input_tokens for s in sids] == [len(p) for p in prompts]
    assert [batch.perf_metrics[s].output_tokens for s in sids] == [1, 1, 1]

    got = []

    def drop_last_chunk(tensors, tokens):
        kv, q = tensors[KIND.KV], tensors[KIND.QUERY]
        got.append((kv.clone(), q.clone(), list(tokens)))
        return kv[:, :, :-C].clone(), tokens[:-C]

    m = batch.modify(drop_last_chunk)
    d = m.to_dict()
    assert d["title"] == "Batched Stream Modify Metrics" and list(d["metrics"]) == ["results"]
    assert list(d["metrics"]["results"]) == ["duration"] and d["metrics"]["results"]["duration"] > 0
    assert sum(k.tokens_before for k in m.kvedit) == (2 + 3 + 2) * C
    assert sum(k.tokens_after for k in m.kvedit) == (1 + 2 + 1) * C
    by_tokens = {tuple(t): (kv, q) for kv, q, t in got}
    for p in prompts:
        t = len(p) // C * C
        kv, q = by_tokens[tuple(p[:t])]
        assert tuple(kv.shape) == (2, LAYOUT.num_layers, t, LAYOUT.hidden)
        torch.testing.assert_close(kv, stored_kv(p[:t], "flow"), rtol=0, atol=0)
        assert tuple(q.shape) == (1, LAYOUT.num_layers, t, Q_HEADS * LAYOUT.head_dim)
        torch.testing.assert_close(q[0], stored_queries(p, "flow")[:, :t], rtol=0, atol=0)
    for sid, p in zip(sids, prompts):
        s = batch.get_request_stream(sid)
        t = len(p) // C * C
        assert s.tokens == p[:t - C]                  # LMCache: the edited tokens
        assert s.suffix_tokens == p[t:] + [7]         # the tail and the prefill's token
        assert s.output_tokens == s.tokens and not s.is_done

    dec = batch.decode({"max_tokens": 4})
    sent = [r[0] for r in engine.requests[3:]]
    assert sorted(map(len, sent)) == sorted(len(p) - C + 1 for p in prompts)
    for sid, p in zip(sids, prompts):
        s = batch.get_request_stream(sid)
        t = len(p) // C * C
        assert s.tokens == p[:t - C] + p[t:] + [7] * 5 and s.suffix_tokens == []
        assert s.decoded_tokens == 5 and s.output_text == "x" * 5 and not s.is_done
        perf = batch.perf_metrics[sid]
        assert (perf.input_tokens, perf.output_tokens, len(perf.tpot)) == \
            (len(p) - C + 1, 4, 3)
        assert 0 < perf.ttft <= perf.duration
        assert perf.output_tput == pytest.approx(4 / perf.duration)
    res = dec.to_dict()["metrics"]["results"]
    assert res["output_tokens"] == 12 == dec.kvedit[0].output_tokens
    assert res["output_tput"] == pytest.approx(12 / res["duration"])


def test_retrieve_reads_without_changing_the_stream(kv_ctx, q_ctx, engine):
    p = prompt(2 * C + 10)
    s = lmc_sdk.request.create_request([kv_ctx, q_ctx], engine, p)
    batch = lmc_sdk.batch.LMCacheBatchedStream()
    batch.add(s)
    batch.prefill({})
    kv = s.retrieve(KIND.KV, timeout=5)
    q = s.retrieve(KIND.QUERY, timeout=5, poll_interval=0.01)
    torch.testing.assert_close(kv, stored_kv(p[:2 * C]), rtol=0, atol=0)
    torch.testing.assert_close(q[0], stored_queries(p)[:, :2 * C], rtol=0, atol=0)
    assert s.tokens == p + [7] and s.suffix_tokens == []
    # the queries are still there for the edit, which then uses them up
    s.modify_kv(lambda t, tokens: (t[KIND.KV][:, :, :C].clone(), tokens[:C]))
    assert s.tokens == p[:C] and s.suffix_tokens == p[2 * C:] + [7]
    with pytest.raises(LMCacheRequestStreamError, match="QUERY context captures"):
        s.retrieve(KIND.QUERY, timeout=0.2)


def test_queries_no_longer_from_position_zero_are_refused(kv_ctx, q_ctx, engine):
    """A second prefill captures the grown prompt's last rows: fn is not handed them."""
    s = lmc_sdk.request.create_request([kv_ctx, q_ctx], engine, prompt(C + 30))
    batch = lmc_sdk.batch.LMCacheBatchedStream()
    batch.add(s)
    batch.prefill({})
    batch.prefill({})
    before = s.tokens
    with pytest.raises(LMCacheRequestStreamError, match="position 1, not 0"):
        batch.modify(lambda t, tokens: (t[KIND.KV], tokens))
    assert s.tokens == before


def test_update_makes_the_given_tokens_the_sequence(kv_ctx, engine):
    """LMCache's update(): the sequence becomes exactly `tokens` (the generated tail is not
    kept, unlike modify_kv), and the next request sends them; the KV is stored under them."""
    p = prompt(3 * C + 20)
    s = lmc_sdk.request.create_request([kv_ctx], engine, p, "upd")
    s.generate({"max_tokens": 3})
    kv = s.retrieve(KIND.KV)
    assert kv.shape[2] == 3 * C
    new = list(reversed(p[:C])) + p[C:C + 10]   # a token order vLLM never saw
    s.update(KIND.KV, kv[:, :, :C + 10].clone(), new)
    assert s.tokens == new and s.suffix_tokens == []
    torch.testing.assert_close(s.retrieve(KIND.KV), kv[:, :, :C], rtol=0, atol=0)
    s.generate({"max_tokens": 2})
    assert engine.requests[-1][0] == new and s.tokens == new + [7, 7]
    with pytest.raises(LMCacheRequestStreamError, match="stores only KV"):
        s.update(KIND.QUERY, kv, new)


def test_decode_runs_streams_that_stopped_early(kv_ctx, server):
    """LMCache runs every stream on each call and calls one done when it got fewer tokens
    than max_tokens (1 when absent); kvedit's own decode would skip a done stream."""
    eos = Engine(server.url, stop_after=2)
    try:
        batch = batch_of([kv_ctx], eos, [prompt(C + 3)])
        (s,) = batch.request_streams.values()
        batch.prefill({})
        assert not s.is_done
        batch.decode({"max_tokens": 5})
        assert s.is_done and s.decoded_tokens == 3
        batch.decode({"max_tokens": 5})
        assert len(eos.requests) == 3 and s.decoded_tokens == 5
        s.generate({})   # LMCache's rule: no max_tokens means 1
        assert s.done is False and s.decoded_tokens == 7
    finally:
        eos.client.close()


def test_mixed_batch_and_selected_streams(kv_ctx, q_ctx, engine):
    """Streams with and without QUERY in one batch; stream_ids selects who runs."""
    with_q = lmc_sdk.request.create_request([q_ctx, kv_ctx], engine, prompt(2 * C))
    plain = lmc_sdk.request.create_request([kv_ctx], engine, prompt(2 * C + 1))
    batch = lmc_sdk.batch.LMCacheBatchedStream()
    batch.add(with_q)
    batch.add(plain)
    batch.prefill({})
    asked = {len(r[0]): CAPTURE in (r[1].get("kv_transfer_params") or {})
             for r in engine.requests}
    assert asked == {2 * C: True, 2 * C + 1: False}
    kinds = []

    def record(tensors, tokens):
        kinds.append(sorted(k.name for k in tensors))
        return tensors[KIND.KV], tokens

    batch.modify(record)
    assert sorted(kinds) == [["KV"], ["KV", "QUERY"]]
    batch.decode({"max_tokens": 1}, stream_ids=[plain.request_stream_id])
    assert list(batch.perf_metrics) == [plain.request_stream_id]
    assert engine.requests[-1][0] == plain.tokens[:-1] and len(engine.requests) == 3
    assert batch.run_request_streams({}, stream_ids=[]) == 0.0


def test_refusals_name_the_argument(kv_ctx, q_ctx, engine, server):
    p = prompt(C + 1)
    with pytest.raises(ValueError, match="two KV contexts"):
        lmc_sdk.request.create_request([kv_ctx, kv_ctx], engine, p)
    with pytest.raises(TypeError, match="list of contexts"):
        lmc_sdk.request.create_request(kv_ctx, engine, p)
    with pytest.raises(LMCacheRequestStreamError, match="every prompt token.*5000"):
        lmc_sdk.request.create_request([kv_ctx, q_ctx], engine, prompt(5000))
    short = lmc_sdk.request.create_request([kv_ctx, q_ctx], engine, prompt(C - 1))
    only_kv = lmc_sdk.request.create_request([kv_ctx], engine, p)
    batch = lmc_sdk.batch.LMCacheBatchedStream()
    batch.add(short)
    batch.add(only_kv)
    with pytest.raises(LMCacheBatchedStreamError, match="already exists"):
        batch.add(short)
    with pytest.raises(LMCacheBatchedStreamError, match="does not exist"):
        batch.get_request_stream("nope")
    with pytest.raises(LMCacheBatchedStreamError, match="does not exist"):
        batch.decode({}, stream_ids=["nope"])
    with pytest.raises(ValueError, match="Unknown format 'yaml'"):
        batch.prefill({}, fmt="yaml")
    with pytest.raises(ValueError, match="width"):
        batch.decode({}, width=0)
    assert engine.requests == []   # refused before any engine work
    with pytest.raises(LMCacheBatchedStreamError, match="Invalid mode"):
        batch.get_perf_metrics(1.0, "terminal", 80, "modify")
    batch.prefill({})
    with pytest.raises(LMCacheRequestStreamError, match="fewer than one chunk"):
        batch.modify(lambda t, tokens: (t[KIND.KV], tokens))
    with pytest.raises(LMCacheRequestStreamError, match="no context available.*QUERY"):
        only_kv.retrieve(KIND.QUERY)
    with pytest.raises(ValueError, match="poll_interval"):
        only_kv.modify_kv(lambda t, tokens: (t[KIND.KV], tokens), poll_interval=-1)
    before = only_kv.tokens
    with pytest.raises(LMCacheRequestStreamError, match=only_kv.request_stream_id +
                       ".*dtype torch.float64"):
        only_kv.modify_kv(lambda t, tokens: (t[KIND.KV].double(), tokens))
    assert only_kv.tokens == before and only_kv.suffix_tokens == []


def test_reports_emit_as_lmcache_does(kv_ctx, engine, capsys):
    batch = batch_of([kv_ctx], engine, [prompt(C + 2)])
    batch.prefill({}, width=60).emit()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == " Batched Stream Metrics (prefill) ".center(60, "=")
    assert out[-1] == "=" * 60 and all(len(line) == 60 for line in out)
    assert any(line.startswith("Total Input Tokens:") and line.endswith(f" {C + 2}")
               for line in out)
    report = batch.decode({"max_tokens": 2}, fmt="json")
    report.emit()
    assert json.loads(capsys.readouterr().out) == report.to_dict()
    assert report["results"].to_dict()["output_tokens"] == 2
