"""A request stream: one prompt whose KV lives in the server, edited and decoded in steps.

State: `tokens` is the sequence whose full chunks the server holds for this stream after
its last edit (the prompt, then the edited tokens); `suffix` holds what comes after it (a
partial last chunk, generated tokens), re-sent on every request. `kv_tokens` counts the
leading tokens of `tokens + suffix` whose KV the engine has computed for this very sequence:
their full chunks are (or are about to be) stored by the connector, prompt and generated
tokens alike, so modify edits exactly those (decode-time editing, docs/sdk.md). `keys` are
the keys of those chunks; the stream holds one reference on each in its context
(`Context.ref`), so modify/release delete a chunk only once no stream uses it.
`cache_salt` is the salt the stream's chunks are keyed with; modify may switch it to a fresh
derived salt (see `kvedit.sdk.modify`), and every later request then carries that salt.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvedit.engine_budget import EngineBudget
from kvedit.query_contract import check_window
from kvedit.request_params import RequestAsks, with_asks
from kvedit.sdk import queries as Q
from kvedit.sdk.context import Context
from kvedit.sdk.contracts import check_token_ids, takes_salt
from kvedit.sdk.errors import CompletionError, KVEditError


@dataclass
class Generation:
    """What one completion request produced, with its timings."""
    token_ids: list[int]
    prompt_tokens: int
    ttft: float | None
    tpot: float | None
    finish_reason: str | None
    cached_tokens: int | None


def get_max_tokens(params) -> int | None:
    if params is None:
        return None
    if isinstance(params, Mapping):
        return params.get("max_tokens")
    return getattr(params, "max_tokens", None)


def with_max_tokens(params, n: int):
    """A copy of the sampling params with max_tokens = n (dict, dataclass, or vLLM-like)."""
    if params is None:
        return {"max_tokens": n}
    if isinstance(params, Mapping):
        return {**params, "max_tokens": n}
    if dataclasses.is_dataclass(params):
        return dataclasses.replace(params, max_tokens=n)
    p = params.clone() if hasattr(params, "clone") else copy.copy(params)
    p.max_tokens = n
    return p


class Stream:
    """One request: create with `create_request`, drive with a BatchedStream."""

    def __init__(self, ctx: Context, post_completion, prompt_token_ids, cache_salt: str = "",
                 name: str | None = None, capture_queries: int | None = None,
                 budget: EngineBudget | None = None):
        if budget is not None and not isinstance(budget, EngineBudget):
            raise TypeError(f"budget must be a kvedit.EngineBudget, got {type(budget).__name__}")
        self.budget = budget  # each request asks vLLM to keep the KV within it
        self.ctx = ctx
        self.id = ctx.next_stream_id()
        self.name = name
        self.post_completion = post_completion
        self._salt_ok = takes_salt(post_completion)
        self.prompt_token_ids = check_token_ids(prompt_token_ids, f"{self.label} prompt_token_ids")
        if not self.prompt_token_ids:
            raise ValueError(f"{self.label}: prompt_token_ids is empty")
        self.cache_salt = cache_salt or ""
        # query window W asked at prefill (None: the batch's default; 0: off), and the
        # captured-queries object the last prefill asked for (kvedit.sdk.queries)
        self.capture_queries = check_window(capture_queries,
                                              f"{self.label} capture_queries")
        self.queries: Q.Capture | None = None
        self.tokens: list[int] = list(self.prompt_token_ids)
        self.suffix: list[int] = []
        self.output_token_ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.done = False
        self.generations: list[Generation] = []
        self.kv_tokens = len(self.tokens)  # the prompt's chunks: what prefill will store
        self.keys: list[bytes] = self.keys_for(self.tokens, self.cache_salt)
        ctx.ref(self.keys)  # the prompt's chunks are this stream's until it edits them away
        self.released = False
        Q.expect(self, self.capture_queries or 0)

    @property
    def label(self) -> str:
        return f"stream {self.id}" + (f" ({self.name})" if self.name else "")

    @property
    def prompt(self) -> list[int]:
        """What the next request sends: tokens + suffix."""
        return self.tokens + self.suffix

    def budget_for(self, given: EngineBudget | None) -> EngineBudget | None:
        """The one rule for which budget a request asks for: the stream's own
        (create_request(..., budget=...)) wins; a budget given for a run or a request applies
        to a stream that has none."""
        return self.budget if self.budget is not None else given

    def keys_for(self, tokens, salt: str) -> list[bytes]:
        return self.ctx.keys_for(tokens, salt)   # rank 0's under TP (Context remembers all)

    async def generate(self, sampling_params, max_tokens: int | None = None,
                       capture_queries: int = 0,
                       budget: EngineBudget | None = None) -> Generation:
        """Send `prompt` (with the stream's salt), append the generated tokens to the suffix.
        capture_queries=W: ask vLLM to capture the queries of the prompt's last W tokens.
        budget: an in-engine budget for this request, where the stream has none of its own
        (`budget_for`)."""
        budget = self.budget_for(budget)
        params = sampling_params if max_tokens is None else with_max_tokens(sampling_params,
                                                                            max_tokens)
        # the edit reads this request's chunks next: stored as computed, whatever the
        # connector's store mode (params that cannot carry it: the mode decides)
        asks = RequestAsks(store_eager=True, capture=capture_queries, budget=budget)
        try:
            params = with_asks(params, asks)
        except TypeError as e:
            raise CompletionError(self, str(e)) from None
        limit = get_max_tokens(params)
        if self.released:
            raise CompletionError(self, "the stream was released (arelease); create a new one")
        if self.cache_salt and not self._salt_ok:
            raise CompletionError(self, f"post_completion {self.post_completion!r} takes no "
                                        f"cache_salt argument but the stream's chunks are "
                                        f"salted {self.cache_salt!r}")
        prompt = self.prompt
        args = (prompt, params, self.cache_salt) if self._salt_ok else (prompt, params)
        ids, lps, stamps = [], [], []
        finish = cached = None
        start = time.perf_counter()
        try:
            async for item in _iterate(self.ctx, self.post_completion(*args)):
                stamps.append(time.perf_counter())
                ids.append(self._token_id(item))
                lps.append(getattr(item, "logprob", None))
                finish = getattr(item, "finish_reason", None) or finish
                usage = getattr(item, "usage", None)
                if usage:
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        except CompletionError as e:
            if e.stream is not self:
                raise CompletionError(self, str(e)) from e
            raise
        except KVEditError as e:
            raise CompletionError(self, str(e)) from e
        except Exception as e:  # a failure inside post_completion itself, reported as such
            raise CompletionError(self, f"post_completion raised {type(e).__name__}: {e}") from e
        if capture_queries:
            Q.hold(self, Q.capture_for(self.ctx, prompt, self.cache_salt, capture_queries))
        self.suffix += ids
        self.output_token_ids += ids
        self.logprobs += lps
        self.done = limit is None or len(ids) < limit
        # The engine computed KV for the whole prompt and every generated token but the last
        # (under an in-engine budget the connector stores the prompt's chunks only).
        self._own_computed(len(prompt) + (0 if budget is not None else max(0, len(ids) - 1)))
        gen = Generation(ids, len(prompt), stamps[0] - start if stamps else None,
                         (stamps[-1] - stamps[0]) / (len(ids) - 1) if len(ids) > 1 else None,
                         finish, cached)
        self.generations.append(gen)
        return gen

    def append(self, token_ids) -> None:
        """Add tokens after everything the stream holds (a user's next turn after a long
        output): the next request sends them and the engine computes their KV then."""
        ids = check_token_ids(token_ids, f"{self.label} appended token ids")
        if self.released:
            raise CompletionError(self, "the stream was released (arelease); create a new one")
        self.suffix += ids
        self.done = False

    def _token_id(self, item) -> int:
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            return int(item)
        tid = getattr(item, "token_id", None)
        if not isinstance(tid, (int, np.integer)) or isinstance(tid, bool):
            raise CompletionError(self, f"post_completion yielded {type(item).__name__} "
                                        f"{item!r}: neither a token id nor has an int "
                                        f".token_id")
        return int(tid)

    def _own_computed(self, computed: int) -> None:
        """The engine now holds KV for the first `computed` tokens of tokens + suffix: the
        connector stores their full chunks (generated ones too), so the stream references
        them from now on; modify edits them and release() frees them."""
        self.kv_tokens = computed
        full = computed // self.ctx.chunk_size
        if full > len(self.keys):
            keys = self.keys_for(self.prompt[:full * self.ctx.chunk_size], self.cache_salt)
            self.ctx.ref(keys[len(self.keys):])
            self.keys = keys

    async def arelease(self) -> int:
        """Drop the stream's references; delete the chunks no other stream of the context
        uses. Returns how many the server deleted. The stream cannot be used afterwards."""
        if self.released:
            return 0
        self.released, self.done = True, True
        await Q.release_queries(self)
        dead, self.keys = self.ctx.unref(self.keys), []
        return await self.ctx.call(self.ctx.delete_kv, dead) if dead else 0   # every TP rank

    def __repr__(self) -> str:
        return (f"<{self.label}: {len(self.tokens)} cached + {len(self.suffix)} suffix tokens, "
                f"{len(self.output_token_ids)} generated, salt={self.cache_salt!r}"
                f"{', done' if self.done else ''}>")


async def _iterate(ctx: Context, gen):
    """Items of an async generator, or of a sync one (each next() runs in the pool)."""
    if hasattr(gen, "__aiter__"):
        async for item in gen:
            yield item
        return
    it = iter(gen)
    done = object()
    while (item := await ctx.call(next, it, done)) is not done:
        yield item


def create_request(ctx: Context, post_completion, prompt_token_ids, cache_salt: str = "",
                   *, name: str | None = None, capture_queries: int | None = None,
                   budget: EngineBudget | None = None) -> Stream:
    """A stream for `prompt_token_ids`; `post_completion(prompt_token_ids, sampling_params,
    cache_salt)` yields generated tokens (ints or objects with `.token_id`), sync or async.
    `capture_queries=W` (1..4096): its prefill asks vLLM to capture the queries of the last W
    prompt tokens, for an fn that takes `queries` (kvedit.sdk.queries); None: the batch's
    default; 0: off. `budget`: every request of the stream asks vLLM to keep its KV within
    this in-engine budget (kvedit.engine_budget; the connector needs "in_engine": true)."""
    return Stream(ctx, post_completion, prompt_token_ids, cache_salt, name, capture_queries,
                  budget)
