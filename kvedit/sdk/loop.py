"""The synchronous facade: one background event loop per process runs the SDK's coroutines.

A dedicated loop thread (instead of `asyncio.run` per call) keeps HTTP connection pools alive
between calls and works from code that already runs a loop (Jupyter). It is one thread in all,
not one per stream. Synchronous edit fns run in the context's thread pool
(kvedit.sdk.context.Context.run_fn), never in the thread waiting here.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="kvedit-loop", daemon=True).start()
            _loop = loop
        return _loop


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on the background loop and wait for it (Ctrl-C cancels it)."""
    loop = _background_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise RuntimeError("a synchronous kvedit call was made from inside kvedit's own event "
                           "loop; use the async API (aprefill, amodify, adecode, arun) there")
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return fut.result()
    except KeyboardInterrupt:
        fut.cancel()
        raise
