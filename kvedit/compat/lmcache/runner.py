"""Runs LMCache's phases over a selection of streams as kvedit batch phases.

Every operation, for one stream or many, is one kvedit BatchedStream phase over their kvedit
Streams (one event loop, no thread per stream): a request is `prefill` or `decode`, an edit
is `modify`, a read is a modify abandoned by its fn (edit.Peek). What LMCache reports on top
(text, timings, its token split) is StreamState's. kvedit's errors come back as
LMCacheRequestStreamError, the kvedit error as its cause; streams that did not fail keep
their results (kvedit edits and runs streams independently).
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from numbers import Real

import torch

from kvedit import BatchedStream, BatchError, KVEditError, Metrics, StreamError
from kvedit.compat.lmcache.cache_kind import LMCacheSDKCacheKind
from kvedit.compat.lmcache.edit import KindsEdit, Peek, Peeked
from kvedit.compat.lmcache.errors import LMCacheRequestStreamError
from kvedit.compat.lmcache.state import StreamState
from kvedit.sdk.errors import MissingQueries

KV = LMCacheSDKCacheKind.KV
QUERY_HINT = ("(kvedit.compat.lmcache: a stream holding a QUERY context captures its prompt's "
              "queries in LMCacheBatchedStream.prefill() only, and one successful modify uses "
              "them up) ")


def check_params(sampling_params) -> dict:
    if not isinstance(sampling_params, Mapping):
        raise TypeError(f"sampling_params must be a dict of engine sampling parameters, got "
                        f"{type(sampling_params).__name__}")
    return dict(sampling_params)


def check_seconds(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not value >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def generate(states: Sequence[StreamState], sampling_params: Mapping, *, prefill: bool,
             progress: bool | None = None) -> Metrics:
    """One request per stream (prefill: max_tokens 1 and query capture for QUERY streams);
    each stream that ran has its StreamPerfMetrics in `last_perf`, even when others failed."""
    params = check_params(sampling_params)
    if prefill:
        params["max_tokens"] = 1
    for st in states:
        st.begin_request()
    batch = BatchedStream([st.stream for st in states], progress=progress)
    error = None
    try:
        m = batch.prefill(params) if prefill else batch.decode(params)
    except KVEditError as e:
        error, m = e, None
    failed = _failed(error, states)
    for st in states:
        if id(st) not in failed:
            st.end_request(params)
    if error is not None:
        raise stream_error(error) from error
    return m


def modify(states: Sequence[StreamState], fn, timeout: float,
           progress: bool | None = None) -> tuple[float, list[Metrics]]:
    """fn over every stream's mapping of kinds; streams with and without QUERY run as two
    kvedit modifies (kvedit gives queries to an fn for all of a batch or for none)."""
    timeout = check_seconds(timeout, "timeout")
    for st in states:
        _check_editable(st)
    before = {id(st): (st.sequence(), st.edit_region()) for st in states}
    groups = [[st for st in states if st.has_queries == q] for q in (True, False)]
    metrics, errors = [], []
    start = time.perf_counter()
    for with_queries, group in zip((True, False), groups):
        if not group:
            continue
        batch = BatchedStream([st.stream for st in group], progress=progress)
        try:
            metrics.append(batch.modify(KindsEdit(fn, with_queries), wait_timeout=timeout))
        except KVEditError as e:
            errors.append(e)
    duration = time.perf_counter() - start
    failed = set().union(*(_failed(e, states) for e in errors))
    for st in states:
        if id(st) not in failed:
            st.after_edit(*before[id(st)])
    if errors:
        raise stream_error(*errors) from errors[0]
    return duration, metrics


def peek(st: StreamState, kind: LMCacheSDKCacheKind, timeout: float) -> torch.Tensor:
    """The stream's tensor of `kind` now (KV [2, L, T, D]; QUERY [1, L, T, Hq*D])."""
    timeout = check_seconds(timeout, "timeout")
    _check_kind(st, kind)
    _check_editable(st, need_kv=False)
    try:
        BatchedStream([st.stream], progress=False).modify(Peek(kind), wait_timeout=timeout)
    except KVEditError as e:
        if isinstance(e.__cause__, Peeked):
            return e.__cause__.tensor
        raise stream_error(e) from e
    raise LMCacheRequestStreamError(f"{st.label}: no cached {kind.name} to retrieve")


def replace(st: StreamState, kv: torch.Tensor, tokens: Sequence[int], timeout: float) -> None:
    """Store kv as the KV of `tokens` and make them the stream's sequence (LMCache's update)."""
    timeout = check_seconds(timeout, "timeout")
    _check_editable(st)
    held, tokens = st.pending_tokens(), list(tokens)

    def given(_kv, _tokens):
        return kv, tokens

    try:
        BatchedStream([st.stream], progress=False).modify(given, wait_timeout=timeout)
    except KVEditError as e:
        raise stream_error(e) from e
    st.after_replace(len(tokens), held)


def _check_kind(st: StreamState, kind: LMCacheSDKCacheKind) -> None:
    if kind not in st.kinds:
        raise LMCacheRequestStreamError(f"{st.label}: no context available for cache kind "
                                        f"{kind}; its contexts are "
                                        f"{sorted(k.name for k in st.kinds)}")


def _check_editable(st: StreamState, need_kv: bool = True) -> None:
    """Before any work: the stream has a KV context and at least one full chunk computed
    (LMCache would wait `timeout` for a cache that cannot appear, kvedit would skip it)."""
    if need_kv:
        _check_kind(st, KV)
    c = st.stream.ctx.chunk_size
    if st.edit_region() < c:
        raise LMCacheRequestStreamError(
            f"{st.label}: nothing is cached to edit: the engine has computed "
            f"{st.stream.kv_tokens} tokens of it, fewer than one chunk ({c} tokens), and only "
            f"full chunks are stored")


def _errors(e: KVEditError) -> list[BaseException]:
    return list(e.errors) if isinstance(e, BatchError) else [e]


def _failed(error: KVEditError | None, states: Sequence[StreamState]) -> set[int]:
    """ids of the states whose stream failed (all of them when an error names no stream)."""
    if error is None:
        return set()
    errs = _errors(error)
    if not all(isinstance(x, StreamError) for x in errs):
        return {id(st) for st in states}
    bad = {id(x.stream) for x in errs}
    return {id(st) for st in states if id(st.stream) in bad}


def stream_error(*errors: KVEditError) -> LMCacheRequestStreamError:
    every = [x for e in errors for x in _errors(e)]
    lines = [(QUERY_HINT if isinstance(x, MissingQueries) else "") + str(x) for x in every]
    if len(lines) == 1:
        return LMCacheRequestStreamError(lines[0], every)
    return LMCacheRequestStreamError(f"{len(lines)} streams failed:\n" +
                                     "\n".join(f"  - {line}" for line in lines), every)
