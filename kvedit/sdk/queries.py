"""Captured queries in the SDK: ask vLLM for them at prefill, fetch them for fn, let go.

How a request asks is the capture field of its kv_transfer_params (kvedit.request_params,
which Stream.generate writes for the prefill); the bound on the window and the stored
object's shape are the query-capture contract (kvedit.query_contract, shared with the
connector). `openai_completion` sends the params as the body of /v1/completions, where vLLM
reads the top-level `kv_transfer_params` and the kvedit connector captures the post-RoPE
queries of the last W prompt tokens of every attention layer and stores them in the kvedit
server, one object per tensor-parallel rank (docs/queries.md).

Which fn gets them is EditFn's rule (kvedit.sdk.contracts.wants_queries); modify then calls
`fetch`, which reads every rank's object (its shape from the rank's registered layout) and
hands fn `[L, rows, num_q_heads*head_dim]` in the model dtype (rank order = the model's
query-head order), or raises MissingQueries naming the stream; never a silent fallback.

Lifetime: one query object per (prompt, salt, W); streams of one context that captured the
same one share it (reference counted like chunk keys); modify deletes it once no stream of
the context that still holds it is left (after a successful edit each stream lets go).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvedit.query_contract import CaptureRows, QueryShape, check_window
from kvedit.sdk.errors import MissingQueries, ModifyError

log = logging.getLogger("kvedit.sdk")
__all__ = ["Capture", "CapturedQueries", "as_tensor", "capture_for", "check_window", "expect",
           "fetch", "hold", "release_queries", "stored"]


@dataclass(frozen=True, slots=True)
class Capture:
    """What one prefill asked to capture: the object's key on every rank (index = rank) and
    which prompt rows it holds."""
    keys: tuple[bytes, ...]
    window: int          # W as asked (the key's W)
    prompt_len: int      # tokens of the prompt that was prefilled

    @property
    def key(self) -> bytes:
        """The key streams hold and count: rank 0's."""
        return self.keys[0]

    @property
    def rows(self) -> int:
        return CaptureRows(self.window, self.prompt_len).rows

    @property
    def start(self) -> int:
        """Prompt position of row 0."""
        return CaptureRows(self.window, self.prompt_len).start


@dataclass(frozen=True, slots=True)
class CapturedQueries:
    """What fn gets: the queries [L, rows, num_q_heads*head_dim] and row 0's prompt position."""
    queries: torch.Tensor
    start: int


def capture_for(ctx, prompt: list[int], salt: str, window: int) -> Capture:
    return Capture(tuple(ctx.query_keys_for(prompt, salt, window)), window, len(prompt))


def hold(stream, capture: Capture) -> None:
    """The stream expects `capture` (it was created with a window, joined a batch with a
    default window, or its prefill asked): it now references that object, dropping the one
    it referenced before. Streams of one prompt, salt and W share one object, so a stream
    that was never prefilled itself finds the queries another one's prefill captured."""
    old = stream.queries
    if old is not None and old.key == capture.key:
        return
    stream.queries = capture
    stream.ctx.query_refs[capture.key] += 1
    if old is not None:
        _unref(stream.ctx, old.key)   # the object stays: evicted in time, or reused


def expect(stream, window: int) -> None:
    """hold() the capture of the stream's current prompt with `window` (0: nothing)."""
    if window:
        hold(stream, capture_for(stream.ctx, stream.prompt, stream.cache_salt, window))


def _unref(ctx, key: bytes) -> bool:
    """Drop one reference -> True when nothing of this context references the key."""
    ctx.query_refs[key] -= 1
    if ctx.query_refs[key] > 0:
        return False
    del ctx.query_refs[key]
    return True


def as_tensor(raw, capture: Capture, layout) -> torch.Tensor:
    """One rank's stored bytes as [L, rows, Hq*D] in the model dtype, the shape the rank's
    registered layout says (kvedit.query_contract.QueryShape); ValueError if they differ or
    the layout does not say its query heads."""
    shape = QueryShape.of(layout, capture.rows)
    shape.check(raw.nbytes)
    return torch.from_numpy(raw).view(getattr(torch, layout.dtype)).view(shape.shape)


async def stored(ctx, cap: Capture, rank: int, wait_timeout: float) -> bool:
    """Whether rank `rank`'s server holds `cap`'s object (asked to wait up to wait_timeout:
    the connector stores asynchronously)."""
    return bool(await ctx.call(ctx.client.lookup, ctx.model, [cap.keys[rank]], tp_rank=rank,
                               wait_timeout=wait_timeout, kind="queries"))


async def fetch(stream, fn, wait_timeout: float) -> CapturedQueries:
    """The stream's captured queries from every rank, concatenated along the query heads, or
    MissingQueries (the server is asked to wait up to wait_timeout for each rank's object:
    the connector stores asynchronously)."""
    ctx, cap = stream.ctx, stream.queries
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if cap is None:
        raise MissingQueries(stream, f"{name} needs captured queries but the stream holds "
                                     f"none: it was not created or prefilled with a query "
                                     f"window (create_request(..., capture_queries=W) or "
                                     f"BatchedStream(capture_queries=W)), or an earlier edit "
                                     f"used them (they describe the prompt before that edit)")
    parts = []
    for r, key in enumerate(cap.keys):
        on = f" on tensor-parallel rank {r}" if r else ""
        try:
            have = await stored(ctx, cap, r, wait_timeout)
            raw = await ctx.call(ctx.client.fetch_queries, ctx.model, key,
                                 tp_rank=r) if have else None
        except Exception as e:
            raise ModifyError(stream, f"fetching its captured queries{on} failed: {e}") from e
        if raw is None:
            raise MissingQueries(stream, _missing(name, cap, key, r, wait_timeout))
        try:
            parts.append(as_tensor(raw, cap, ctx.layouts[r]))
        except ValueError as e:
            raise ModifyError(stream, f"its captured queries{on}: {e}") from None
    return CapturedQueries(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1),
                           cap.start)


def _missing(name: str, cap: Capture, key: bytes, rank: int, wait_timeout: float) -> str:
    again = f"Prefill the stream again with capture_queries={cap.window}"
    if rank:
        return (f"tensor-parallel rank {rank} has no captured queries for its prompt (window "
                f"{cap.window}) after waiting {wait_timeout} s; rank 0 has them. {again}")
    return (f"{name} needs captured queries but the kvedit server has none for its prompt "
            f"(window {cap.window}, key {key.hex()}) after waiting {wait_timeout} s: evicted "
            f"(a larger --l1-size-gb keeps them), deleted by an earlier edit of this stream, "
            f"or never captured (is vLLM running the kvedit connector with query capture? "
            f"Requests past the connector's max_capture_bytes in flight get none: vLLM's log "
            f"names them). {again}")


async def release_queries(stream) -> int:
    """After a successful edit: the stream lets go of its query object; deleted from the
    server when no stream of the context holds it -> objects deleted (0 or 1)."""
    cap, stream.queries = stream.queries, None
    if cap is None or not _unref(stream.ctx, cap.key):
        return 0
    ctx = stream.ctx
    try:
        return await ctx.call(ctx.delete_queries, [cap.key])   # on every TP rank
    except Exception as e:  # the edit is done; a failed clean-up only costs memory (evicted)
        log.warning("%s: deleting its captured queries failed: %s", stream.label, e)
        return 0
