"""modify: retrieve a stream's KV, apply the user's fn, validate, store, swap, clean up.

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
retrieve buffer (kvedit.sdk.buffers), so the kernel records every page fn wrote.

Atomicity. The stream's tokens/salt/keys change only after the store has committed. If fn
raises, returns something invalid, or the store fails, the stream is unchanged, the error
names the stream and the reason, and the original chunks are untouched (still retrievable).
The same holds when a lease or store outlives the server's TTL (lease_expired /
store_expired): bytes read after a lease ran out are never stored, nothing is written into
slots past the write TTL (kvedit.handles). After a successful swap, the stream's old chunks
that no stream of the context references any more are deleted, unless `keep_old=True`.

Partial tail. Only full chunks have keys. If the edited length is not a multiple of the
chunk size, the trailing tokens move into the stream's suffix: they are re-sent and
recomputed by vLLM on the next decode (their edited KV is not used).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from dataclasses import dataclass

import torch

from kvedit.handles import KVError
from kvedit.layout import ModelLayout
from kvedit.sdk.buffers import KVBuffer, untouched_chunks
from kvedit.sdk.chunkmap import COPY_SPARED, MappedKV, map_chunks
from kvedit.sdk.errors import ModifyError
from kvedit.sdk.queries import query_kwargs, release_queries
from kvedit.sdk.rowcopy import chunk_equal, load_chunk, save_chunk
from kvedit.sdk.stream import Stream, check_token_ids

log = logging.getLogger("kvedit.sdk")


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


def derive_salt(salt: str) -> str:
    return f"{salt}~kvedit-{uuid.uuid4().hex[:12]}"


def wants_layout(fn) -> bool:
    """fn takes a `layout` keyword (or **kwargs): it then gets the ModelLayout (RoPE params)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "layout" and p.kind is not p.POSITIONAL_ONLY or p.kind is p.VAR_KEYWORD
               for p in params)


def retrieve_kv(ctx, keys: list[bytes]) -> tuple[KVBuffer | MappedKV, torch.Tensor]:
    """(source, kv): the chunks of `keys` as one contiguous [2, L, N*C, D] tensor. With write
    tracking in shm mode, mapped copy-on-write from the stored chunks (no copy, see
    kvedit.sdk.chunkmap); else one copy out of shm into a pooled buffer (kvedit.sdk.buffers)."""
    lay = ctx.layout
    n, c = len(keys), lay.chunk_size
    shape, dtype = (2, lay.num_layers, n * c, lay.hidden), getattr(torch, lay.dtype)
    cow = ctx.pool.use_cow()
    if cow and (mapped := map_chunks(ctx.client, ctx.model, keys, lay)) is not None:
        return mapped, mapped.view.view(dtype).view(shape)
    buf = ctx.pool.take(n * lay.chunk_bytes)
    with ctx.client.retrieve(ctx.model, keys) as got:
        if len(got.tensors) < n:
            raise LookupError(f"only {len(got.tensors)} of its {n} chunks could be retrieved "
                              f"(evicted meanwhile?)")
        target = buf.target[:n * lay.chunk_bytes].view(dtype).view(shape)
        for i, chunk in enumerate(got.tensors):
            load_chunk(target, i, chunk)
    return buf, buf.open(cow)[:n * lay.chunk_bytes].view(dtype).view(shape)


def _done_with(ctx, src) -> None:
    """modify no longer uses src: a pooled buffer goes back, a mapping is dropped."""
    if isinstance(src, MappedKV):
        src.close()
    else:
        ctx.pool.give(src)


def check_result(result, layout: ModelLayout) -> tuple[torch.Tensor, list[int]]:
    """fn's (kv, tokens), validated; ValueError naming what is wrong and what was expected."""
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise ValueError(f"fn must return (kv, tokens), got {type(result).__name__}")
    kv, tokens = result
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"fn returned kv of type {type(kv).__name__}, expected a torch.Tensor")
    want = getattr(torch, layout.dtype)
    if kv.dtype != want:
        raise ValueError(f"fn returned kv of dtype {kv.dtype}, expected {want} (the model's "
                         f"KV dtype; cast back before returning)")
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[1] != layout.num_layers \
            or kv.shape[3] != layout.hidden:
        raise ValueError(f"fn returned kv of shape {tuple(kv.shape)}, expected [2, "
                         f"{layout.num_layers}, T, {layout.hidden}] (K/V, layers, tokens, "
                         f"kv_heads*head_dim)")
    tokens = check_token_ids(tokens, "the tokens fn returned")
    if len(tokens) != kv.shape[2]:
        raise ValueError(f"fn returned {len(tokens)} tokens but kv holds {kv.shape[2]} "
                         f"(kv.shape[2] must equal len(tokens))")
    return kv.detach().cpu(), tokens


def chunks_identical(ctx, keys: list[bytes], idx: list[int], kv: torch.Tensor) -> bool:
    """Are the stored chunks keys[i] (i in idx) byte-identical to the edited kv's chunks?"""
    with ctx.client.retrieve(ctx.model, [keys[i] for i in idx]) as got:
        if len(got.tensors) < len(idx):
            return False  # cannot prove equality: the caller switches to a fresh salt
        return all(chunk_equal(kv, i, t) for i, t in zip(idx, got.tensors))


class _Differs(Exception):
    """An edited chunk's key is present with other data: abort the store, switch the salt."""


def store_kv(ctx, tokens: list[int], salt: str, kv: torch.Tensor, keys_for,
             old_keys: list[bytes], untouched: set[int], check_source=lambda: None):
    """Store the edited full chunks. Returns (salt, keys, stored, reused, compared).

    `untouched`: chunks known identical to the retrieved chunk at the same index; if their
    key is that chunk's original key, the stored object is the one retrieved: no compare.
    `check_source()` runs just before each commit and raises if the bytes fn read can no
    longer be trusted (a mapped kv's lease ran out): the store is then aborted."""
    keys = keys_for(tokens, salt)
    try:
        with ctx.client.prepare_store(ctx.model, keys) as h:
            present = sorted(set(range(len(keys))) - set(h.missing))
            check = [j for j in present
                     if not (j in untouched and j < len(old_keys) and keys[j] == old_keys[j])]
            if check and not chunks_identical(ctx, keys, check, kv):
                raise _Differs
            _fill(h, kv)
            check_source()
        return salt, keys, len(h.missing), len(present), len(check)
    except _Differs:
        pass
    salt = derive_salt(salt)
    keys = keys_for(tokens, salt)
    with ctx.client.prepare_store(ctx.model, keys) as h:
        if len(h.missing) != len(keys):
            raise RuntimeError(f"fresh salt {salt!r} already has chunks in the server")
        _fill(h, kv)
        check_source()
    return salt, keys, len(keys), 0, len(check)


def _fill(h, kv: torch.Tensor) -> None:
    for i, buf in h.writable():  # straight from the edited tensor into shm; refused past the TTL
        save_chunk(buf, kv, i)


async def modify_stream(stream: Stream, fn, *, cpu_slots, keep_old: bool = False,
                        wait_timeout: float = 60.0) -> ModifyResult:
    """Apply fn to one stream's KV (see the module docstring for the exact semantics)."""
    ctx = stream.ctx
    lay, c = ctx.layout, ctx.chunk_size
    n = len(stream.tokens) // c
    res = ModifyResult(tokens_before=n * c)
    if n == 0:  # shorter than one chunk: nothing is cached, nothing to edit
        res.skipped = True
        return res
    old_keys = stream.keys[:n]
    try:
        # Server-side wait: vLLM's store is asynchronous to the completion reply.
        have = await ctx.call(ctx.client.lookup, ctx.model, old_keys, wait_timeout=wait_timeout)
    except Exception as e:
        raise ModifyError(stream, f"lookup of its chunks failed: {e}") from e
    if have < n:
        raise ModifyError(stream, f"only {have} of its {n} full chunks are in the kvedit server "
                                  f"after waiting {wait_timeout} s (was it prefilled through a "
                                  f"vLLM with the kvedit connector, same model and salt?)")
    extra = await query_kwargs(stream, fn, wait_timeout)  # {} unless fn takes `queries`
    async with cpu_slots:
        t0 = time.perf_counter()
        try:
            buf, kv = await ctx.call(retrieve_kv, ctx, old_keys)
        except KVError as e:
            if e.code != "lease_expired":
                raise ModifyError(stream, f"retrieving its KV failed: {e}") from e
            raise ModifyError(stream, f"its KV was copied out after the server's lease TTL "
                                      f"({e}); the copy may not be its bytes, nothing was "
                                      f"changed") from e
        except Exception as e:
            raise ModifyError(stream, f"retrieving its KV failed: {e}") from e
        try:
            res.bytes_retrieved = kv.numel() * kv.element_size()
            head = stream.tokens[:n * c]
            kwargs = ({"layout": lay} if wants_layout(fn) else {}) | extra
            geometry = (kv.data_ptr(), kv.stride(), kv.element_size())  # before fn can touch it
            t1 = time.perf_counter()
            try:
                if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
                        getattr(fn, "__call__", None)):
                    out = await fn(kv, list(head), **kwargs)
                else:
                    out = await ctx.call(fn, kv, list(head), **kwargs)
            except Exception as e:
                raise ModifyError(stream, f"fn raised {type(e).__name__}: {e}") from e
            try:
                new_kv, new_tokens = check_result(out, lay)
            except ValueError as e:
                raise ModifyError(stream, f"invalid edit: {e}") from None
            kv = out = None
            m = len(new_tokens) // c
            t2 = time.perf_counter()
            try:
                written = await ctx.call(buf.written_pages)
                untouched = await ctx.call(untouched_chunks, buf, written, *geometry, new_kv,
                                           range(min(n, m)), c)
                spared = len(untouched) / n + (COPY_SPARED if isinstance(buf, MappedKV) else 0)
                ctx.pool.note_outcome(written, spared)
                salt, keys, stored, reused, compared = await ctx.call(
                    store_kv, ctx, new_tokens[:m * c], stream.cache_salt, new_kv,
                    stream.keys_for, old_keys, untouched,
                    buf.check_lease if isinstance(buf, MappedKV) else (lambda: None))
            except KVError as e:
                if e.code not in ("lease_expired", "store_expired"):
                    raise ModifyError(stream, f"storing the edited KV failed ({e}); the "
                                              f"original KV is kept") from e
                raise ModifyError(stream, f"the edit took longer than the server's TTL ({e}); "
                                          f"nothing was stored, the original KV is kept") from e
            except Exception as e:
                raise ModifyError(stream, f"storing the edited KV failed ({type(e).__name__}: "
                                          f"{e}); the original KV is kept") from e
            res.retrieve_s, res.fn_s, res.store_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        finally:  # a buffer is reused (a mapping released) only once fn keeps no reference
            kv = out = new_kv = None
            await asyncio.get_running_loop().run_in_executor(None, _done_with, ctx, buf)
    # Committed: swap the stream's state (nothing can fail between here and the swap).
    res.salt_changed = salt != stream.cache_salt
    stream.suffix = new_tokens[m * c:] + stream.tokens[n * c:] + stream.suffix
    stream.tokens = new_tokens[:m * c]
    stream.cache_salt = salt
    all_old, stream.keys = stream.keys, keys
    res.tokens_after, res.chunks_stored, res.chunks_reused = m * c, stored, reused
    res.chunks_compared = compared
    res.bytes_stored = stored * lay.chunk_bytes
    ctx.ref(keys)
    await release_queries(stream)   # they were the old prompt's: this stream is done with them
    dead = ctx.unref(all_old)
    if dead and not keep_old:
        try:
            res.chunks_deleted = await ctx.call(ctx.client.delete, ctx.model, dead)
        except Exception as e:  # the edit is done; a failed clean-up only costs memory
            log.warning("%s: deleting %d old chunks failed: %s", stream.label, len(dead), e)
    return res
