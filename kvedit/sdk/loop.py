"""The synchronous facade: one background event loop per process runs the SDK's coroutines.

A dedicated loop thread (instead of `asyncio.run` per call) keeps HTTP connection pools alive
between calls and works from code that already runs a loop (Jupyter). It is one thread in all,
not one per stream.

Synchronous edit functions normally run in kvedit.sdk.alloc's fn pool (threads checked to
allocate from the main malloc arena, whose freed large blocks can be kept for reuse; two
streams' fns run side by side), whether the caller waits in `batch.modify(...)` or uses the
async API. Only where that pool has no main-arena threads (`alloc.pool_reuses_memory()`
False) does a waiting synchronous call lend its own thread (`in_caller`): fn then runs in
the thread that called `batch.modify(...)` (the main arena for the main thread; worker-thread
arenas map every large block afresh), one fn at a time. The budgeted run never uses the
caller (kvedit.sdk.driver: small edits overlapping decode ran ~20x slower there in
`bench long`).
"""
from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvedit.sdk.alloc import settle_small_cache

T = TypeVar("T")
_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
# The waiting caller's work queue, seen by the coroutines of its run_sync call only.
_caller: contextvars.ContextVar[queue.SimpleQueue | None] = contextvars.ContextVar(
    "kvedit_caller", default=None)


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
    work: queue.SimpleQueue = queue.SimpleQueue()
    token = _caller.set(work)  # the task copies this context when it is created
    try:
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
    finally:
        _caller.reset(token)
    fut.add_done_callback(lambda _: work.put(None))
    try:
        while (item := work.get()) is not None:
            item()
        return fut.result()
    except KeyboardInterrupt:
        fut.cancel()
        raise


async def in_caller(fn, *args, **kwargs):
    """Run fn(*args, **kwargs) in the thread waiting in run_sync for this coroutine, or None
    if there is none (the caller then uses its thread pool); returns fn's result."""
    work = _caller.get()
    if work is None:
        raise LookupError("no synchronous caller is waiting")
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def item() -> None:
        try:
            settle_small_cache()  # so fn's large blocks are reused at once (kvedit.sdk.alloc)
            result = fn(*args, **kwargs)
            settle_small_cache()
        except BaseException as e:  # handed to the awaiting coroutine, never lost
            loop.call_soon_threadsafe(_settle, done, None, e)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    work.put(item)
    return await done


def _settle(fut: asyncio.Future, result, error) -> None:
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(result)


def has_caller() -> bool:
    return _caller.get() is not None
