"""The two user callables the SDK calls, declared once, and the one rule for each.

EditFn: modify calls `fn(kv, tokens, **kw)` and expects `(kv, tokens)` back (a tuple, list or
`Edited`). fn may be a coroutine function; it may edit kv in place. Which optional keywords
`kw` holds is decided here and nowhere else (`wants_queries`, `fn_kwargs`):
- `layout`: the ModelLayout of kv (RoPE parameters included; under tensor parallel the
  gathered layout), when fn declares a `layout` parameter or takes **kwargs;
- `queries`: the stream's captured queries [L, rows, num_q_heads*head_dim] (model dtype),
  when `fn.needs_queries` is True, or, without that attribute, when fn declares a `queries`
  parameter (a bare **kwargs does not ask: an edit that never asked must never fail for
  lack of queries); `needs_queries = False` never gets them;
- `query_start`: the prompt position of queries' row 0, with queries, when fn declares it,
  takes **kwargs or says `needs_queries = True`;
- `new_kv`: kvedit's output allocator (`new_kv(shape_or_like, dtype=None)`: a tensor on
  pages kvedit owns and reuses across modifies, kvedit.sdk.output) when fn declares a
  `new_kv` parameter by name (not through **kwargs: an fn that passes its keywords on must
  not receive it unasked).

A budget's edit (`fitted`): between decode rounds an fn must keep at most so many tokens; an
fn that `Fits` (every kvedit.edits policy: `keeping(max_tokens)`) is made to, any other fn is
called as it is and must shorten the stream enough itself.

PostCompletion: `post_completion(prompt_token_ids, sampling_params, cache_salt)` yields one
item per generated token (an int, or an object with `.token_id`). The salt is the third
positional argument by contract; a callable whose signature cannot take three positional
arguments is called with two, and a stream whose chunks are salted then refuses to use it.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from kvedit.layout import ModelLayout
from kvedit.sdk.head_tokens import as_head_tokens, check_tail, stand_ins


class Edited(NamedTuple):
    """What an EditFn returns: the edited KV [2, L, T', D] and its T' token ids (a per-head
    edit: ids [L, H_kv, T'], kvedit.sdk.head_tokens)."""
    kv: torch.Tensor
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class Checked:
    """fn's result once validated: kv on the host and one token id per slot. For a per-head
    edit `tokens` are the slots' stand-in ids and `heads` [L, H_kv, T'] what each (layer,
    head) holds. Unpacks as (kv, tokens), like what fn returned."""
    kv: torch.Tensor
    tokens: list[int]
    heads: torch.Tensor | None = None

    def __iter__(self):
        return iter((self.kv, self.tokens))


class NewKV(Protocol):
    """The `new_kv` an EditFn may declare: an uninitialised tensor of `shape` (or of the shape
    and dtype of a tensor `like`), on kvedit-owned reused pages."""
    def __call__(self, shape_or_like, dtype: torch.dtype | None = None) -> torch.Tensor: ...


@runtime_checkable
class EditFn(Protocol):
    def __call__(self, kv: torch.Tensor, tokens: list[int], *,
                 layout: ModelLayout = ..., queries: torch.Tensor = ...,
                 query_start: int = ..., new_kv: NewKV = ...) -> Any: ...


@runtime_checkable
class Fits(Protocol):
    """An edit that can be made to keep at most `max_tokens` tokens (kvedit.edits policies)."""
    def keeping(self, max_tokens: int) -> EditFn: ...


def fitted(fn, max_tokens: int, memo: dict | None = None):
    """fn made to keep at most `max_tokens` when it `Fits`; any other fn unchanged. An fn
    whose `keeping` takes a `memo` (kvedit.edits.PromptAnchored: the stream's prompt ranking,
    kept from one edit to the next) gets the stream's `memo`."""
    if not isinstance(fn, Fits):
        return fn
    if memo is not None and "memo" in _declared(fn.keeping)[0]:
        return fn.keeping(max_tokens, memo=memo)
    return fn.keeping(max_tokens)


@runtime_checkable
class PostCompletion(Protocol):
    def __call__(self, prompt_token_ids: list[int], sampling_params: Any,
                 cache_salt: str) -> Any: ...


def _declared(fn) -> tuple[set[str], bool]:
    """(keyword names fn declares, whether it takes **kwargs); ({}, False) if unknowable."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set(), False
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def wants_queries(fn) -> bool:
    """Does modify fetch captured queries for fn? (EditFn's rule for `queries`.)"""
    flag = getattr(fn, "needs_queries", None)
    if flag is not None:
        return bool(flag)
    return "queries" in _declared(fn)[0]


def fn_kwargs(fn, layout: ModelLayout, *, queries: torch.Tensor | None = None,
              query_start: int | None = None, new_kv: NewKV | None = None) -> dict:
    """The optional keywords modify passes fn (EditFn's rules, above). `queries` is given
    only when modify fetched them, i.e. when wants_queries(fn)."""
    names, var_kw = _declared(fn)
    kw: dict = {}
    if var_kw or "layout" in names:
        kw["layout"] = layout
    if queries is not None:
        kw["queries"] = queries
        if getattr(fn, "needs_queries", None) or var_kw or "query_start" in names:
            kw["query_start"] = query_start
    if new_kv is not None and "new_kv" in names:
        kw["new_kv"] = new_kv
    return kw


def is_async_fn(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


def takes_salt(post_completion) -> bool:
    """PostCompletion's rule: the salt is passed iff three positional arguments bind."""
    try:
        sig = inspect.signature(post_completion)
    except (TypeError, ValueError):  # no signature (some builtins): the declared protocol
        return True
    try:
        sig.bind([], None, "")
    except TypeError:
        return False
    return True


def check_result(result, layout: ModelLayout) -> Checked:
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
    heads = as_head_tokens(tokens, layout.num_layers, layout.hidden // layout.head_dim)
    if heads is not None:
        if heads.shape[-1] != kv.shape[2]:
            raise ValueError(f"fn returned per-head token ids for {heads.shape[-1]} slots but "
                             f"kv holds {kv.shape[2]}")
        check_tail(heads, layout.chunk_size)
        return Checked(kv.detach().cpu(), stand_ins(heads), heads)
    tokens = check_token_ids(tokens, "the tokens fn returned")
    if len(tokens) != kv.shape[2]:
        raise ValueError(f"fn returned {len(tokens)} tokens but kv holds {kv.shape[2]} "
                         f"(kv.shape[2] must equal len(tokens))")
    return Checked(kv.detach().cpu(), tokens)


def check_token_ids(tokens, what: str) -> list[int]:
    """A 1-D sequence of ints in [0, 2**32) as a list, or ValueError saying what is wrong."""
    if hasattr(tokens, "tolist"):  # torch / numpy
        tokens = tokens.tolist()
    tokens = list(tokens)
    if not tokens:
        return []
    arr = np.asarray(tokens, dtype=object)
    if arr.ndim != 1 or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                for t in tokens):
        bad = next((t for t in tokens if not isinstance(t, (int, np.integer))), tokens[0])
        raise ValueError(f"{what} must be a flat sequence of int token ids, found "
                         f"{type(bad).__name__} {bad!r}")
    lo, hi = min(tokens), max(tokens)
    if lo < 0 or hi >= 2**32:
        raise ValueError(f"{what} must be token ids in [0, 2**32), found {lo if lo < 0 else hi}")
    return [int(t) for t in tokens]
