"""Captured queries in the SDK (issue 10): ask vLLM for them at prefill, hand them to fn.

How a request asks: its sampling params carry `kv_transfer_params={"kvedit_capture_queries":
W}` (merged into any kv_transfer_params already there); `openai_completion` sends the
params as the body of /v1/completions, where vLLM reads the top-level `kv_transfer_params`
and the kvedit connector captures the post-RoPE queries of the last W prompt tokens of every
attention layer and stores them in the kvedit server (docs/queries.md).

Which fn gets them (one rule, here): `fn.needs_queries` True -> always, False -> never;
no such attribute -> when fn's signature names a `queries` parameter (not a bare **kwargs:
an edit that does not ask must never fail for lack of queries). fn then receives
`queries=` a tensor [L, rows, num_q_heads*head_dim] in the model dtype (not upcast) and, when
it takes it, `query_start=` the prompt position of row 0 (rows = min(W, prompt length), the
last rows of the prompt that was prefilled). No queries in the server -> MissingQueries
naming the stream; never a silent fallback.

Lifetime: one query object per (prompt, salt, W); streams of one context that captured the
same one share it (reference counted like chunk keys); modify deletes it once no stream of
the context that still holds it is left (after a successful edit each stream lets go).
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import logging

import torch

from kvedit.sdk.errors import MissingQueries, ModifyError

log = logging.getLogger("kvedit.sdk")
CAPTURE_FIELD = "kvedit_capture_queries"   # the key inside kv_transfer_params
MAX_WINDOW = 4096


@dataclass(frozen=True, slots=True)
class Capture:
    """What one prefill asked to capture: the object's key and how to read it back."""
    key: bytes
    window: int          # W as asked (the key's W)
    prompt_len: int      # tokens of the prompt that was prefilled

    @property
    def rows(self) -> int:
        return min(self.window, self.prompt_len)

    @property
    def start(self) -> int:
        """Prompt position of row 0."""
        return self.prompt_len - self.rows


def check_window(window, what: str) -> int | None:
    """None (no setting) or an int in [0, MAX_WINDOW] (0 = off); ValueError otherwise."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= MAX_WINDOW:
        raise ValueError(f"{what} must be a number of prompt tokens in 1..{MAX_WINDOW} (0 or "
                         f"None = off), got {window!r}")
    return window


def with_capture(params, window: int):
    """A copy of the sampling params that asks vLLM to capture the last `window` queries
    (with_transfer_param)."""
    return with_transfer_param(params, CAPTURE_FIELD, window, "capture_queries")


def with_transfer_param(params, key: str, value, what: str = "this request"):
    """A copy of the sampling params with kv_transfer_params[key] = value (merged into any
    already there): a dict (None) gets the key `kv_transfer_params`; vLLM's SamplingParams
    gets it inside `extra_args` (where the offline LLM looks); other objects the attribute.
    TypeError when the params cannot carry it (`what` names the feature that needed it)."""
    if params is None or isinstance(params, Mapping):
        params = dict(params or {})
        params["kv_transfer_params"] = {**(params.get("kv_transfer_params") or {}), key: value}
        return params
    p = params.clone() if hasattr(params, "clone") else copy.copy(params)
    if hasattr(params, "extra_args"):
        # vLLM's SamplingParams: the offline LLM reads kv_transfer_params from extra_args
        extra = dict(params.extra_args or {})
        extra["kv_transfer_params"] = {**(extra.get("kv_transfer_params") or {}), key: value}
        p.extra_args = extra
        return p
    new = {**(getattr(params, "kv_transfer_params", None) or {}), key: value}
    if dataclasses.is_dataclass(params) and any(f.name == "kv_transfer_params"
                                                for f in dataclasses.fields(params)):
        return dataclasses.replace(params, kv_transfer_params=new)
    try:
        p.kv_transfer_params = new
    except AttributeError:
        raise TypeError(f"{what} needs sampling params that can carry "
                        f"kv_transfer_params (a dict, or an object with that attribute); got "
                        f"{type(params).__name__}") from None
    return p
    new = {**(getattr(params, "kv_transfer_params", None) or {}), CAPTURE_FIELD: window}
    if dataclasses.is_dataclass(params) and any(f.name == "kv_transfer_params"
                                                for f in dataclasses.fields(params)):
        return dataclasses.replace(params, kv_transfer_params=new)
    try:
        p.kv_transfer_params = new
    except AttributeError:
        raise TypeError(f"capture_queries needs sampling params that can carry "
                        f"kv_transfer_params (a dict, or an object with that attribute); got "
                        f"{type(params).__name__}") from None
    return p


def capture_for(ctx, prompt: list[int], salt: str, window: int) -> Capture:
    return Capture(ctx.query_key_for(prompt, salt, window), window, len(prompt))


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


def _params(fn):
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def wants_queries(fn) -> bool:
    flag = getattr(fn, "needs_queries", None)
    if flag is not None:
        return bool(flag)
    p = _params(fn).get("queries")
    return p is not None and p.kind is not p.POSITIONAL_ONLY


def wants_query_start(fn) -> bool:
    params = _params(fn)
    p = params.get("query_start")
    if p is not None:
        return p.kind is not p.POSITIONAL_ONLY
    return any(p.kind is p.VAR_KEYWORD for p in params.values())


def as_tensor(raw, capture: Capture, layout) -> torch.Tensor:
    """The stored bytes as [L, rows, Hq*D] in the model dtype (Hq*D from the byte size)."""
    dtype = getattr(torch, layout.dtype)
    esize = torch.empty(0, dtype=dtype).element_size()
    per_row = layout.num_layers * capture.rows * esize
    width, rest = divmod(raw.nbytes, per_row)
    if rest or not width or width % layout.head_dim:
        raise ValueError(f"the stored queries are {raw.nbytes} bytes, not [{layout.num_layers}"
                         f", {capture.rows}, num_q_heads*{layout.head_dim}] {layout.dtype}")
    return torch.from_numpy(raw).view(dtype).view(layout.num_layers, capture.rows, width)


async def query_kwargs(stream, fn, wait_timeout: float) -> dict:
    """{} when fn does not ask; else {"queries": ..., ["query_start": ...]} or MissingQueries
    (the server is asked to wait up to wait_timeout: the connector stores asynchronously)."""
    if not wants_queries(fn):
        return {}
    ctx, cap = stream.ctx, stream.queries
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if cap is None:
        raise MissingQueries(stream, f"{name} needs captured queries but the stream holds "
                                     f"none: it was not created or prefilled with a query "
                                     f"window (create_request(..., capture_queries=W) or "
                                     f"BatchedStream(capture_queries=W)), or an earlier edit "
                                     f"used them (they describe the prompt before that edit)")
    try:
        have = await ctx.call(ctx.client.lookup, ctx.model, [cap.key],
                              wait_timeout=wait_timeout, kind="queries")
        raw = await ctx.call(ctx.client.fetch_queries, ctx.model, cap.key) if have else None
    except Exception as e:
        raise ModifyError(stream, f"fetching its captured queries failed: {e}") from e
    if raw is None:
        raise MissingQueries(
            stream, f"{name} needs captured queries but the kvedit server has none for its "
                    f"prompt (window {cap.window}, key {cap.key.hex()}) after waiting "
                    f"{wait_timeout} s: evicted (a larger --l1-size-gb keeps them), deleted "
                    f"by an earlier edit of this stream, or never stored (is vLLM running "
                    f"the kvedit connector with query capture?). Prefill the stream again "
                    f"with capture_queries={cap.window}")
    try:
        queries = as_tensor(raw, cap, ctx.layout)
    except ValueError as e:
        raise ModifyError(stream, str(e)) from None
    out = {"queries": queries}
    if getattr(fn, "needs_queries", None) or wants_query_start(fn):
        out["query_start"] = cap.start
    return out


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
