"""Scheduler side of query capture: which requests ask, and which tokens of their window
each step computes (sent to the workers as paged slots).

A request asks with the capture field of its kv_transfer_params (kvedit.request_params,
which the SDK writes and the scheduler side reads once, handing this planner what was
asked). Its window is the last min(W, prompt length) prompt tokens. Every window token must
be *computed* for its query to exist, so an asking request never reads vLLM's own prefix
cache (a cached block may hold window tokens of an earlier identical prompt): the connector
sets `skip_reading_prefix_cache` when it arrives. The tokens before its window it may load
from the kvedit server, whose answer the connector caps at the window's start (a KVzip
reconstruction pass, context + repeat prompt + context, loads its first context so). vLLM >=
0.31 drops a connector's hit for a request that skips its prefix cache, so the flag is
lifted right after vLLM's own lookup, while vLLM weighs the connector's answer (`lift`), and
set again when the step's scheduling ends (`relock`, from build_meta): every lookup of
vLLM's own cache sees it set.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvedit.keys import namespace, query_key
from kvedit.query_contract import CaptureRows
from kvedit.request_params import RequestAsks
from kvedit.vllm import hooks
from kvedit.vllm.capture.plan import QueryRun

logger = logging.getLogger("vllm.kvedit")


@dataclass(slots=True)
class _Window:
    request: object          # vllm Request (prompt, salt)
    at: CaptureRows          # the W asked (the key's) and the prompt rows it holds
    nbytes: int              # the object's size on one rank
    keys: list[bytes] | None = None  # query_key per rank, made at the first plan
    done: bool = False       # every row planned (the worker completes it that step)


class WindowPlanner:
    """Tracks the asking requests; plans each step's QueryRuns.

    `row_bytes`: one window row on one rank (layers x q heads x head_dim x dtype size).
    `max_bytes` bounds the windows in flight (asked, not yet fully computed), which is what
    the workers may hold in partial buffers; a request past it is refused with a warning."""

    def __init__(self, model: str, block_size: int, row_bytes: int, max_bytes: int,
                 unavailable: str | None = None):
        self.model, self.block_size = model, block_size
        self.row_bytes, self.max_bytes = row_bytes, max_bytes
        self.unavailable = unavailable  # why capture is off in this vLLM, or None
        self.windows: dict[str, _Window] = {}
        self.lifted: list = []   # requests whose skip_reading_prefix_cache is lifted (lift)
        self.in_flight = 0
        self.drops: list[str] = []
        self._last_warn = -1e9

    def add(self, request, asks: RequestAsks) -> None:
        """A new request: remember its window if it asks for one."""
        if asks.capture_error:
            return self._refuse(request, asks.capture_error)
        w = asks.capture
        if not w:
            return
        if self.unavailable:
            return self._refuse(request, self.unavailable)
        prompt = getattr(request, "prompt_token_ids", None)
        if not prompt:
            return self._refuse(request, "it has no prompt token ids (prompt embeddings?)")
        at = CaptureRows(w, len(prompt))
        nbytes = at.rows * self.row_bytes
        if self.in_flight + nbytes > self.max_bytes:
            return self._refuse(request, f"{nbytes} bytes of queries would exceed "
                                         f"max_capture_bytes={self.max_bytes} in flight")
        self.in_flight += nbytes
        hooks.skip_prefix_cache(request, True)  # every window token must be computed
        self.windows[request.request_id] = _Window(request, at, nbytes)

    def asks(self, req_id: str) -> bool:
        return req_id in self.windows

    def window_start(self, req_id: str) -> int | None:
        """Prompt tokens before an asking request's window (what it may load from the
        kvedit server); None when it does not ask."""
        win = self.windows.get(req_id)
        return None if win is None else win.at.start

    def lift(self, request) -> None:
        """vLLM has looked in its own prefix cache for `request` (it skipped it) and now
        weighs the connector's hit: let the hit count until `relock`."""
        hooks.skip_prefix_cache(request, False)
        self.lifted.append(request)

    def relock(self) -> None:
        """End of a step's scheduling: asking requests skip vLLM's prefix cache again (one
        that was not admitted, or is preempted later, is looked up afresh)."""
        for request in self.lifted:
            hooks.skip_prefix_cache(request, True)
        self.lifted.clear()

    def plan(self, req_id: str, block_ids: list[int], computed: int, scheduled: int,
             layouts) -> QueryRun | None:
        """The window rows computed in this step's [computed, computed + scheduled), if any."""
        win = self.windows.get(req_id)
        if win is None:
            return None
        start, rows = win.at.start, win.at.rows
        end = min(computed + scheduled, start + rows)
        lo = max(computed, start)
        if lo >= end:
            return None
        if win.keys is None:
            salt = getattr(win.request, "cache_salt", None) or ""
            prompt = win.request.prompt_token_ids
            win.keys = [query_key(namespace(self.model, lay, salt), prompt, win.at.window)
                        for lay in layouts]
        bs = self.block_size
        slots = [block_ids[p // bs] * bs + p % bs for p in range(lo, end)]
        if end == start + rows and not win.done:
            win.done = True  # the worker stores it after this step: no longer in flight
            self.in_flight -= win.nbytes
        return QueryRun(req_id, win.keys, rows, lo - start, slots)

    def finished(self, req_id: str) -> None:
        win = self.windows.pop(req_id, None)
        if win is None:
            return
        if not win.done:
            self.in_flight -= win.nbytes
        self.drops.append(req_id)  # the workers free any rows they still hold

    def take_drops(self) -> list[str]:
        """The requests gone since the last step: the workers free any rows they hold."""
        drops, self.drops = self.drops, []
        return drops

    def _refuse(self, request, why: str) -> None:
        now = time.monotonic()
        if now - self._last_warn > 10.0:  # a client asking wrongly must not flood the log
            self._last_warn = now
            logger.warning("kvedit: request %s asked for query capture but gets none: %s",
                           getattr(request, "request_id", "?"), why)
