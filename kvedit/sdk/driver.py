"""The budgeted driver: decode every stream in rounds of `every` tokens and edit it between
rounds so the KV the engine holds for it never exceeds `budget` tokens.

Each stream runs its own loop (prefill, then decode round / edit as needed / decode round
...), concurrently with the others: a stream being edited does not stop the others from
decoding (no global barrier per round), and a stream that finishes leaves the batch (its
chunks are released when `release=True`).

Budget rule. A decode round of n tokens sends the stream's sequence S (tokens + suffix) and
the engine holds at most |S| + n tokens of KV for it. Before a round with |S| + n > budget the
stream is edited: the policy keeps at most `budget - n - r` of the computed full-chunk region
(r = the tokens after that region, recomputed by the next round), so the round fits. A
DropPolicy (kvedit.edits) is fitted to that target by choosing its ratio; any other edit fn
is called as it is and must shorten the stream enough itself (else a StreamError).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

from kvedit.edits.base import DropPolicy
from kvedit.sdk.errors import StreamError
from kvedit.sdk.metrics import Metrics, Span, add_generation, add_modify
from kvedit.sdk.modify import ModifyResult, modify_stream
from kvedit.sdk.stream import Stream, get_max_tokens


@dataclass(frozen=True, slots=True)
class Budget:
    every: int   # tokens per decode round (edits happen only between rounds)
    budget: int  # most KV tokens the engine may hold for one stream

    def check(self, chunk_size: int) -> None:
        if self.every <= 0:
            raise ValueError(f"every must be a positive number of tokens, got {self.every}")
        if self.budget < self.every + 2 * chunk_size:
            raise ValueError(f"budget {self.budget} leaves no room for an edit: it must hold a "
                             f"decode round (every={self.every}), one kept chunk and the "
                             f"recomputed tail (up to one chunk of {chunk_size}): at least "
                             f"{self.every + 2 * chunk_size} tokens (a policy that keeps k "
                             f"chunks, e.g. StreamingLLM's sink + window = 2, needs "
                             f"every + (k + 1) chunks)")


def fitted(fn, keep_tokens: int):
    """fn, made to keep at most keep_tokens: a DropPolicy gets the ratio that drops enough
    of its units; any other fn is returned unchanged."""
    if not isinstance(fn, DropPolicy):
        return fn

    def fit(kv, tokens, layout=None):
        units = fn.units(kv.shape[2], layout)
        keep = keep_tokens // units.size
        drop = units.count - keep
        if drop <= 0:
            return kv, tokens
        if keep <= 0:
            raise ValueError(f"budget leaves room for {keep_tokens} tokens, less than one "
                             f"{fn.granularity} of {units.size}")
        # int(ratio * count) == drop: the policy drops exactly the units the budget needs
        return dataclasses.replace(fn, ratio=(drop + 0.5) / units.count)(kv, tokens,
                                                                          layout=layout)
    return fit


class _Busy:
    """Wall time during which at least one edit was running (edits overlap across streams)."""

    def __init__(self):
        self.running, self.since, self.seconds = 0, 0.0, 0.0

    def __enter__(self):
        if self.running == 0:
            self.since = time.perf_counter()
        self.running += 1

    def __exit__(self, *exc):
        self.running -= 1
        if self.running == 0:
            self.seconds += time.perf_counter() - self.since


async def drive(batch, prefill_params, fn, decode_params, budget: Budget, *,
                keep_old: bool = False, release: bool = False,
                wait_timeout: float = 60.0) -> Metrics:
    """The budgeted run of `batch` (BatchedStream.run(..., every=, budget=))."""
    streams = batch.streams
    for s in streams:
        budget.check(s.ctx.chunk_size)
    total = get_max_tokens(decode_params)
    if total is None:
        raise ValueError("a budgeted run needs max_tokens in the decode sampling params")
    names = ("prefill", "modify", "decode")
    parts = {p: Metrics(p, num_streams=len(streams)) for p in names}
    spans = {p: Span() for p in names}
    http = asyncio.Semaphore(batch.max_concurrency)
    cpu = batch._cpu_slots()
    busy = _Busy()

    async def edit(s: Stream, n: int) -> None:
        region = s.kv_tokens // s.ctx.chunk_size * s.ctx.chunk_size
        keep = budget.budget - n - (len(s.prompt) - region)
        with busy, spans["modify"]:
            # fn in the pool, not the waiting caller: these edits are small and overlap
            # decoding (docs/sdk.md, "Observations behind modify's design")
            r: ModifyResult = await modify_stream(s, fitted(fn, keep), cpu_slots=cpu,
                                                  keep_old=keep_old, wait_timeout=wait_timeout,
                                                  fn_in_caller=False)
        add_modify(parts["modify"], r)
        parts["modify"].edit_rounds += 1
        if len(s.prompt) + n > budget.budget:
            raise StreamError(s, f"after the edit it holds {len(s.prompt)} tokens; a round of "
                                 f"{n} more exceeds the budget {budget.budget} (the edit fn "
                                 f"must keep at most {keep} of the {region} edited tokens)")

    async def work(s: Stream) -> None:
        async with http:
            with spans["prefill"]:
                add_generation(parts["prefill"], await s.generate(prefill_params, 1))
        left = total
        while left > 0 and not s.done:
            n = min(budget.every, left)
            if len(s.prompt) + n > budget.budget:
                await edit(s, n)
            async with http:
                with spans["decode"]:
                    g = await s.generate(decode_params, n)
            add_generation(parts["decode"], g)
            left -= len(g.token_ids)
        if release:
            await s.arelease()

    run = Metrics("run", num_streams=len(streams), parts=parts)
    try:
        await batch._each("run", streams, work, run)
    finally:
        for p in ("prefill", "decode"):
            parts[p].duration = spans[p].seconds
        parts["modify"].duration = busy.seconds  # union of edit time, not first-to-last span
    run.input_tokens = parts["prefill"].input_tokens
    run.output_tokens = parts["prefill"].output_tokens + parts["decode"].output_tokens
    run.edit_rounds = parts["modify"].edit_rounds
    run.ttft, run.tpot = parts["decode"].ttft, parts["decode"].tpot
    return run
