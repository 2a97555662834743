"""Query-aware editing end to end: SDK -> real vLLM (tiny Qwen3, float32, kvedit connector
with query capture) -> kvedit server -> fn(kv, tokens, queries=...).

The queries fn receives are compared with transformers' q_proj -> q_norm -> RoPE of the same
tokens (float32; tolerance ATOL + RTOL per element: the two compute the same float32 math
with other kernels and summation orders).
"""
from __future__ import annotations

import uuid

import httpx
import pytest
import torch

from kvedit.keys import namespace, query_key
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.errors import MissingQueries
from kvedit.sdk.stream import create_request
from tests.fixtures_vllm import GREEDY

C = 256
ATOL = RTOL = 1e-4
Q_WIDTH = 4 * 64   # the tiny model: 4 query heads x head_dim 64 (2 KV heads: GQA)


_seed = iter(range(1, 10_000))


def prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(7000 + next(_seed))
    return torch.randint(10, 8000, (n,), generator=g).tolist()


class Recorder:
    """Takes the queries, keeps the first chunk (so the edit really changes the stream)."""
    needs_queries = True

    def __init__(self):
        self.got: dict[int, tuple[torch.Tensor, int]] = {}   # prompt length -> (queries, start)

    def __call__(self, kv, tokens, queries=None, query_start=None, layout=None):
        self.got[query_start + queries.shape[1]] = (queries.clone(), query_start)
        return kv[:, :, :C].clone(), tokens[:C]


def query_objects(kv_server) -> int:
    return httpx.get(kv_server.http_url + "/status", timeout=10).json()["queries"]["objects"]


def test_prefill_with_capture_then_modify_gets_the_queries(ctx, post, kv_server,
                                                           hf_queries):
    """Two streams of one batch with different windows (one from the batch default, the
    window of the other reaching into the partial last chunk); fn gets [L, W, Hq*D] equal to
    transformers'; the objects are gone after the edit; decode still runs."""
    salt = f"sdkq-{uuid.uuid4().hex[:8]}"
    assert ctx.layout.num_q_heads * ctx.layout.head_dim == Q_WIDTH   # the connector says it
    p1, p2 = prompt(2 * C + 50), prompt(C + 100)
    s1 = create_request(ctx, post, p1, salt)                      # batch default: 24
    s2 = create_request(ctx, post, p2, salt, capture_queries=130)  # longer than the tail
    batch = BatchedStream([s1, s2], progress=False, capture_queries=24)
    batch.prefill(GREEDY)
    keys = [query_key(namespace(ctx.model, ctx.layout, salt), p, w)
            for p, w in ((p1, 24), (p2, 130))]
    before = query_objects(kv_server)
    fn = Recorder()
    batch.modify(fn)
    for p, w in ((p1, 24), (p2, 130)):
        q, start = fn.got[len(p)]
        assert q.dtype == torch.float32   # the model dtype the server was started with
        assert tuple(q.shape) == (ctx.layout.num_layers, w, Q_WIDTH)
        assert start == len(p) - w
        torch.testing.assert_close(q, hf_queries(p)[:, start:], atol=ATOL, rtol=RTOL)
    assert [ctx.client.fetch_queries(ctx.model, k) for k in keys] == [None, None]
    assert query_objects(kv_server) == before - 2
    assert [s.tokens for s in batch] == [p1[:C], p2[:C]]
    m = batch.decode({**GREEDY, "max_tokens": 4})
    assert m.output_tokens == 8


def test_missing_queries_is_an_error_naming_the_stream(ctx, post):
    p = prompt(C + 20)
    s = create_request(ctx, post, p, f"sdkq-{uuid.uuid4().hex[:8]}", name="plain-prefill")
    batch = BatchedStream([s], progress=False)
    batch.prefill(GREEDY)   # no capture asked
    with pytest.raises(MissingQueries) as e:
        batch.modify(Recorder())
    assert "plain-prefill" in str(e.value) and "capture_queries" in str(e.value)
    assert s.tokens == p
    # asked, but the object was deleted before the edit
    s2 = create_request(ctx, post, p, f"sdkq-{uuid.uuid4().hex[:8]}", name="deleted",
                        capture_queries=8)
    batch = BatchedStream([s2], progress=False)
    batch.prefill(GREEDY)
    key = query_key(namespace(ctx.model, ctx.layout, s2.cache_salt), p, 8)
    assert ctx.client.lookup(ctx.model, [key], wait_timeout=30, kind="queries") == 1
    assert ctx.client.delete_queries(ctx.model, [key]) == 1
    with pytest.raises(MissingQueries, match="deleted") as e:
        batch.modify(Recorder(), wait_timeout=1)
    assert s2.tokens == p


@pytest.mark.parametrize("policy_name", ["SnapKV", "TOVA"])
def test_query_aware_policy_through_the_sdk(ctx, post, kv_server, policy_name):
    """All three parts together: capture in vLLM, the queries object in the server, a
    kvedit.edits query policy through modify; vLLM then decodes on the smaller cache."""
    from kvedit import edits

    policy = getattr(edits, policy_name)(ratio=0.5, granularity="token")
    assert policy.needs_queries
    p = prompt(4 * C + 30)
    s = create_request(ctx, post, p, f"sdkq-{uuid.uuid4().hex[:8]}", capture_queries=30)
    batch = BatchedStream([s], progress=False)
    batch.prefill(GREEDY)
    key = query_key(namespace(ctx.model, ctx.layout, s.cache_salt), p, 30)
    m = batch.modify(policy)
    assert m.tokens_before == 4 * C and m.tokens_after == 2 * C
    assert ctx.client.fetch_queries(ctx.model, key) is None
    out = batch.decode({**GREEDY, "max_tokens": 3})
    assert out.output_tokens == 3
    # vLLM loaded the edited chunks: of the 2*C + 30 + 1 prompt tokens only the suffix ran
    assert s.generations[-1].cached_tokens >= 2 * C
