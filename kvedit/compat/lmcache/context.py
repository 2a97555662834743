"""LMCacheSDKContext: one kvedit server + model for one cache kind, on kvedit's Context.

LMCache's context registers a CPU copy of the engine's paged layout with its server and moves
chunks itself. kvedit's `connect()` already reads the model's layout (waiting up to `timeout`
for the vLLM connector to register it) and owns the client, so this context is a kvedit
Context plus its kind. The kind decides what a request stream holding it does: KV streams
are edited; QUERY streams ask vLLM to capture their prompt's queries at prefill.

Context-level `retrieve` / `store` by token ids are refused: kvedit keys a stream's chunks by
a salt that an edit may change and reference-counts them per stream, which a store beside
the streams would bypass (LMCache's `store` returns False for "already cached" and the edit
is then silently lost). The per-stream `retrieve` / `update` / `modify_kv` do both.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from kvedit import ConnectError, Context, connect as kvedit_connect
from kvedit.compat.lmcache.cache_kind import LMCacheSDKCacheKind
from kvedit.compat.lmcache.errors import LMCacheSDKError

__all__ = ["LMCacheSDKCacheKind", "LMCacheSDKContext", "LMCacheSDKError", "ModifyFnType"]

ModifyFnType = Callable[
    [Mapping[LMCacheSDKCacheKind, torch.Tensor], Sequence[int]],
    tuple[torch.Tensor, Sequence[int]],
]
ZMQ_SCHEMES = ("tcp://", "ipc://")   # what kvedit's server speaks (LMCache also has gRPC)


def check_kind(kind) -> LMCacheSDKCacheKind:
    if not isinstance(kind, LMCacheSDKCacheKind):
        raise ValueError(f"unsupported cache kind: {kind!r}; expected LMCacheSDKCacheKind.KV "
                         f"or LMCacheSDKCacheKind.QUERY from kvedit.compat.lmcache")
    return kind


class LMCacheSDKContext:
    """A connection to one kvedit server for one model and cache kind (`close()` it)."""

    def __init__(self, url: str, http_url: str, model_name: str,
                 kind: LMCacheSDKCacheKind = LMCacheSDKCacheKind.KV, timeout: float = 60.0):
        self._kind = check_kind(kind)
        if not isinstance(url, str) or not url.startswith(ZMQ_SCHEMES):
            raise LMCacheSDKError(f"url {url!r}: kvedit's server speaks ZMQ, give "
                                  f"tcp://HOST:PORT (its --port); gRPC is not supported")
        self._timeout = float(timeout)
        try:
            self._ctx = kvedit_connect(url, http_url, model_name, self._timeout)
        except ConnectError as e:
            raise LMCacheSDKError(str(e)) from e

    @property
    def kind(self) -> LMCacheSDKCacheKind:
        return self._kind

    @property
    def chunk_size(self) -> int:
        return self._ctx.chunk_size

    @property
    def mq_timeout(self) -> float:
        """The `timeout` given to connect (kvedit bounds its blocking calls by it)."""
        return self._timeout

    @property
    def model_name(self) -> str:
        return self._ctx.model

    @property
    def url(self) -> str:
        return self._ctx.url

    @property
    def kvedit(self) -> Context:
        """The kvedit Context underneath (its layout, client and counters)."""
        return self._ctx

    @property
    def closed(self) -> bool:
        return self._ctx.closed

    def register_caches(self) -> None:
        """Nothing to do: connect() already read the model's registered layout."""
        if self._ctx.closed:
            raise LMCacheSDKError(f"the {self._kind.name} context for {self.model_name!r} is "
                                  f"closed")

    def retrieve(self, tokens, cache_salt: str = "", request_configs=None):
        raise LMCacheSDKError(
            "LMCacheSDKContext.retrieve is not supported by kvedit: read a stream's tensors "
            "with LMCacheRequestStream.retrieve(kind) (kvedit keys chunks per stream, by a "
            "salt an edit may change)")

    def store(self, kv, tokens, cache_salt: str = "", request_configs=None):
        raise LMCacheSDKError(
            "LMCacheSDKContext.store is not supported by kvedit: store an edit with "
            "LMCacheRequestStream.update(LMCacheSDKCacheKind.KV, kv, tokens) or modify_kv(fn) "
            "(they switch the stream to a fresh salt when edited data would land under "
            "existing keys, where a plain store would be ignored)")

    def close(self) -> None:
        """Release the sockets, mapping and threads of the context (idempotent)."""
        self._ctx.close()

    def __repr__(self) -> str:
        return (f"LMCacheSDKContext(kind={self._kind.name}, model={self.model_name!r}, "
                f"url={self.url!r})")
