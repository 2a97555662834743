"""StreamState: what LMCache's request stream reports that kvedit's Stream does not keep.

kvedit's Stream owns the sequence (`tokens` + `suffix`), salt, chunk keys and token counts;
this module adds only LMCache's views of it:
- the text and per-token times of each request (a Recorder wraps post_completion);
- LMCache's end-of-stream rule (fewer tokens than `max_tokens`, 1 when absent);
- LMCache's split of the sequence: its `tokens` end where the last edit ended until the next
  request, and what an edit left after its region waits in `suffix_tokens`. kvedit keeps
  that tail in its suffix, so the split is one count (`pending`) over kvedit's sequence.
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvedit import Stream
from kvedit.compat.lmcache.cache_kind import LMCacheSDKCacheKind
from kvedit.compat.lmcache.perf import StreamPerfMetrics


@dataclass
class Call:
    """One post_completion call: when it started, each token's arrival and text, its end."""
    start: float = field(default_factory=time.perf_counter)
    stamps: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    end: float | None = None

    def note(self, event) -> None:
        self.stamps.append(time.perf_counter())
        self.texts.append(getattr(event, "text", "") or "")


class Recorder:
    """post_completion as kvedit calls it, recording each call; LMCache's own is called inside
    the generator, so a blocking (list-returning) one runs in kvedit's I/O threads."""

    def __init__(self, post_completion):
        if not callable(post_completion):
            raise TypeError(f"post_completion must be callable (prompt_token_ids, "
                            f"sampling_params, cache_salt) -> Iterable[TokenEvent], got "
                            f"{type(post_completion).__name__}")
        self.post_completion = post_completion
        self.last: Call | None = None
        self._async = inspect.isasyncgenfunction(post_completion) or \
            inspect.isasyncgenfunction(getattr(post_completion, "__call__", None))

    def __call__(self, prompt_token_ids, sampling_params, cache_salt: str):
        call = self.last = Call()
        run = self._arun if self._async else self._run
        return run(call, list(prompt_token_ids), sampling_params, cache_salt)

    def _run(self, call: Call, prompt, params, salt):
        call.start = time.perf_counter()
        try:
            for event in self.post_completion(prompt, params, salt):
                call.note(event)
                yield event
        finally:
            call.end = time.perf_counter()

    async def _arun(self, call: Call, prompt, params, salt):
        call.start = time.perf_counter()
        try:
            async for event in self.post_completion(prompt, params, salt):
                call.note(event)
                yield event
        finally:
            call.end = time.perf_counter()


class StreamState:
    """One LMCache request stream's kvedit Stream, its kinds and LMCache's bookkeeping."""

    def __init__(self, stream: Stream, recorder: Recorder,
                 kinds: frozenset[LMCacheSDKCacheKind]):
        self.stream = stream
        self.recorder = recorder
        self.kinds = kinds
        self.pending = 0         # tokens at the end of the sequence LMCache holds aside
        self.decoded = 0
        self.texts: list[str] = []
        self.done = False
        self.last_perf: StreamPerfMetrics | None = None   # of the last request, if it ran

    @property
    def label(self) -> str:
        return self.stream.label

    @property
    def has_queries(self) -> bool:
        return LMCacheSDKCacheKind.QUERY in self.kinds

    def sequence(self) -> list[int]:
        return self.stream.tokens + self.stream.suffix

    def lmcache_tokens(self) -> list[int]:
        seq = self.sequence()
        return seq[:len(seq) - self.pending]

    def pending_tokens(self) -> list[int]:
        seq = self.sequence()
        return seq[len(seq) - self.pending:]

    def edit_region(self) -> int:
        """Tokens a modify now hands fn: the full chunks of what the engine has computed."""
        c = self.stream.ctx.chunk_size
        return self.stream.kv_tokens // c * c

    # ---- around a request ----------------------------------------------------------------
    def append(self, suffix_tokens) -> None:
        if len(suffix_tokens):
            self.stream.append(suffix_tokens)

    def begin_request(self) -> None:
        """LMCache sends everything, held-aside tokens included, and runs a stream again even
        when it stopped early; kvedit's decode skips a done stream, so clear its flag."""
        self.pending = 0
        self.stream.done = False
        self.last_perf = None

    def end_request(self, params: Mapping) -> None:
        gen = self.stream.generations[-1]
        call = self.recorder.last
        n = len(gen.token_ids)
        self.decoded += n
        self.texts += call.texts
        self.done = n < params.get("max_tokens", 1)
        self.last_perf = StreamPerfMetrics.of(call.start, call.stamps,
                                              call.end or time.perf_counter(),
                                              gen.prompt_tokens, n)

    # ---- around an edit ------------------------------------------------------------------
    def after_edit(self, before: list[int], region: int) -> None:
        """kvedit kept everything after the edited region in its suffix; LMCache holds that
        tail aside until the next request."""
        self.pending = len(before) - region
        self.done = False

    def after_replace(self, n_tokens: int, held: list[int]) -> None:
        """update(): LMCache's sequence becomes exactly the given tokens plus what it already
        held aside; kvedit kept the old tail after them, which is dropped here."""
        s = self.stream
        s.suffix = s.suffix[:n_tokens - len(s.tokens)] + held
        self.pending = len(held)
        self.done = False
