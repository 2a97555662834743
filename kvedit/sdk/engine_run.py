"""The in-engine budgeted run: every stream sends ONE request that asks vLLM to keep its KV
within the budget (kvedit.budget); vLLM compacts it in place as it decodes, so nothing
returns to the host and no request is sent again (`BatchedStream.run(..., in_engine=True)`).

The result has the shape of the host path's budgeted run (kvedit.sdk.driver): a "run"
Metrics whose parts are prefill (the first token), modify (empty: edits happen inside the
engine; vLLM's log has their counts) and decode (the other tokens), so the two compare.
"""
from __future__ import annotations

import asyncio

from kvedit.budget import EngineBudget
from kvedit.sdk.metrics import Metrics, Span
from kvedit.sdk.stream import Stream, get_max_tokens


async def drive_in_engine(batch, decode_params, budget: EngineBudget, *,
                          release: bool = False) -> Metrics:
    """Each stream: one request of max_tokens + 1 tokens (the prefill's token and the
    decode's) under `budget`."""
    streams = batch.streams
    total = get_max_tokens(decode_params)
    if total is None:
        raise ValueError("an in-engine budgeted run needs max_tokens in the decode sampling "
                         "params")
    names = ("prefill", "modify", "decode")
    parts = {p: Metrics(p, num_streams=len(streams)) for p in names}
    decode = Span()
    http = asyncio.Semaphore(batch.max_concurrency)

    async def work(s: Stream) -> None:
        own = s.budget
        s.budget = budget if own is None else own
        try:
            async with http:
                with decode:
                    g = await s.generate(decode_params, total + 1)
        finally:
            s.budget = own
        n = len(g.token_ids)
        p, d = parts["prefill"], parts["decode"]
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

    run = Metrics("run", num_streams=len(streams), parts=parts)
    try:
        await batch._each("run", streams, work, run)
    finally:
        parts["decode"].duration = decode.seconds  # prefill and decode are one request here
    run.input_tokens = parts["prefill"].input_tokens
    run.output_tokens = parts["prefill"].output_tokens + parts["decode"].output_tokens
    run.ttft, run.tpot = parts["prefill"].ttft, parts["decode"].tpot
    return run
