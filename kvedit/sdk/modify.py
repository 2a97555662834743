"""modify: retrieve a stream's KV, apply the user's fn, validate, store, swap, clean up.

What is edited: the full chunks of the stream's sequence (`tokens + suffix`) whose KV the
engine has computed (`Stream.kv_tokens`): after prefill the prompt's, after a decode the
prompt's and the generated tokens' (the connector stores those too), after an edit the
edited ones. So decode -> modify -> decode works for any number of rounds; the tokens after
the last full chunk stay in the suffix and are recomputed by the next decode.

Keys and edited data. The connector keys a chunk by (model, cache_salt, token prefix), so an
edit that changes KV data but keeps the tokens (zero V, quantize, ...) would produce chunks
whose keys already exist: the server would keep the ORIGINAL data and silently drop the edit.
So, for every edited chunk whose key is already present in the server, the SDK checks that
its data is byte-identical to what is stored. If all are, the salt stays and only chunks
with new keys are written (present ones are reused, not resent). Otherwise the stream
switches to a fresh derived salt `f"{salt}~kvedit-<12 hex>"`, stores ALL its edited chunks
under that salt's keys, and sends that salt with every later request; vLLM's own prefix
cache is salted too, so it cannot serve the stale blocks either.

The comparison is skipped for chunks that fn left untouched in place: with write tracking
(connect(track_writes=...), on by default on Linux) fn's tensor is a copy-on-write mapping
of the stored chunks themselves (kvedit.sdk.chunkmap; no retrieve copy at all) or of the
retrieve buffer (kvedit.sdk.buffers), so the kernel records every page fn wrote. Which of
the two a stream gets is decided once, in kvedit.sdk.source.open_kv.

Atomicity. The stream's tokens/salt/keys change only after the store has committed. If fn
raises, returns something invalid, or the store fails, the stream is unchanged, the error
names the stream and the reason, and the original chunks are untouched (still retrievable).
The same holds when a lease or store outlives the server's TTL (lease_expired /
store_expired): bytes read after a lease ran out are never stored, nothing is written into
slots past the write TTL (kvedit.client.handles). After a successful swap, the stream's old chunks
that no stream of the context references any more are deleted, unless `keep_old=True`.

Partial tail. Only full chunks have keys. If the edited length is not a multiple of the
chunk size, the trailing tokens move into the stream's suffix: they are re-sent and
recomputed by vLLM on the next decode (their edited KV is not used).

One mechanism for one rank and for tensor parallel (`ctx.tp`): the region is every rank's
keys of the same chunks, the wait covers every rank, the KVSource (kvedit.sdk.source) gives
fn all KV heads in one tensor (gathered from the ranks' chunks), and the store target
(kvedit.sdk.store) cuts fn's result per rank and stores every rank staged, with one salt for
all of them; that module says what holds across ranks when a store fails half-way.

The steps, in order: region -> wait -> queries -> open -> fn -> store -> swap -> drop unused.
Where a synchronous fn runs: in the context's thread pool (Context.run_fn), two streams' fns
side by side (`modify_concurrency`); in glibc_tuning's main-arena threads only when the
context was connected with tune_glibc_heap=True. A coroutine fn runs on the SDK's loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from kvedit.client.handles import KVError
from kvedit.sdk.contracts import Checked, check_result, fn_kwargs, is_async_fn, wants_queries
from kvedit.sdk.errors import ModifyError
from kvedit.sdk.geometry import KVGeometry
from kvedit.sdk.metrics import ModifyCounts
from kvedit.sdk.output import NewKV
from kvedit.sdk.queries import CapturedQueries, fetch, release_queries
from kvedit.sdk.source import KVSource, open_kv, untouched_chunks
from kvedit.sdk.store import Stored, derive_salt, store_kv
from kvedit.sdk.stream import Stream

log = logging.getLogger("kvedit.sdk")
__all__ = ["ModifyResult", "Stored", "check_result", "derive_salt", "modify_stream",
           "store_kv"]


@dataclass
class ModifyResult(ModifyCounts):
    """One stream's modify: its counts, whether its salt changed, whether it was skipped."""
    salt_changed: bool = False
    skipped: bool = False


@dataclass(frozen=True, slots=True)
class _Region:
    """What one modify edits: the first n full chunks of the stream's sequence, and their
    keys on every rank (index = rank; rank 0's are the stream's)."""
    n: int
    tokens: list[int]
    rank_keys: list[list[bytes]]


async def modify_stream(stream: Stream, fn, *, cpu_slots, keep_old: bool = False,
                        wait_timeout: float = 60.0, fn_in_caller: bool | None = None
                        ) -> ModifyResult:
    """Apply fn to one stream's KV (see the module docstring for the exact semantics).
    `fn_in_caller` is accepted for older callers and has no effect: fn never runs in the
    thread waiting in a synchronous SDK call."""
    if stream.released:
        raise ModifyError(stream, "the stream was released (arelease); it holds no KV any more")
    region = _region(stream)
    res = ModifyResult(tokens_before=len(region.tokens))
    if region.n == 0:  # shorter than one chunk: nothing is cached, nothing to edit
        res.skipped = True
        return res
    await _wait_stored(stream, region, wait_timeout)
    queries = await fetch(stream, fn, wait_timeout) if wants_queries(fn) else None
    held: list[KVSource] = []
    try:
        async with cpu_slots:
            new_tokens, stored = await _edit_and_store(stream, fn, region, res, queries, held)
    finally:  # after the slot: an unmapping (5-10 ms) does not hold up the next stream
        for source in held:
            await asyncio.get_running_loop().run_in_executor(None, source.release)
    old_keys = _swap(stream, region, new_tokens, stored, res)
    await release_queries(stream)   # they were the old sequence's: this stream is done with them
    await _drop_unused(stream, old_keys, keep_old, res)
    return res


def _region(stream: Stream) -> _Region:
    c = stream.ctx.chunk_size
    n = stream.kv_tokens // c
    tokens, keys = stream.prompt[:n * c], stream.keys[:n]
    try:
        return _Region(n, tokens, stream.ctx.rank_keys(keys, tokens, stream.cache_salt))
    except ValueError as e:
        raise ModifyError(stream, str(e)) from None


async def _wait_stored(stream: Stream, region: _Region, wait_timeout: float) -> None:
    """Server-side wait for every rank's chunks: the connectors store asynchronously to the
    completion's reply."""
    ctx = stream.ctx
    for r, keys in enumerate(region.rank_keys):
        on = f" on tensor-parallel rank {r}" if ctx.tp is not None else ""
        try:
            have = await ctx.call(ctx.client.lookup, ctx.model, keys, tp_rank=r,
                                  wait_timeout=wait_timeout)
        except Exception as e:
            raise ModifyError(stream, f"lookup of its chunks{on} failed: {e}") from e
        if have < region.n:
            raise ModifyError(stream, f"only {have} of its {region.n} full chunks are in the "
                                      f"kvedit server{on} after waiting {wait_timeout} s (was "
                                      f"it prefilled through a vLLM with the kvedit connector "
                                      f"on every worker, same model and salt, and "
                                      f"store_generated on if it decoded since?)")


async def _open(stream: Stream, region: _Region) -> tuple[KVSource, torch.Tensor]:
    ctx = stream.ctx
    try:
        return await ctx.call(open_kv, ctx, region.rank_keys)
    except KVError as e:
        if e.code != "lease_expired":
            raise ModifyError(stream, f"retrieving its KV failed: {e}") from e
        raise ModifyError(stream, f"its KV was copied out after the server's lease TTL ({e}); "
                                  f"the copy may not be its bytes, nothing was changed") from e
    except Exception as e:
        raise ModifyError(stream, f"retrieving its KV failed: {e}") from e


async def _apply(stream: Stream, fn, kv: torch.Tensor, tokens: list[int],
                 queries: CapturedQueries | None, new_kv: NewKV) -> Checked:
    """Run fn on kv (laid out as ctx.fn_layout) with the keywords EditFn's rules give it,
    and validate its result against that layout."""
    ctx = stream.ctx
    layout = ctx.fn_layout
    kwargs = fn_kwargs(fn, layout, new_kv=new_kv,
                       queries=None if queries is None else queries.queries,
                       query_start=None if queries is None else queries.start)
    try:
        if is_async_fn(fn):
            out = await fn(kv, list(tokens), **kwargs)
        else:
            out = await ctx.run_fn(fn, kv, list(tokens), **kwargs)
    except Exception as e:
        raise ModifyError(stream, f"fn raised {type(e).__name__}: {e}") from e
    try:
        return check_result(out, layout)
    except ValueError as e:
        raise ModifyError(stream, f"invalid edit: {e}") from None


async def _edit_and_store(stream: Stream, fn, region: _Region, res: ModifyResult,
                          queries: CapturedQueries | None,
                          held: list[KVSource]) -> tuple[list[int], Stored]:
    """Retrieve, fn, store; returns the edited tokens and what was stored. The source is
    closed here and appended to `held`: the caller releases it (KVSource.release)."""
    t0 = time.perf_counter()
    source, kv = await _open(stream, region)
    held.append(source)
    new_kv = NewKV(stream.ctx.outputs, kv.dtype)
    edited = None
    try:
        res.bytes_retrieved = kv.numel() * kv.element_size()
        given = KVGeometry.of(kv)  # before fn can touch (or resize) it
        t1 = time.perf_counter()
        edited = await _apply(stream, fn, kv, region.tokens, queries, new_kv)
        kv = None
        t2 = time.perf_counter()
        stored = await _store(stream, source, given, edited, region)
        res.retrieve_s, res.fn_s, res.store_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        return edited.tokens, stored
    finally:  # a buffer is reused (a mapping released) only once fn keeps no reference
        kv = edited = None
        new_kv.give_back()
        source.close()


async def _store(stream: Stream, source: KVSource, given: KVGeometry, edited: Checked,
                 region: _Region) -> Stored:
    ctx, c = stream.ctx, stream.ctx.chunk_size
    m = len(edited.tokens) // c
    try:
        # The page map can only vouch for chunks fn returned where kv had them: for an output
        # elsewhere (torch.cat) reading it would tell nothing.
        in_place = given.same_place(KVGeometry.of(edited.kv))
        written = await ctx.call(source.written_pages) if in_place else None
        untouched = untouched_chunks(written, given, edited.kv, range(min(region.n, m)), c)
        ctx.pool.note_outcome(written, len(untouched) / region.n + source.spares_copy)
        return await ctx.call(store_kv, ctx, edited.tokens[:m * c], stream.cache_salt,
                              edited.kv, region.rank_keys, untouched, source.check_lease,
                              edited.heads is not None)
    except KVError as e:
        if e.code not in ("lease_expired", "store_expired"):
            raise ModifyError(stream, f"storing the edited KV failed ({e}); {_kept(ctx)}") from e
        raise ModifyError(stream, f"the edit took longer than the server's TTL ({e}); nothing "
                                  f"was stored, {_kept(ctx)}") from e
    except Exception as e:
        raise ModifyError(stream, f"storing the edited KV failed ({type(e).__name__}: {e}); "
                                  f"{_kept(ctx)}") from e


def _kept(ctx) -> str:
    return "the original KV is kept" if ctx.tp is None else \
        "no rank uses it, the original KV is kept"


def _swap(stream: Stream, region: _Region, new_tokens: list[int], stored: Stored,
          res: ModifyResult) -> list[bytes]:
    """Committed: the stream now continues from the edited sequence (nothing can fail here).
    Returns the keys it referenced before."""
    ctx, c = stream.ctx, stream.ctx.chunk_size
    m = len(new_tokens) // c
    rest = stream.prompt[region.n * c:]
    stream.suffix = new_tokens[m * c:] + rest
    stream.tokens = new_tokens[:m * c]
    stream.kv_tokens = m * c
    res.salt_changed = stored.salt != stream.cache_salt
    stream.cache_salt = stored.salt
    old_keys, stream.keys = stream.keys, stored.keys
    ctx.remember(stored.rank_keys)   # so dropping them later deletes them on every rank
    ctx.ref(stored.keys)
    res.tokens_after, res.chunks_stored = m * c, stored.stored
    res.chunks_reused, res.chunks_compared = stored.reused, stored.compared
    res.bytes_stored = stored.stored * ctx.layout.chunk_bytes
    return old_keys


async def _drop_unused(stream: Stream, old_keys: list[bytes], keep_old: bool,
                       res: ModifyResult) -> None:
    """Delete the replaced chunks no stream of the context references any more."""
    ctx = stream.ctx
    dead = ctx.unref(old_keys)
    if dead and not keep_old:
        try:
            res.chunks_deleted = await ctx.call(ctx.delete_kv, dead)   # every TP rank
        except Exception as e:  # the edit is done; a failed clean-up only costs memory
            log.warning("%s: deleting %d old chunks failed: %s", stream.label, len(dead), e)
