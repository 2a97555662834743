"""Capturing passes: one more request per stream, whose captured queries the stream then holds.

Why a module of its own: KVzip's reconstruction pass (`kvzip.py`: the context, a repeat
prompt and the context again) and the context pass (`context_pass.py`: the context alone)
differ only in the prompt they send and the window they capture. The rest is one mechanism:
the stream's editable region must be in the kvedit server (the pass loads it rather than
computing it: vLLM computes only the captured window); the pass is a throw-away stream of
the same salt asking for one token; its queries must really be in the server before the
stream holds them (a refusal is only in vLLM's log); the pass's own chunks past the region
are deleted; and the passes in flight stay under `capture_bytes` of query rows (the
connector captures at most `max_capture_bytes` at once and a request past it gets none).
Afterwards each stream holds the pass's queries as its own: the next `modify` hands them to
a policy that scores with them, and `share_queries` lets other streams of the same prompt
and salt hold them too.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from kvedit.query_contract import QueryShape
from kvedit.sdk import queries as Q
from kvedit.sdk.errors import StreamError, raise_batch
from kvedit.sdk.metrics import Metrics, add_generation
from kvedit.sdk.stream import Stream

CAPTURE_BYTES = 512 << 20  # query rows of the passes in flight (the connector's default: 1 GiB)


class PassError(StreamError):
    """A capturing pass could not run for a stream; the stream is unchanged."""


# stream -> (the pass's prompt, its window W); raises a PassError when it cannot run
Build = Callable[[Stream], "tuple[list[int], int]"]


def region(stream: Stream, error: type[PassError], what: str) -> list[int]:
    """The stream's editable region (its full chunks): what a pass scores or repeats."""
    c = stream.ctx.chunk_size
    out = stream.prompt[: stream.kv_tokens // c * c]
    if not out:
        raise error(stream, f"it holds no full chunk of {c} tokens in the server (prefill it "
                            f"first): there is no cached KV for {what}")
    return out


async def _one(stream: Stream, build: Build, name: str, error: type[PassError], params,
               wait_timeout: float, m: Metrics) -> None:
    prompt, window = build(stream)
    ctx = stream.ctx
    n = stream.kv_tokens // ctx.chunk_size  # the region's chunks
    # The region must be in the server for the pass to load it rather than compute it.
    await ctx.call(ctx.client.lookup, ctx.model, stream.keys[:n], wait_timeout=wait_timeout)
    probe = Stream(ctx, stream.post_completion, prompt, stream.cache_salt, name=name,
                   capture_queries=window)
    try:
        add_generation(m, await probe.generate(params, max_tokens=1, capture_queries=window))
        await _check_captured(stream, probe.queries, wait_timeout, name, error)
        Q.hold(stream, probe.queries)   # the stream's own now: modify hands them to fn
        extra = probe.keys[n:]          # the pass's chunks past the region
        if extra:                       # stored asynchronously: delete them once they land
            await ctx.call(ctx.client.lookup, ctx.model, extra, wait_timeout=wait_timeout)
    finally:
        await probe.arelease()


async def _check_captured(stream: Stream, cap: Q.Capture, wait_timeout: float, name: str,
                          error: type[PassError]) -> None:
    """`error` unless every rank's server holds the pass's queries. The connector stores
    them before vLLM returns the pass's token, so the wait ends at once when they are
    there; when they are not, nothing else would say so: the connector's refusals are in
    vLLM's log only."""
    ctx = stream.ctx
    for r in range(len(cap.keys)):
        if await Q.stored(ctx, cap, r, wait_timeout):
            continue
        on = f" on tensor-parallel rank {r}" if r else ""
        try:
            size = f", {QueryShape.of(ctx.layouts[r], cap.rows).nbytes} bytes"
        except ValueError:
            size = ""   # no query heads registered: the shape (and modify) says so
        raise error(
            stream, f"its {name} pass ran, but the kvedit server has no captured queries "
                    f"for it{on} after waiting {wait_timeout} s (window {cap.window}: "
                    f"{cap.rows} rows{size}). vLLM's log says which refused them: the "
                    f"server (too_large: --max-query-bytes under the object's size), the "
                    f"connector (max_capture_bytes in flight, query capture off) or a step "
                    f"that lost them (a full CUDA graph); or the server evicted them at once "
                    f"(a larger --l1-size-gb keeps them)")


def in_flight(streams, build: Build, capture_bytes: int) -> int:
    """How many passes may run at once: as many of the largest as fit in capture_bytes of
    query rows on the busiest rank, at least one."""
    worst = 0
    for s in streams:
        try:
            _, window = build(s)
        except PassError:
            continue  # reported by its own pass
        for layout in s.ctx.layouts:
            try:
                worst = max(worst, window * QueryShape.of(layout, window).row_bytes)
            except ValueError:
                pass    # no query heads registered: the pass's fetch says so
    return max(1, capture_bytes // worst) if worst else len(streams) or 1


async def arun(streams, build: Build, *, name: str, phase: str,
               error: type[PassError] = PassError, sampling_params=None,
               wait_timeout: float = 60.0, capture_bytes: int = CAPTURE_BYTES) -> Metrics:
    """Run `build`'s pass for every stream, concurrently (module docstring): `name` names the
    pass in errors and the pass's stream, `phase` the Metrics and a batch's error. Returns
    Metrics(phase): the passes' prompt and cached tokens and their wall time."""
    streams = list(streams)
    m = Metrics(phase, num_streams=len(streams))
    gate = asyncio.Semaphore(in_flight(streams, build, capture_bytes))

    async def one(s):
        async with gate:
            await _one(s, build, name, error, sampling_params, wait_timeout, m)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(s) for s in streams), return_exceptions=True)
    m.duration = time.perf_counter() - t0
    errors = []
    for s, r in zip(streams, results):
        if isinstance(r, StreamError):
            errors.append(r if r.stream is s else error(
                s, f"its {name} pass failed: {r.reason}"))
        elif isinstance(r, Exception):
            err = error(s, f"the {name} pass raised {type(r).__name__}: {r}")
            err.__cause__ = r
            errors.append(err)
        elif isinstance(r, BaseException):
            raise r
    raise_batch(phase, errors, len(streams))
    return m


def share_queries(src: Stream, dst: Stream) -> None:
    """`dst` (a stream of the same prompt and salt, e.g. a fresh one per edit) holds the
    queries `src` holds, so one pass serves several edits."""
    if src.queries is None:
        raise PassError(src, "it holds no captured queries to share (run its pass first)")
    Q.hold(dst, src.queries)
