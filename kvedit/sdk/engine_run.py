"""The budgeted run kept inside vLLM (`BatchedStream.run` given a kvedit.EngineBudget): every
stream sends ONE request that asks vLLM to keep its KV within the budget (kvedit.engine_budget);
vLLM compacts it in place as it decodes, so nothing returns to the host and no request is
sent again. A stream created with a budget of its own asks for that one.

The result has the shape of the host-kept run's (kvedit.sdk.driver): a "run" Metrics whose
parts are prefill (the first token), modify (empty: edits happen inside the engine; vLLM's
log has their counts) and decode (the other tokens), so the two compare.
"""
from __future__ import annotations

import asyncio

from kvedit.engine_budget import EngineBudget
from kvedit.sdk.metrics import Metrics, RunMetrics
from kvedit.sdk.stream import Stream, get_max_tokens


async def drive_in_engine(batch, budget: EngineBudget, decode_params, *,
                          release: bool = False) -> Metrics:
    """Each stream: one request of max_tokens + 1 tokens (the prefill's token and the
    decode's) under `budget`."""
    streams = batch.streams
    total = get_max_tokens(decode_params)
    if total is None:
        raise ValueError("an in-engine budgeted run needs max_tokens in the decode sampling "
                         "params")
    rm = RunMetrics(len(streams))
    p, d = rm.parts["prefill"], rm.parts["decode"]
    http = asyncio.Semaphore(batch.max_concurrency)

    async def work(s: Stream) -> None:
        async with http:
            with rm.spans["decode"]:   # prefill and decode are one request here
                g = await s.generate(decode_params, total + 1, budget=budget)
        n = len(g.token_ids)
        p.input_tokens += g.prompt_tokens
        p.output_tokens += min(1, n)
        p.add_cached(g.cached_tokens)
        d.output_tokens += max(0, n - 1)
        if g.ttft is not None:
            p.ttft.append(g.ttft)
        if g.tpot is not None:
            d.tpot.append(g.tpot)
        if release:
            await s.arelease()

    try:
        await batch.each("run", streams, work, rm.run)
    finally:
        rm.close()
    return rm.result(ttft_of="prefill")
