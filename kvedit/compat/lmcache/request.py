"""LMCacheRequestStream and create_request (LMCache SDK 0.5.x's `request` module).

A request stream is a kvedit Stream (kvedit.sdk.stream) created on the context of its KV
kind (or of its QUERY kind when it has no KV), plus LMCache's bookkeeping (state.py). Each
operation is a kvedit batch phase over this one stream (runner.py); LMCacheBatchedStream
runs the same phases over many.

A stream holding a QUERY context is created with a query window of its whole prompt, so its
prefill (LMCacheBatchedStream.prefill) asks vLLM to capture every prompt token's query.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvedit import create_request as kvedit_request
from kvedit.compat.lmcache import runner
from kvedit.compat.lmcache.context import (LMCacheSDKCacheKind, LMCacheSDKContext,
                                           ModifyFnType)
from kvedit.compat.lmcache.errors import LMCacheRequestStreamError
from kvedit.compat.lmcache.perf import StreamPerfMetrics
from kvedit.compat.lmcache.state import Recorder, StreamState

__all__ = ["LMCacheRequestStream", "LMCacheRequestStreamError", "PostCompletion",
           "StreamPerfMetrics", "TokenEvent", "create_request"]
KV, QUERY = LMCacheSDKCacheKind.KV, LMCacheSDKCacheKind.QUERY


@dataclass(frozen=True)
class TokenEvent:
    """One generated token as post_completion reports it."""

    token_id: int
    text: str = ""


class PostCompletion(Protocol):
    """The engine call: yields one TokenEvent per generated token (sync, or async)."""

    def __call__(self, prompt_token_ids: list[int], sampling_params: dict[str, Any],
                 cache_salt: str) -> Iterable[TokenEvent]: ...


def create_request(contexts: Iterable[LMCacheSDKContext], post_completion: PostCompletion,
                   prompt_token_ids: Sequence[int], cache_salt: str = "") -> LMCacheRequestStream:
    return LMCacheRequestStream(contexts, post_completion, prompt_token_ids, cache_salt)


def by_kind(contexts) -> dict[LMCacheSDKCacheKind, LMCacheSDKContext]:
    """The contexts by kind: at most one per kind, all of one server and model."""
    if isinstance(contexts, LMCacheSDKContext):
        raise TypeError("contexts must be a list of contexts, e.g. [kv_ctx] or "
                        "[kv_ctx, q_ctx], not one context")
    out: dict[LMCacheSDKCacheKind, LMCacheSDKContext] = {}
    for ctx in contexts:
        if not isinstance(ctx, LMCacheSDKContext):
            raise TypeError(f"contexts must hold contexts from kvedit.compat.lmcache's "
                            f"connect(), found {type(ctx).__name__}")
        if ctx.kind in out:
            raise ValueError(f"contexts holds two {ctx.kind.name} contexts; a request stream "
                             f"takes at most one context per kind")
        out[ctx.kind] = ctx
    if not out:
        raise ValueError("contexts is empty; give at least a KV context")
    first = next(iter(out.values()))
    for ctx in out.values():
        if (ctx.url, ctx.model_name) != (first.url, first.model_name):
            raise ValueError(f"contexts are for different servers or models ({first!r} and "
                             f"{ctx!r}); a stream's kinds come from one server and model")
    return out


class LMCacheRequestStream:
    """One logical request across several engine passes; drive it alone or in a batch."""

    def __init__(self, contexts: Iterable[LMCacheSDKContext], post_completion: PostCompletion,
                 prompt_token_ids: Sequence[int], cache_salt: str = ""):
        self._contexts = by_kind(contexts)
        self._id = str(uuid.uuid4())
        self.post_completion = post_completion
        self._salt = cache_salt
        home = self._contexts.get(KV) or self._contexts[QUERY]
        prompt = list(prompt_token_ids)
        window = len(prompt) if QUERY in self._contexts else 0
        recorder = Recorder(post_completion)
        try:
            stream = kvedit_request(home.kvedit, recorder, prompt, cache_salt, name=self._id,
                                    capture_queries=window)
        except ValueError as e:
            why = (f" (a QUERY context captures the queries of every prompt token; this "
                   f"prompt has {len(prompt)})" if window else "")
            raise LMCacheRequestStreamError(f"create_request: {e}{why}") from e
        self.state = StreamState(stream, recorder, frozenset(self._contexts))

    # ---- LMCache's read-only views ---------------------------------------------------------
    @property
    def request_stream_id(self) -> str:
        return self._id

    @property
    def cache_salt(self) -> str:
        """The salt given at creation. kvedit may key edited chunks under a derived salt
        (`self.state.stream.cache_salt`); requests carry that one."""
        return self._salt

    @property
    def tokens(self) -> list[int]:
        """The live sequence: prompt, generated tokens, or the last edit's tokens (a copy)."""
        return self.state.lmcache_tokens()

    @property
    def suffix_tokens(self) -> list[int]:
        """Tokens after the last edit's region, sent ahead of the next request (a copy)."""
        return self.state.pending_tokens()

    @property
    def done(self) -> bool:
        return self.state.done

    @property
    def decoded_tokens(self) -> int:
        return self.state.decoded

    @property
    def output_text(self) -> str:
        return "".join(self.state.texts)

    @property
    def output_tokens(self) -> list[int]:
        """As in LMCache: the whole live sequence (`tokens`), prompt included."""
        return self.tokens

    @property
    def is_done(self) -> bool:
        return self.state.done

    # ---- operations -----------------------------------------------------------------------
    def generate(self, sampling_params: dict[str, Any],
                 suffix_tokens: Sequence[int] = ()) -> StreamPerfMetrics:
        """One engine pass on everything the stream holds plus `suffix_tokens`."""
        self.state.append(list(suffix_tokens))
        runner.generate([self.state], sampling_params, prefill=False, progress=False)
        return self.state.last_perf

    def retrieve(self, kind: LMCacheSDKCacheKind, timeout: float = 30.0,
                 poll_interval: float = 0.2) -> torch.Tensor:
        """The cached tensor of `kind` (a copy): KV [2, L, T, D], QUERY [1, L, T, Hq*D].
        kvedit waits up to `timeout` server-side; `poll_interval` is not used."""
        runner.check_seconds(poll_interval, "poll_interval")
        return runner.peek(self.state, kind, timeout)

    def update(self, kind: LMCacheSDKCacheKind, kv: torch.Tensor, tokens: Sequence[int]) -> None:
        """Store `kv` [2, L, T, D] as the KV of `tokens` and make `tokens` the sequence."""
        if kind is not KV:
            raise LMCacheRequestStreamError(
                f"{self.state.label}: update({kind}) is not supported: kvedit stores only KV "
                f"from the SDK; the connector writes captured queries")
        runner.replace(self.state, kv, tokens, timeout=30.0)

    def modify_kv(self, fn: ModifyFnType, timeout: float = 30.0,
                  poll_interval: float = 0.2) -> None:
        """fn(Mapping[kind, tensor], tokens) -> (kv, tokens) over the chunk-aligned prefix;
        the rest waits in suffix_tokens for the next request. `poll_interval` is not used."""
        runner.check_seconds(poll_interval, "poll_interval")
        runner.modify([self.state], fn, timeout, progress=False)

    def __repr__(self) -> str:
        kinds = "+".join(sorted(k.name for k in self.state.kinds))
        return (f"<LMCacheRequestStream {self._id} [{kinds}]: {len(self.tokens)} tokens, "
                f"{len(self.suffix_tokens)} held aside{', done' if self.done else ''}>")
