"""KVzip's reconstruction pass through vLLM: the queries that score a cache for any question.

KVzip (kvedit.edits.KVzip) ranks a context's keys by the attention they receive while the
model repeats the context. `reconstruct` runs that pass for every stream: one request of

    region + repeat_ids + region[start:]

where `region` is what `modify` edits (the stream's full chunks), through the stream's own
engine and salt, asking vLLM to capture the queries of `repeat_ids + region[start:]` (the
window). The region's KV is already in the kvedit server, and a capturing request loads the
tokens before its window from there (docs/queries.md), so vLLM computes only the window:
the pass costs about one more prefill of the region, with attention over twice its length.
Afterwards each stream holds the pass's captured queries as its own: the next
`modify(KVzip(...))` receives them (rows after the region: every row sees every key), and
any number of later questions are answered from the one edited cache.

The pass's own chunks beyond the region (the repeat prompt and the copy) are deleted once
the server has them; vLLM's prefix cache keeps its blocks until it needs the room.

Bound: the window is at most MAX_WINDOW (4096) rows, so `len(repeat_ids) + len(region) -
start` must fit; a longer region is refused with the numbers (kvpress splits the
reconstruction into pieces of 2048 tokens, each with its own pass; not done here).
Passes in flight: the connector captures at most `max_capture_bytes` of queries at once (its
setting, 1 GiB by default) and a request past it gets none (vLLM's log says so; the client
would only see the queries missing), so `reconstruct` keeps the passes it runs at once under
`capture_bytes` (default half of the connector's default) of query rows.
Checked after each pass: its queries must be in the server (every rank) before the stream
holds them, else the pass fails with ReconstructError saying what may have refused them; a
refusal is only in vLLM's log, and without the check it surfaced as modify's MissingQueries
one wait_timeout later, naming no cause (an H200 eval: 24 of 24 KVzip streams).
"""
from __future__ import annotations

import asyncio
import time

from kvedit.query_contract import MAX_WINDOW, QueryShape
from kvedit.sdk import queries as Q
from kvedit.sdk.errors import StreamError, raise_batch
from kvedit.sdk.loop import run_sync
from kvedit.sdk.metrics import Metrics, add_generation
from kvedit.sdk.stream import Stream

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."  # kvpress's and the paper's
CAPTURE_BYTES = 512 << 20  # query rows of the passes in flight (the connector's default: 1 GiB)


class ReconstructError(StreamError):
    """The reconstruction pass could not run for a stream; the stream is unchanged."""


def pass_prompt(stream: Stream, repeat_ids: list[int], start: int = 0) -> tuple[list[int], int]:
    """(the pass's prompt, its window W) for `stream`; ReconstructError when it cannot run."""
    c = stream.ctx.chunk_size
    region = stream.prompt[: stream.kv_tokens // c * c]
    if not region:
        raise ReconstructError(stream, f"it holds no full chunk of {c} tokens in the server "
                                       "(prefill it first): there is no cached KV to score")
    if not 0 <= start < len(region):
        raise ReconstructError(stream, f"start must be a token index in [0, {len(region)}) "
                                       f"(the edited region), got {start}")
    window = len(repeat_ids) + len(region) - start
    if window > MAX_WINDOW:
        raise ReconstructError(
            stream, f"the pass would capture {window} query rows ({len(repeat_ids)} repeat "
                    f"tokens + {len(region) - start} repeated tokens), more than the capture "
                    f"bound {MAX_WINDOW}: skip a prefix with start= or edit a shorter region")
    return region + list(repeat_ids) + region[start:], window


async def _one(stream: Stream, repeat_ids, start: int, params, wait_timeout: float,
               m: Metrics) -> None:
    prompt, window = pass_prompt(stream, repeat_ids, start)
    ctx = stream.ctx
    n = stream.kv_tokens // ctx.chunk_size  # the region's chunks
    # The region must be in the server for the pass to load it rather than compute it.
    await ctx.call(ctx.client.lookup, ctx.model, stream.keys[:n], wait_timeout=wait_timeout)
    probe = Stream(ctx, stream.post_completion, prompt, stream.cache_salt,
                   name="reconstruction", capture_queries=window)
    try:
        add_generation(m, await probe.generate(params, max_tokens=1, capture_queries=window))
        await _check_captured(stream, probe.queries, wait_timeout)
        Q.hold(stream, probe.queries)   # the stream's own now: modify hands them to fn
        extra = probe.keys[n:]          # the repeat prompt's and the copy's chunks
        if extra:                       # stored asynchronously: delete them once they land
            await ctx.call(ctx.client.lookup, ctx.model, extra, wait_timeout=wait_timeout)
    finally:
        await probe.arelease()


async def _check_captured(stream: Stream, cap: Q.Capture, wait_timeout: float) -> None:
    """ReconstructError unless every rank's server holds the pass's queries. The connector
    stores them before vLLM returns the pass's token, so the wait ends at once when they are
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
        raise ReconstructError(
            stream, f"its reconstruction pass ran, but the kvedit server has no captured "
                    f"queries for it{on} after waiting {wait_timeout} s (window {cap.window}: "
                    f"{cap.rows} rows{size}). vLLM's log says which refused them: the "
                    f"server (too_large: --max-query-bytes under the object's size), the "
                    f"connector (max_capture_bytes in flight, query capture off) or a step "
                    f"that lost them (a full CUDA graph); or the server evicted them at once "
                    f"(a larger --l1-size-gb keeps them)")


def _in_flight(streams, repeat_ids, start: int, capture_bytes: int) -> int:
    """How many passes may run at once: as many of the largest as fit in capture_bytes of
    query rows on the busiest rank, at least one."""
    worst = 0
    for s in streams:
        try:
            _, window = pass_prompt(s, repeat_ids, start)
        except ReconstructError:
            continue  # reported by its own pass
        for layout in s.ctx.layouts:
            try:
                worst = max(worst, window * QueryShape.of(layout, window).row_bytes)
            except ValueError:
                pass    # no query heads registered: the pass's fetch says so
    return max(1, capture_bytes // worst) if worst else len(streams) or 1


async def areconstruct(streams, repeat_ids, *, start: int = 0, sampling_params=None,
                       wait_timeout: float = 60.0,
                       capture_bytes: int = CAPTURE_BYTES) -> Metrics:
    """Run KVzip's reconstruction pass for every stream (module docstring), concurrently.
    `repeat_ids`: the repeat prompt's token ids (e.g. the tokenizer's encoding of
    REPEAT_PROMPT followed by the chat template's end of the user turn and start of the
    assistant's); `start`: the first region token repeated (e.g. after the chat template's
    opening, as kvpress). `capture_bytes`: query rows of the passes run at once (module
    docstring; keep it at or under the connector's `max_capture_bytes`). Returns
    Metrics("reconstruct"): the pass's prompt and cached tokens and its wall time (its cost
    against the plain prefill)."""
    streams = list(streams)
    ids = [int(t) for t in repeat_ids]
    if not ids:
        raise ValueError("repeat_ids is empty: the pass needs a prompt that asks the model "
                         "to repeat its context (REPEAT_PROMPT, tokenized)")
    m = Metrics("reconstruct", num_streams=len(streams))
    gate = asyncio.Semaphore(_in_flight(streams, ids, start, capture_bytes))

    async def one(s):
        async with gate:
            await _one(s, ids, start, sampling_params, wait_timeout, m)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(s) for s in streams), return_exceptions=True)
    m.duration = time.perf_counter() - t0
    errors = []
    for s, r in zip(streams, results):
        if isinstance(r, StreamError):
            errors.append(r if r.stream is s else ReconstructError(
                s, f"its reconstruction pass failed: {r.reason}"))
        elif isinstance(r, Exception):
            err = ReconstructError(s, f"the reconstruction pass raised {type(r).__name__}: {r}")
            err.__cause__ = r
            errors.append(err)
        elif isinstance(r, BaseException):
            raise r
    raise_batch("reconstruct", errors, len(streams))
    return m


def reconstruct(streams, repeat_ids, *, start: int = 0, sampling_params=None,
                wait_timeout: float = 60.0, capture_bytes: int = CAPTURE_BYTES) -> Metrics:
    """The synchronous `areconstruct`."""
    return run_sync(areconstruct(streams, repeat_ids, start=start,
                                 sampling_params=sampling_params, wait_timeout=wait_timeout,
                                 capture_bytes=capture_bytes))


def share_queries(src: Stream, dst: Stream) -> None:
    """`dst` (a stream of the same prompt and salt, e.g. a fresh one per edit) holds the
    queries `src` holds, so one reconstruction pass serves several edits."""
    if src.queries is None:
        raise ReconstructError(src, "it holds no captured queries to share (run "
                                    "reconstruct() first)")
    Q.hold(dst, src.queries)
