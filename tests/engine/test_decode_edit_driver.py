"""The budgeted driver (BatchedStream.run given a HostBudget): every stream stays within
its KV budget as the engine sees it, edits overlap decoding, nothing leaks (issue 11).

Checked from the engine's side: the fake engine records every request it got (sequence
length, max_tokens), the real vLLM reports each request's usage; leaks are checked by asking
the kvedit server for every chunk key a stream ever held."""
from __future__ import annotations

import pytest

from kvedit.edits import StreamingLLM
from kvedit.sdk.batch import BatchedStream
from kvedit.sdk.context import connect
from kvedit.sdk.driver import HostBudget
from kvedit.sdk.stream import create_request
from tests.engine.test_decode_edit import present
from tests.server.test_sdk_modify import C, LAYOUT, MODEL, FakeEngine, prompt  # noqa: F401
from tests.server.test_sdk_modify import ctx as fake_ctx, engine  # noqa: F401


class Recording:
    """Wraps a post_completion; keeps (prompt length, max_tokens, usage) per request and
    every chunk key the streams held along the way (read after each request)."""

    def __init__(self, inner):
        self.inner, self.requests = inner, []

    async def __call__(self, prompt, params, cache_salt):
        usage = None
        async for item in self.inner(prompt, params, cache_salt):
            usage = getattr(item, "usage", None) or usage
            yield item
        self.requests.append((len(prompt), params["max_tokens"], usage))


def test_fake_engine_every_request_fits_the_budget_and_nothing_leaks(fake_ctx, engine):
    rec = Recording(engine)
    streams = [create_request(fake_ctx, rec, prompt(3 * C + 10 + 40 * i)) for i in range(3)]
    batch = BatchedStream(streams, progress=False)
    budget, every = 4 * C, 100
    m = batch.run({"max_tokens": 1},   # the layout has no RoPE: no re-rotation
                  HostBudget(budget, every, StreamingLLM(sink=4, rerotate=False)),
                  {"max_tokens": 5 * C})
    decode_requests = [r for r in rec.requests if r[1] > 1]
    assert all(n + k <= budget for n, k, _ in rec.requests), rec.requests
    assert sum(k for _, k, _ in decode_requests) == 3 * 5 * C
    assert m.output_tokens == 3 * (5 * C + 1) and all(len(s.output_token_ids) == 5 * C + 1
                                                      for s in streams)
    assert m.edit_rounds >= 3 * 4 and m.parts["modify"].duration > 0
    live = {k for s in streams for k in s.keys}
    assert all(present(fake_ctx, sorted(live)))
    assert batch.release() == len(live)
    assert not any(present(fake_ctx, sorted(live)))


def test_budget_too_small_for_a_round_is_refused(fake_ctx, engine):
    batch = BatchedStream([create_request(fake_ctx, engine, prompt(C))], progress=False)
    with pytest.raises(ValueError, match="budget 600 leaves no room"):
        batch.run({"max_tokens": 1}, HostBudget(600, 100, StreamingLLM(sink=4)),
                  {"max_tokens": 50})
    with pytest.raises(ValueError, match="HostBudget.every must be a positive number"):
        HostBudget(600, 0, StreamingLLM(sink=4))
    with pytest.raises(TypeError, match="HostBudget.edit must be an edit fn"):
        HostBudget(600, 100, "streaming_llm")


def test_vllm_budgeted_run_stays_within_budget_as_vllm_reports(vllm_server, kv_server):
    from kvedit.sdk.openai import openai_completion

    budget, every, out = 3 * 256 + 64, 64, 4 * 256  # sink + window chunks + tail + round
    with connect(kv_server.url, kv_server.http_url, vllm_server.model, timeout=60) as ctx:
        rec = Recording(openai_completion(vllm_server.base_url, vllm_server.model))
        streams = [create_request(ctx, rec, prompt(256 + 50 + 30 * i), cache_salt="budget")
                   for i in range(2)]
        batch = BatchedStream(streams, progress=False)
        held: list[set[bytes]] = [set(s.keys) for s in streams]
        m = batch.run({"temperature": 0.0, "ignore_eos": True, "max_tokens": 1},
                      HostBudget(budget, every, StreamingLLM(sink=4)),
                      {"temperature": 0.0, "ignore_eos": True, "max_tokens": out})
        assert all(len(s.output_token_ids) == out + 1 for s in streams)
        # vLLM's own usage: prompt + completion tokens of every request within the budget
        usage = [u for _, _, u in rec.requests]
        assert len(usage) == 2 * (1 + out // every) and all(u is not None for u in usage)
        assert max(u["prompt_tokens"] + u["completion_tokens"] for u in usage) <= budget
        assert m.edit_rounds >= 2 * 2
        live = {k for s in streams for k in s.keys}
        assert all(present(ctx, sorted(live)))
        assert len(live) <= 2 * (budget // 256)
        assert batch.release() == len(live) and not any(present(ctx, sorted(live | held[0])))
