"""modify over tensor-parallel ranks: wait, retrieve and gather, fn, scatter, staged store.

modify (kvedit.sdk.modify) calls `edit_and_store` instead of its single-rank step when the
context is tensor parallel (`ctx.tp`, kvedit.sdk.tp). The stream's keys are rank 0's; rank
r's keys of the same tokens come from rank r's layout (`Context.rank_keys_for`).

1. every rank holds the region's chunks (server-side wait, like the single-rank lookup);
2. each distinct head group is copied out of its rank (replicas are read once), and
   `gather_ranks` makes fn's `[2, L, T, total_kv_heads*head_dim]` (heads in model order);
   fn gets `layout=` the gathered layout (`TPRanks.layout`);
3. fn's validated result is cut per rank with `scatter_ranks` and stored under each rank's
   keys, staged: every rank's store is prepared and filled before any is committed.

What is guaranteed (the server has no multi-store transaction): a failure before the
commits (fn, validation, a prepare, a fill, a compare, the write TTL) aborts every rank's
store, so no rank holds any edited chunk. A commit that fails after earlier ranks committed
(server gone, store_expired between two commits) leaves those ranks with the edited chunks
under the *edited* keys only; they are deleted again (best effort) and the stream keeps its
original keys and salt on every rank. Edited chunks never replace a rank's original ones
(new keys, or byte-identical data under a present key), and vLLM's scheduler side loads a
chunk only when every rank holds it, so a half-committed edit is never decoded from.

Captured queries (`query_kwargs`): each rank's connector captures its own query heads
(vLLM splits query heads without replicas: rank r holds heads [r*Hq/n, (r+1)*Hq/n)) under
its own rank's query key; fn gets them concatenated in rank order, [L, rows, Hq*head_dim],
the model's query-head order, which matches the gathered KV heads' GQA grouping.

Salt rule as single-rank: if any rank holds a present key of the edited sequence with other
bytes, every rank switches to one fresh derived salt (the salt is the stream's, not a rank's).
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from kvedit.client.handles import KVError, StoreHandle
from kvedit.keys import namespace, query_key
from kvedit.sdk import queries as Q
from kvedit.sdk.errors import MissingQueries, ModifyError
from kvedit.sdk.rowcopy import chunk_equal, save_chunk
from kvedit.sdk.tp import gather_ranks, scatter_ranks

# apply(kv, tokens, layout) -> Edited: modify's fn step (runs fn, validates against layout)
Apply = Callable[[torch.Tensor, list[int], object], Awaitable]


@dataclass(frozen=True, slots=True)
class RankStored:
    """What a staged store committed: per-rank keys (index = rank) and the common salt."""
    salt: str
    keys: list[list[bytes]]
    stored: int    # rank-0 chunks written
    reused: int    # rank-0 chunks already present (identical bytes on every rank)
    compared: int  # present chunks compared, all ranks


async def edit_and_store(stream, region, res, apply: Apply, wait_timeout: float = 60.0):
    """modify's retrieve -> fn -> store over every rank -> (edited tokens, Stored)."""
    from kvedit.sdk.modify import Stored  # modify imports this module lazily: no cycle

    ctx = stream.ctx
    old = ctx.rank_keys_for(region.tokens, stream.cache_salt)
    if old[0] != region.keys:
        raise ModifyError(stream, "its keys are not rank 0's keys of its tokens (was it "
                                  "created on another context?)")
    ctx.remember(old)   # so dropping the old chunks deletes them on every rank
    await _wait_ranks(stream, old, wait_timeout)
    t0 = time.perf_counter()
    try:
        kv = await ctx.call(retrieve_gathered, ctx, old)
    except Exception as e:
        raise ModifyError(stream, f"retrieving its KV from the {ctx.tp.size} tensor-parallel "
                                  f"ranks failed: {e}") from e
    res.bytes_retrieved = kv.numel() * kv.element_size()
    t1 = time.perf_counter()
    edited = await apply(kv, region.tokens, ctx.tp.layout)
    kv = None
    t2 = time.perf_counter()
    m = len(edited.tokens) // ctx.chunk_size
    pieces = scatter_ranks(edited.kv, ctx.tp.heads)
    try:
        got = await ctx.call(store_ranks, ctx, edited.tokens[:m * ctx.chunk_size],
                             stream.cache_salt, pieces, edited.heads is not None)
    except Exception as e:   # a KVError says what it is; anything else is named by its type
        why = e if isinstance(e, KVError) else f"{type(e).__name__}: {e}"
        raise ModifyError(stream, f"storing the edited KV on the tensor-parallel ranks failed "
                                  f"({why}); no rank uses it, the original KV is kept") from e
    ctx.remember(got.keys)
    res.retrieve_s, res.fn_s, res.store_s = t1 - t0, t2 - t1, time.perf_counter() - t2
    return edited.tokens, Stored(got.salt, got.keys[0], got.stored, got.reused, got.compared)


async def query_kwargs(stream, fn, wait_timeout: float) -> dict:
    """kvedit.sdk.queries.query_kwargs over every rank: rank 0's object (its errors as
    single-rank), then ranks 1..n-1's, concatenated along the last (query head) dimension."""
    out = await Q.query_kwargs(stream, fn, wait_timeout)
    if "queries" not in out:
        return out
    ctx, cap = stream.ctx, stream.queries
    # The capture's prompt is the stream's prompt as prefilled (an edit releases the capture,
    # decode only appends), its salt the stream's (only an edit changes it).
    prompt = stream.prompt[:cap.prompt_len]
    keys = [query_key(namespace(ctx.model, lay, stream.cache_salt), prompt, cap.window)
            for lay in ctx.tp.layouts]
    if keys[0] != cap.key:
        raise ModifyError(stream, "its captured queries' key is not rank 0's key of its prompt "
                                  "and salt: the other ranks' queries cannot be found")
    ctx.remember([[k] for k in keys])   # Context.delete_queries deletes them on every rank
    parts = [out["queries"]]
    for r in range(1, ctx.tp.size):
        try:
            have = await ctx.call(ctx.client.lookup, ctx.model, [keys[r]], tp_rank=r,
                                  wait_timeout=wait_timeout, kind="queries")
            raw = await ctx.call(ctx.client.fetch_queries, ctx.model, keys[r],
                                 tp_rank=r) if have else None
        except Exception as e:
            raise ModifyError(stream, f"fetching its captured queries from tensor-parallel "
                                      f"rank {r} failed: {e}") from e
        if raw is None:
            raise MissingQueries(stream, f"tensor-parallel rank {r} has no captured queries "
                                           f"for its prompt (window {cap.window}) after "
                                           f"waiting {wait_timeout} s; rank 0 has them. "
                                           f"Prefill the stream again with capture_queries="
                                           f"{cap.window}")
        try:
            parts.append(Q.as_tensor(raw, cap, ctx.tp.layouts[r]))
        except ValueError as e:
            raise ModifyError(stream, f"rank {r}: {e}") from None
    if any(p.shape != parts[0].shape for p in parts):
        raise ModifyError(stream, f"the ranks' captured queries differ in shape "
                                  f"{[tuple(p.shape) for p in parts]}: expected one query-head "
                                  f"share per rank")
    return out | {"queries": torch.cat(parts, dim=-1)}


async def _wait_ranks(stream, per_rank: list[list[bytes]], wait_timeout: float) -> None:
    """Every rank's connector stores asynchronously: wait server-side for each rank's chunks
    (rank 0's were waited for by modify already; asking again costs one round trip)."""
    ctx = stream.ctx
    for r, keys in enumerate(per_rank):
        try:
            have = await ctx.call(ctx.client.lookup, ctx.model, keys, tp_rank=r,
                                  wait_timeout=wait_timeout)
        except Exception as e:
            raise ModifyError(stream, f"lookup of its chunks on tensor-parallel rank {r} "
                                      f"failed: {e}") from e
        if have < len(keys):
            raise ModifyError(stream, f"tensor-parallel rank {r} holds only {have} of its "
                                      f"{len(keys)} full chunks after waiting {wait_timeout} s "
                                      f"(does every vLLM worker run the kvedit connector?)")


def retrieve_gathered(ctx, per_rank: list[list[bytes]]) -> torch.Tensor:
    """The chunks of every distinct head group, copied out under their leases and gathered
    into one [2, L, n*C, total_kv_heads*head_dim] (a fresh tensor fn may keep)."""
    heads = ctx.tp.heads
    copies: dict[int, torch.Tensor] = {}
    for r in heads.source_ranks():
        with ctx.client.retrieve(ctx.model, per_rank[r], tp_rank=r) as got:
            if len(got.tensors) < len(per_rank[r]):
                raise LookupError(f"rank {r}: only {len(got.tensors)} of {len(per_rank[r])} "
                                  f"chunks could be retrieved (evicted meanwhile?)")
            copies[r] = torch.cat(got.tensors, dim=2)   # the copy, inside the lease
    # replicas read their head group's source rank (gather reads only source ranks)
    per = [copies[r // heads.replicas * heads.replicas] for r in range(heads.tp_size)]
    return gather_ranks(per, heads)


class _Differs(Exception):
    """A present key of the edited sequence holds other bytes on some rank."""


def store_ranks(ctx, tokens: list[int], salt: str, pieces: list[torch.Tensor],
                fresh: bool = False) -> RankStored:
    """Store rank r's piece under rank r's keys of `tokens` for every rank, staged (see the
    module docstring for what is guaranteed); a fresh derived salt on every rank when a
    present key holds other bytes, or when `fresh` (a per-head edit)."""
    from kvedit.sdk.modify import derive_salt

    if not fresh:
        try:
            return _store_all(ctx, tokens, salt, pieces, fresh=False)
        except _Differs:
            pass
    return _store_all(ctx, tokens, derive_salt(salt), pieces, fresh=True)


def _store_all(ctx, tokens, salt: str, pieces, fresh: bool) -> RankStored:
    per_rank = ctx.rank_keys_for(tokens, salt)
    handles: list[StoreHandle] = []
    try:
        compared = 0
        for r, keys in enumerate(per_rank):
            h = ctx.client.prepare_store(ctx.model, keys, tp_rank=r)
            handles.append(h)
            present = sorted(set(range(len(keys))) - set(h.missing))
            if present and fresh:
                raise RuntimeError(f"fresh salt {salt!r} already has chunks on rank {r}")
            compared += len(present)
            if present and not _identical(ctx, r, [keys[i] for i in present], present,
                                          pieces[r]):
                raise _Differs
            for i, buf in h.writable():   # deadline-checked: refused past the write TTL
                save_chunk(buf, pieces[r], i)
    except BaseException:
        _abort(handles)
        raise
    _commit_all(ctx, per_rank, handles)
    n0 = len(per_rank[0])
    return RankStored(salt, per_rank, len(handles[0].missing), n0 - len(handles[0].missing),
                      compared)


def _identical(ctx, rank: int, keys: list[bytes], idx: list[int], piece) -> bool:
    with ctx.client.retrieve(ctx.model, keys, tp_rank=rank) as got:
        if len(got.tensors) < len(keys):
            return False   # cannot prove equality: switch to a fresh salt
        return all(chunk_equal(piece, i, t) for i, t in zip(idx, got.tensors))


def _commit_all(ctx, per_rank: list[list[bytes]], handles: list[StoreHandle]) -> None:
    """Commit rank by rank; on a failure abort the rest and delete what the committed ranks
    wrote (their missing keys only: present ones were someone else's, identical)."""
    for r, h in enumerate(handles):
        try:
            h.commit()
        except BaseException:
            _abort(handles[r + 1:])
            for done in range(r):
                written = [per_rank[done][i] for i in handles[done].missing]
                try:
                    if written:
                        ctx.client.delete(ctx.model, written, tp_rank=done)
                except Exception:   # the original is what raises; orphans are only evictable
                    pass
            raise


def _abort(handles: list[StoreHandle]) -> None:
    """Abort stores while another error is on its way out (a gone server must not hide it;
    the server drops an unfinished store at its write TTL anyway)."""
    for h in handles:
        try:
            h.abort()
        except KVError:
            pass
