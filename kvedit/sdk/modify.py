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

Tensor parallel (`ctx.tp`): the same steps over every rank's chunks, fn seeing all KV heads
gathered; kvedit.sdk.tp_edit holds that path and says what it guarantees across ranks.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import torch

from kvedit.client.handles import KVError
from kvedit.sdk.alloc import pool_reuses_memory, run_fn
from kvedit.sdk.contracts import Edited, check_result, fn_kwargs, is_async_fn
from kvedit.sdk.errors import ModifyError
from kvedit.sdk.geometry import KVGeometry
from kvedit.sdk.loop import has_caller, in_caller
from kvedit.sdk.queries import query_kwargs, release_queries
from kvedit.sdk.rowcopy import chunk_equal, save_chunk
from kvedit.sdk.source import KVSource, open_kv, untouched_chunks
from kvedit.sdk.stream import Stream

log = logging.getLogger("kvedit.sdk")
__all__ = ["ModifyResult", "Stored", "check_result", "modify_stream", "store_kv"]


@dataclass
class ModifyResult:
    tokens_before: int = 0
    tokens_after: int = 0
    bytes_retrieved: int = 0
    bytes_stored: int = 0
    chunks_stored: int = 0
    chunks_reused: int = 0
    chunks_deleted: int = 0
    chunks_compared: int = 0  # present chunks whose bytes had to be compared
    salt_changed: bool = False
    skipped: bool = False
    retrieve_s: float = 0.0  # lookup wait excluded: retrieve copy only
    fn_s: float = 0.0
    store_s: float = 0.0     # compare with present chunks + copy into shm + commit


@dataclass(frozen=True, slots=True)
class Stored:
    """What store_kv committed: the salt and keys the edited chunks live under."""
    salt: str
    keys: list[bytes]
    stored: int    # chunks written
    reused: int    # chunks already present (identical bytes)
    compared: int  # present chunks whose bytes were compared


@dataclass(frozen=True, slots=True)
class _Region:
    """What one modify edits: the first n full chunks of the stream's sequence."""
    n: int
    tokens: list[int]
    keys: list[bytes]


def derive_salt(salt: str) -> str:
    return f"{salt}~kvedit-{uuid.uuid4().hex[:12]}"


def chunks_identical(ctx, keys: list[bytes], idx: list[int], kv: torch.Tensor) -> bool:
    """Are the stored chunks keys[i] (i in idx) byte-identical to the edited kv's chunks?"""
    with ctx.client.retrieve(ctx.model, [keys[i] for i in idx]) as got:
        if len(got.tensors) < len(idx):
            return False  # cannot prove equality: the caller switches to a fresh salt
        return all(chunk_equal(kv, i, t) for i, t in zip(idx, got.tensors))


class _Differs(Exception):
    """An edited chunk's key is present with other data: abort the store, switch the salt."""


def store_kv(ctx, tokens: list[int], salt: str, kv: torch.Tensor, keys_for,
             old_keys: list[bytes], untouched: set[int], check_source=lambda: None,
             fresh: bool = False) -> Stored:
    """Store the edited full chunks under `salt` or, if a present key holds other bytes (or
    `fresh`: a per-head edit, whose stand-in ids do not say what it holds), under a fresh
    derived salt.

    `untouched`: chunks known identical to the retrieved chunk at the same index; if their
    key is that chunk's original key, the stored object is the one retrieved: no compare.
    `check_source()` runs just before each commit and raises if the bytes fn read can no
    longer be trusted (a mapped kv's lease ran out): the store is then aborted."""
    keys = keys_for(tokens, salt)
    check: list[int] = []
    try:
        if fresh:
            raise _Differs
        with ctx.client.prepare_store(ctx.model, keys) as h:
            present = sorted(set(range(len(keys))) - set(h.missing))
            check = [j for j in present
                     if not (j in untouched and j < len(old_keys) and keys[j] == old_keys[j])]
            if check and not chunks_identical(ctx, keys, check, kv):
                raise _Differs
            _fill(h, kv)
            check_source()
        return Stored(salt, keys, len(h.missing), len(present), len(check))
    except _Differs:
        pass
    salt = derive_salt(salt)
    keys = keys_for(tokens, salt)
    with ctx.client.prepare_store(ctx.model, keys) as h:
        if len(h.missing) != len(keys):
            raise RuntimeError(f"fresh salt {salt!r} already has chunks in the server")
        _fill(h, kv)
        check_source()
    return Stored(salt, keys, len(keys), 0, len(check))


def _fill(h, kv: torch.Tensor) -> None:
    for i, buf in h.writable():  # straight from the edited tensor into shm; refused past the TTL
        save_chunk(buf, kv, i)


# ---- modify_stream, as its steps ----------------------------------------------------------
async def modify_stream(stream: Stream, fn, *, cpu_slots, keep_old: bool = False,
                        wait_timeout: float = 60.0, fn_in_caller: bool = True) -> ModifyResult:
    """Apply fn to one stream's KV (see the module docstring for the exact semantics).
    Where a synchronous fn runs: in the fn pool when its threads allocate from the main
    malloc arena (kvedit.sdk.alloc: freed blocks are reused and the streams' fns run side by
    side); otherwise, with `fn_in_caller`, in the thread waiting in a synchronous SDK call
    when there is one (kvedit.sdk.loop.in_caller: the main arena too, one fn at a time),
    else in the pool's plain threads or the context's I/O threads."""
    if stream.released:
        raise ModifyError(stream, "the stream was released (arelease); it holds no KV any more")
    region = _region(stream)
    res = ModifyResult(tokens_before=len(region.tokens))
    if region.n == 0:  # shorter than one chunk: nothing is cached, nothing to edit
        res.skipped = True
        return res
    await _wait_stored(stream, region, wait_timeout)
    if stream.ctx.tp is None:
        extra = await query_kwargs(stream, fn, wait_timeout)  # {} unless fn takes `queries`
        held: list[KVSource] = []
        try:
            async with cpu_slots:
                new_tokens, stored = await _edit_and_store(stream, fn, region, res,
                                                           fn_in_caller, extra, held)
        finally:  # after the slot: an unmapping (5-10 ms) does not hold up the next stream
            for source in held:
                await asyncio.get_running_loop().run_in_executor(None, source.release)
    else:   # tensor parallel: every rank's chunks, gathered for fn
        new_tokens, stored = await _tp_edit_and_store(stream, fn, region, res, fn_in_caller,
                                                      wait_timeout, cpu_slots)
    old_keys = _swap(stream, region, new_tokens, stored, res)
    await release_queries(stream)   # they were the old sequence's: this stream is done with them
    await _drop_unused(stream, old_keys, keep_old, res)
    return res


async def _tp_edit_and_store(stream: Stream, fn, region: _Region, res: ModifyResult,
                             fn_in_caller: bool, wait_timeout: float, cpu_slots):
    """The TP hook: kvedit.sdk.tp_edit's steps, fn run by _apply against the gathered
    layout. (tp_edit imports this module, so it is imported here.)"""
    from kvedit.sdk import tp_edit

    extra = await tp_edit.query_kwargs(stream, fn, wait_timeout)

    def apply(kv, tokens, layout):
        return _apply(stream, fn, kv, tokens, fn_in_caller, extra, layout)

    async with cpu_slots:
        return await tp_edit.edit_and_store(stream, region, res, apply, wait_timeout)


def _region(stream: Stream) -> _Region:
    c = stream.ctx.chunk_size
    n = stream.kv_tokens // c
    return _Region(n, stream.prompt[:n * c], stream.keys[:n])


async def _wait_stored(stream: Stream, region: _Region, wait_timeout: float) -> None:
    """Server-side wait: the connector stores asynchronously to the completion's reply."""
    ctx = stream.ctx
    try:
        have = await ctx.call(ctx.client.lookup, ctx.model, region.keys,
                              wait_timeout=wait_timeout)
    except Exception as e:
        raise ModifyError(stream, f"lookup of its chunks failed: {e}") from e
    if have < region.n:
        raise ModifyError(stream, f"only {have} of its {region.n} full chunks are in the kvedit "
                                  f"server after waiting {wait_timeout} s (was it prefilled "
                                  f"through a vLLM with the kvedit connector, same model and "
                                  f"salt, and store_generated on if it decoded since?)")


async def _open(stream: Stream, region: _Region) -> tuple[KVSource, torch.Tensor]:
    ctx = stream.ctx
    try:
        return await ctx.call(open_kv, ctx, region.keys)
    except KVError as e:
        if e.code != "lease_expired":
            raise ModifyError(stream, f"retrieving its KV failed: {e}") from e
        raise ModifyError(stream, f"its KV was copied out after the server's lease TTL ({e}); "
                                  f"the copy may not be its bytes, nothing was changed") from e
    except Exception as e:
        raise ModifyError(stream, f"retrieving its KV failed: {e}") from e


async def _apply(stream: Stream, fn, kv: torch.Tensor, tokens: list[int],
                 in_caller_ok: bool, extra: dict, layout=None) -> Edited:
    """`layout`: what fn's kv is laid out as (default the context's; the gathered layout
    under tensor parallel)."""
    ctx = stream.ctx
    layout = layout or ctx.layout
    kwargs = fn_kwargs(fn, stream, layout) | extra
    try:
        if is_async_fn(fn):
            out = await fn(kv, list(tokens), **kwargs)
        elif in_caller_ok and not pool_reuses_memory() and has_caller():
            out = await in_caller(fn, kv, list(tokens), **kwargs)  # the waiting caller runs it
        else:
            out = await run_fn(ctx, fn, kv, list(tokens), **kwargs)  # kvedit.sdk.alloc
    except Exception as e:
        raise ModifyError(stream, f"fn raised {type(e).__name__}: {e}") from e
    try:
        return check_result(out, layout)
    except ValueError as e:
        raise ModifyError(stream, f"invalid edit: {e}") from None


async def _edit_and_store(stream: Stream, fn, region: _Region, res: ModifyResult,
                          fn_in_caller: bool, extra: dict,
                          held: list[KVSource]) -> tuple[list[int], Stored]:
    """Retrieve, fn, store; returns the edited tokens and what was stored. The source is
    closed here and appended to `held`: the caller releases it (KVSource.release)."""
    t0 = time.perf_counter()
    source, kv = await _open(stream, region)
    held.append(source)
    edited = None
    try:
        res.bytes_retrieved = kv.numel() * kv.element_size()
        given = KVGeometry.of(kv)  # before fn can touch (or resize) it
        t1 = time.perf_counter()
        edited = await _apply(stream, fn, kv, region.tokens, fn_in_caller, extra)
        kv = None
        t2 = time.perf_counter()
        stored = await _store(stream, source, given, edited, region)
        res.retrieve_s, res.fn_s, res.store_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        return edited.tokens, stored
    finally:  # a buffer is reused (a mapping released) only once fn keeps no reference
        kv = edited = None
        source.close()


async def _store(stream: Stream, source: KVSource, given: KVGeometry, edited: Edited,
                 region: _Region) -> Stored:
    ctx, c = stream.ctx, stream.ctx.chunk_size
    m = len(edited.tokens) // c
    try:
        # The page map can only vouch for chunks fn returned where kv had them: for an output
        # elsewhere (torch.cat) reading it (~2.4 ms per 300 MB of kv) would tell nothing.
        in_place = given.same_place(KVGeometry.of(edited.kv))
        written = await ctx.call(source.written_pages) if in_place else None
        untouched = untouched_chunks(written, given, edited.kv, range(min(region.n, m)), c)
        ctx.pool.note_outcome(written, len(untouched) / region.n + source.spares_copy)
        return await ctx.call(store_kv, ctx, edited.tokens[:m * c], stream.cache_salt,
                              edited.kv, stream.keys_for, region.keys, untouched,
                              source.check_lease, edited.heads is not None)
    except KVError as e:
        if e.code not in ("lease_expired", "store_expired"):
            raise ModifyError(stream, f"storing the edited KV failed ({e}); the original KV "
                                      f"is kept") from e
        raise ModifyError(stream, f"the edit took longer than the server's TTL ({e}); nothing "
                                  f"was stored, the original KV is kept") from e
    except Exception as e:
        raise ModifyError(stream, f"storing the edited KV failed ({type(e).__name__}: {e}); "
                                  f"the original KV is kept") from e


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
