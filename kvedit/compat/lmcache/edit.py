"""LMCache's edit function `fn(Mapping[kind, tensor], tokens) -> (kv, tokens)` as a kvedit EditFn.

kvedit calls `fn(kv, tokens, queries=..., query_start=...)` and passes the captured queries
only to an fn whose `needs_queries` is True (kvedit.sdk.queries). KindsEdit is that fn for
one group of streams: with or without a QUERY context.

QUERY's shape. kvedit hands `queries` as [L, rows, Hq*D] (post-RoPE, model dtype), the
prompt's last `rows` tokens from position `query_start`. A stream with a QUERY context asks
for its whole prompt, so rows start at 0; LMCache's query tensor is [1, L, T, Hq*D] over the
chunk-aligned prefix, so the rows are cut to the KV's T and given a leading 1. Queries cover
the prompt only (captured at prefill): after a decode, fn's KV can be longer than QUERY.

Peek reads a stream's tensor through the same modify path without changing anything: it
copies what fn is given and raises, and a failed modify leaves the stream and its chunks
untouched (kvedit.sdk.modify's atomicity).
"""
from __future__ import annotations

import torch

from kvedit.compat.lmcache.cache_kind import LMCacheSDKCacheKind

KV, QUERY = LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY


def lmcache_queries(queries: torch.Tensor, query_start: int, kv_tokens: int) -> torch.Tensor:
    """kvedit's [L, rows, Hq*D] from position query_start -> LMCache's [1, L, T, Hq*D] from 0."""
    if query_start != 0:
        raise ValueError(
            f"the captured queries start at prompt position {query_start}, not 0 (the stream "
            f"was prefilled again after its prompt grew); LMCache's QUERY tensor starts at "
            f"position 0, so prefill a stream with a QUERY context once, before modify")
    return queries[:, :min(queries.shape[1], kv_tokens)].unsqueeze(0)


def mapping(kv: torch.Tensor, queries: torch.Tensor | None,
            query_start: int | None) -> dict[LMCacheSDKCacheKind, torch.Tensor]:
    out = {KV: kv}
    if queries is not None:
        out[QUERY] = lmcache_queries(queries, query_start or 0, kv.shape[2])
    return out


class KindsEdit:
    """fn over the mapping of kinds, for streams that all do (or all do not) hold QUERY."""

    def __init__(self, fn, with_queries: bool):
        if not callable(fn):
            raise TypeError(f"fn must be callable (Mapping[LMCacheSDKCacheKind, Tensor], "
                            f"tokens) -> (kv, tokens), got {type(fn).__name__}")
        self.fn = fn
        self.needs_queries = with_queries

    def __call__(self, kv, tokens, queries=None, query_start=None):
        return self.fn(mapping(kv, queries, query_start), tokens)

    def __repr__(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


class Peeked(Exception):
    """Carries the tensor Peek copied out of a modify it then abandoned."""

    def __init__(self, tensor: torch.Tensor):
        super().__init__(f"read {tuple(tensor.shape)}")
        self.tensor = tensor


class Peek:
    """A modify fn that reads one kind's tensor (a copy: kv may be a mapping of the server's
    memory that is unmapped after fn) and abandons the edit."""

    def __init__(self, kind: LMCacheSDKCacheKind):
        self.kind = kind
        self.needs_queries = kind is QUERY

    def __call__(self, kv, tokens, queries=None, query_start=None):
        raise Peeked(mapping(kv, queries, query_start)[self.kind].clone())
