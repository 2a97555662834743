"""BatchedStream: prefill → modify → decode over many streams, plus a pipelined run() (with
or without a budget) and repair (a compressed stream mended for a new question).

Every phase is a coroutine on one event loop: HTTP streams run concurrently (bounded by
`max_concurrency`), the server's blocking calls run in the context's thread pool, and the
CPU side of modify (retrieve copy, fn, compare, store copy) is bounded by
`modify_concurrency`. The synchronous methods run the coroutines on kvedit's background
loop; the `a`-prefixed ones are the async API.
"""
from __future__ import annotations

import asyncio
import os
import time

from tqdm.auto import tqdm

from kvedit.engine_budget import EngineBudget
from kvedit.query_contract import check_window
from kvedit.sdk.driver import HostBudget, drive
from kvedit.sdk.engine_run import drive_in_engine
from kvedit.sdk.errors import KVEditError, StreamError, raise_batch
from kvedit.sdk.loop import run_sync
from kvedit.sdk.metrics import Metrics, RunMetrics, add_generation, add_modify
from kvedit.sdk.modify import modify_stream
from kvedit.sdk.originals import Originals
from kvedit.sdk.queries import expect
from kvedit.sdk.repair import IfEvicted, RepairMetrics, check_how, repair_stream
from kvedit.sdk.stream import Stream


def _progress_default() -> bool:
    return os.environ.get("KVEDIT_PROGRESS", "1").lower() not in ("0", "false", "no", "off")


class BatchedStream:
    """A batch of streams. `progress` shows tqdm bars (default on; KVEDIT_PROGRESS=0 hides)."""

    def __init__(self, streams=(), *, progress: bool | None = None, max_concurrency: int = 256,
                 modify_concurrency: int = 2, wait_timeout: float = 60.0,
                 capture_queries: int = 0):
        self.streams: list[Stream] = []
        # query window W for the prefill of streams that set none (kvedit.sdk.queries)
        self.capture_queries = check_window(capture_queries, "capture_queries") or 0
        self.progress = _progress_default() if progress is None else progress
        self.max_concurrency = max_concurrency
        self.modify_concurrency = modify_concurrency
        self.wait_timeout = wait_timeout
        for s in streams:
            self.add(s)

    def add(self, stream: Stream) -> Stream:
        if not isinstance(stream, Stream):
            raise TypeError(f"add() takes a Stream from create_request, got "
                            f"{type(stream).__name__}")
        if any(s is stream for s in self.streams):
            raise ValueError(f"{stream.label} is already in this batch")
        self.streams.append(stream)
        if stream.capture_queries is None and stream.queries is None:
            expect(stream, self.capture_queries)   # the batch's default window
        return stream

    def __len__(self) -> int:
        return len(self.streams)

    def query_window(self, s: Stream) -> int:
        """The query window s's prefill asks for: its own setting, else the batch's."""
        return self.capture_queries if s.capture_queries is None else s.capture_queries

    def __iter__(self):
        return iter(self.streams)

    def _bar(self, desc: str, total: int):
        return tqdm(total=total, desc=desc, unit="stream", disable=not self.progress,
                    leave=False)

    async def each(self, phase: str, streams, work, m: Metrics) -> None:
        """Run work(stream) for all streams under a progress bar, timing the phase into
        m.duration; raise the stream errors once all have finished."""
        bar = self._bar(phase, len(streams))
        start = time.perf_counter()
        try:
            await self._gather(phase, streams, work, bar)
        finally:
            m.duration = time.perf_counter() - start

    async def _gather(self, phase: str, streams, work, bar) -> None:
        async def one(s):
            try:
                await work(s)
            finally:
                bar.update(1)
        results = await asyncio.gather(*(one(s) for s in streams), return_exceptions=True)
        bar.close()
        errors = []
        for s, r in zip(streams, results):
            if isinstance(r, KVEditError):
                errors.append(r)
            elif isinstance(r, Exception):  # unexpected: name the stream, keep the cause
                err = StreamError(s, f"{phase} raised {type(r).__name__}: {r}")
                err.__cause__ = r
                errors.append(err)
            elif isinstance(r, BaseException):  # cancellation, Ctrl-C: not a stream failure
                raise r
        raise_batch(phase, errors, len(streams))

    def cpu_slots(self) -> asyncio.Semaphore:
        """Bounds the CPU side of modify; each slot may keep one reusable retrieve buffer and
        one new_kv output."""
        for ctx in {id(s.ctx): s.ctx for s in self.streams}.values():
            for pool in (ctx.pool, ctx.outputs):   # retrieve buffers, new_kv outputs
                pool.max_buffers = max(pool.max_buffers, self.modify_concurrency)
        return asyncio.Semaphore(self.modify_concurrency)

    # ---- async API -------------------------------------------------------------------
    async def aprefill(self, sampling_params=None) -> Metrics:
        """Send every prompt with max_tokens=1, concurrently; the token joins the suffix."""
        m = Metrics("prefill", num_streams=len(self.streams))
        http = asyncio.Semaphore(self.max_concurrency)

        async def work(s: Stream):
            async with http:
                add_generation(m, await s.generate(sampling_params, max_tokens=1,
                                                   capture_queries=self.query_window(s)))

        await self.each("prefill", self.streams, work, m)
        return m

    async def amodify(self, fn, *, keep_old: bool = False, wait_timeout: float | None = None,
                      originals: Originals | None = None) -> Metrics:
        """Apply fn(kv, tokens[, layout=]) -> (kv, tokens) to every stream (kvedit.sdk.modify).
        `originals`: each stream's region before the edit stays in the server, in that
        ledger, so `repair` can mend the stream for a later question (kvedit.sdk.repair)."""
        m = Metrics("modify", num_streams=len(self.streams))
        cpu = self.cpu_slots()
        wait = self.wait_timeout if wait_timeout is None else wait_timeout

        async def work(s: Stream):
            kept = originals.snapshot(s) if originals is not None else None
            after = len(s.prompt) - len(kept.tokens) if kept is not None else 0
            try:
                add_modify(m, await modify_stream(s, fn, cpu_slots=cpu, keep_old=keep_old,
                                                   wait_timeout=wait))
            except BaseException:
                if kept is not None:
                    await originals.abandon(kept)
                raise
            if kept is not None:
                await originals.admit(s, kept, after)

        await self.each("modify", self.streams, work, m)
        return m

    async def adecode(self, sampling_params=None) -> Metrics:
        """Send tokens + suffix of every stream not done; generated tokens join the suffix."""
        live = [s for s in self.streams if not s.done]
        m = Metrics("decode", num_streams=len(live))
        http = asyncio.Semaphore(self.max_concurrency)

        async def work(s: Stream):
            async with http:
                add_generation(m, await s.generate(sampling_params))

        await self.each("decode", live, work, m)
        return m

    async def arepair(self, how, *, originals: Originals,
                      sampling_params=None, first_token: bool = True,
                      window: int | None = None, if_evicted: IfEvicted = "skip",
                      wait_timeout: float | None = None) -> RepairMetrics:
        """Mend every stream compressed with `modify(fn, originals=...)` for what was
        appended to it since (the new question), from its original (kvedit.sdk.repair):
        `how` the query-aware edit that re-selects (a kvedit.edits.Repair naming the policy
        that compressed the streams), fitted to each stream's compressed size;
        `first_token` (default) keeps the capture pass's answer token as the answer's
        first (False: every answer token is decoded on the repaired cache),
        `window` captures only the last rows of the turn, `if_evicted` "skip" or
        "recompute" an original no longer in the server."""
        check_how(how)
        m = RepairMetrics("repair", num_streams=len(self.streams))
        http = asyncio.Semaphore(self.max_concurrency)
        cpu = self.cpu_slots()
        wait = self.wait_timeout if wait_timeout is None else wait_timeout

        async def work(s: Stream):
            async with http:
                await repair_stream(s, originals, how, params=sampling_params, cpu_slots=cpu,
                                    m=m, first_token=first_token, window=window,
                                    if_evicted=if_evicted, wait_timeout=wait)

        await self.each("repair", self.streams, work, m)
        return m

    async def arun(self, prefill_params, fn, decode_params, *, keep_old: bool = False,
                   wait_timeout: float | None = None, release: bool = False) -> Metrics:
        """Pipelined prefill → modify → decode: each stream is modified as soon as its own
        prefill is stored and decodes as soon as its own modify is done (no phase barriers).
        Returns Metrics("run") with the end-to-end duration; `parts` holds each phase's
        counters, their `duration` being the span from its first start to its last end.

        `fn` is an edit fn, or a budget the run keeps each stream within as it decodes:
        a HostBudget (kvedit.sdk.driver: decode rounds of `every` tokens, the stream edited
        between rounds whenever the next would make the engine hold more than `tokens` of
        its KV), or a kvedit.EngineBudget (kvedit.sdk.engine_run: one request per stream,
        vLLM compacts its KV in place; prefill_params are not used, the request's first
        token is its prefill). With a budget, `release` frees a finished stream's chunks."""
        wait = self.wait_timeout if wait_timeout is None else wait_timeout
        if isinstance(fn, EngineBudget):
            return await drive_in_engine(self, fn, decode_params, release=release)
        if isinstance(fn, HostBudget):
            return await drive(self, prefill_params, fn, decode_params, keep_old=keep_old,
                               release=release, wait_timeout=wait)
        rm = RunMetrics(len(self.streams))
        parts, spans = rm.parts, rm.spans
        http = asyncio.Semaphore(self.max_concurrency)
        cpu = self.cpu_slots()

        async def work(s: Stream):
            async with http:
                with spans["prefill"]:
                    add_generation(parts["prefill"], await s.generate(
                        prefill_params, 1, capture_queries=self.query_window(s)))
            with spans["modify"]:
                add_modify(parts["modify"], await modify_stream(
                    s, fn, cpu_slots=cpu, keep_old=keep_old, wait_timeout=wait))
            async with http:
                with spans["decode"]:
                    add_generation(parts["decode"], await s.generate(decode_params))

        try:
            await self.each("run", self.streams, work, rm.run)
        finally:
            rm.close()
        return rm.result()

    # ---- synchronous facade ----------------------------------------------------------
    def prefill(self, sampling_params=None) -> Metrics:
        return run_sync(self.aprefill(sampling_params))

    def modify(self, fn, *, keep_old: bool = False, wait_timeout: float | None = None,
               originals: Originals | None = None) -> Metrics:
        return run_sync(self.amodify(fn, keep_old=keep_old, wait_timeout=wait_timeout,
                                     originals=originals))

    def repair(self, how, *, originals: Originals, sampling_params=None,
               first_token: bool = True, window: int | None = None,
               if_evicted: IfEvicted = "skip",
               wait_timeout: float | None = None) -> RepairMetrics:
        return run_sync(self.arepair(how, originals=originals, sampling_params=sampling_params,
                                     first_token=first_token, window=window,
                                     if_evicted=if_evicted, wait_timeout=wait_timeout))

    def decode(self, sampling_params=None) -> Metrics:
        return run_sync(self.adecode(sampling_params))

    def run(self, prefill_params, fn, decode_params, *, keep_old: bool = False,
            wait_timeout: float | None = None, release: bool = False) -> Metrics:
        return run_sync(self.arun(prefill_params, fn, decode_params, keep_old=keep_old,
                                  wait_timeout=wait_timeout, release=release))

    async def arelease(self) -> int:
        """Release every stream's chunks (Stream.arelease); returns the chunks deleted."""
        return sum([await s.arelease() for s in self.streams])

    def release(self) -> int:
        return run_sync(self.arelease())


LMCacheBatchedStream = BatchedStream  # the LMCache SDK's name, so ported scripts run unchanged
