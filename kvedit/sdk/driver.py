"""The budgeted run the host keeps (`HostBudget`): decode every stream in rounds of `every`
tokens and edit it between rounds so the KV the engine holds for it never exceeds `tokens`.

Each stream runs its own loop (prefill, then decode round / edit as needed / decode round
...), concurrently with the others: a stream being edited does not stop the others from
decoding (no global barrier per round), and a stream that finishes leaves the batch (its
chunks are released when `release=True`).

Budget rule. A decode round of n tokens sends the stream's sequence S (tokens + suffix) and
the engine holds at most |S| + n tokens of KV for it. Before a round with |S| + n > tokens
the stream is edited: the edit keeps at most `tokens - n - r` of the computed full-chunk
region (r = the tokens after that region, recomputed by the next round), so the round fits.
An edit that `Fits` (a kvedit.edits policy, kvedit.sdk.contracts) is fitted to that target;
any other edit fn is called as it is and must shorten the stream enough itself (else a
StreamError). The same budget kept inside vLLM is a kvedit.EngineBudget (engine_run.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from kvedit.sdk.contracts import fitted
from kvedit.sdk.errors import StreamError
from kvedit.sdk.metrics import Busy, Metrics, RunMetrics, add_generation, add_modify
from kvedit.sdk.modify import ModifyResult, modify_stream
from kvedit.sdk.stream import Stream, get_max_tokens


@dataclass(frozen=True)
class HostBudget:
    """A budget the host keeps by round trips: `tokens`, the most KV tokens the engine may
    hold for one stream; `every`, tokens per decode round (edits happen only between rounds);
    `edit`, the edit fn (or kvedit.edits policy) that shortens a stream. Given to
    `BatchedStream.run` where an edit fn goes."""
    tokens: int
    every: int
    edit: Callable

    def __post_init__(self):
        for name in ("tokens", "every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"HostBudget.{name} must be a positive number of tokens, "
                                 f"got {v!r}")
        if not callable(self.edit):
            raise TypeError(f"HostBudget.edit must be an edit fn or a kvedit.edits policy, "
                            f"got {type(self.edit).__name__}")

    def check(self, chunk_size: int) -> None:
        if self.tokens < self.every + 2 * chunk_size:
            raise ValueError(f"budget {self.tokens} leaves no room for an edit: it must hold "
                             f"a decode round (every={self.every}), one kept chunk and the "
                             f"recomputed tail (up to one chunk of {chunk_size}): at least "
                             f"{self.every + 2 * chunk_size} tokens (a policy that keeps k "
                             f"chunks, e.g. StreamingLLM's sink + window = 2, needs "
                             f"every + (k + 1) chunks)")


async def drive(batch, prefill_params, budget: HostBudget, decode_params, *,
                keep_old: bool = False, release: bool = False,
                wait_timeout: float = 60.0) -> Metrics:
    """The budgeted run of `batch` (BatchedStream.run given a HostBudget)."""
    streams = batch.streams
    for s in streams:
        budget.check(s.ctx.chunk_size)
    total = get_max_tokens(decode_params)
    if total is None:
        raise ValueError("a budgeted run needs max_tokens in the decode sampling params")
    rm = RunMetrics(len(streams))
    parts, spans = rm.parts, rm.spans
    http = asyncio.Semaphore(batch.max_concurrency)
    cpu = batch.cpu_slots()
    busy = Busy()

    async def edit(s: Stream, n: int, memo: dict) -> None:
        region = s.kv_tokens // s.ctx.chunk_size * s.ctx.chunk_size
        keep = budget.tokens - n - (len(s.prompt) - region)
        with busy:
            # fn in the pool, not the waiting caller: these edits are small and overlap
            # decoding (docs/sdk.md, "Observations behind modify's design")
            r: ModifyResult = await modify_stream(s, fitted(budget.edit, keep, memo),
                                                  cpu_slots=cpu,
                                                  keep_old=keep_old, wait_timeout=wait_timeout,
                                                  fn_in_caller=False)
        add_modify(parts["modify"], r)
        parts["modify"].edit_rounds += 1
        if len(s.prompt) + n > budget.tokens:
            raise StreamError(s, f"after the edit it holds {len(s.prompt)} tokens; a round of "
                                 f"{n} more exceeds the budget {budget.tokens} (the edit fn "
                                 f"must keep at most {keep} of the {region} edited tokens)")

    async def work(s: Stream) -> None:
        memo = {"prompt_tokens": len(s.prompt)}   # the edit's own state, one per stream
        async with http:
            with spans["prefill"]:
                # a query-aware edit (SnapKV, PromptAnchored) reads the prefill's queries
                add_generation(parts["prefill"], await s.generate(
                    prefill_params, 1, capture_queries=batch.query_window(s)))
        left = total
        while left > 0 and not s.done:
            n = min(budget.every, left)
            if len(s.prompt) + n > budget.tokens:
                await edit(s, n, memo)
            async with http:
                with spans["decode"]:
                    g = await s.generate(decode_params, n)
            add_generation(parts["decode"], g)
            left -= len(g.token_ids)
        if release:
            await s.arelease()

    try:
        await batch.each("run", streams, work, rm.run)
    finally:
        rm.close(modify=busy.seconds)   # union of edit time, not first-to-last span
    return rm.result()
