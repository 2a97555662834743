"""The context's own queries: a pass over the context alone, for policies that score with
them without seeing the question (Expected Attention; the null keys of head-adaptive
budgets, kvedit.edits.budgets).

A prefill captures the last W rows of its prompt, and when a question ends the prompt those
rows are the question's: a policy meant for any later question must not see them.
`capture_context` runs, for every stream, one request of the stream's editable region alone
(its full chunks, already in the kvedit server) capturing the region's last `rows` rows:
vLLM loads the tokens before them from the server and computes only those rows, so the pass
costs `rows` tokens of prefill. Each stream then holds the pass's queries (rows at positions
region - rows .. region - 1, inside the edited tokens) and the next `modify` hands them to
the policy. Checks, passes in flight and errors are every capturing pass's (`passes.py`).
"""
from __future__ import annotations

from kvedit.query_contract import MAX_WINDOW
from kvedit.sdk import passes
from kvedit.sdk.loop import run_sync
from kvedit.sdk.metrics import Metrics
from kvedit.sdk.passes import CAPTURE_BYTES, PassError
from kvedit.sdk.stream import Stream

ROWS = 512  # the context's last rows whose queries are captured (statistics, null keys)


class ContextPassError(PassError):
    """The context pass could not run for a stream; the stream is unchanged."""


def pass_prompt(stream: Stream, rows: int = ROWS) -> tuple[list[int], int]:
    """(the pass's prompt: the stream's region, its window: min(rows, region - 1))."""
    if not 0 < rows <= MAX_WINDOW:
        raise ContextPassError(stream, f"rows must be in [1, {MAX_WINDOW}] (the capture "
                                       f"bound), got {rows}")
    region = passes.region(stream, ContextPassError, "the pass to look at")
    # One token before the window is loaded, never computed: vLLM needs the rows' keys' past.
    return region, max(1, min(rows, len(region) - 1))


async def acapture_context(streams, rows: int = ROWS, *, sampling_params=None,
                           wait_timeout: float = 60.0,
                           capture_bytes: int = CAPTURE_BYTES) -> Metrics:
    """Run the context pass for every stream, concurrently (module docstring). Returns
    Metrics("context_pass"): its prompt and cached tokens and wall time."""
    return await passes.arun(streams, lambda s: pass_prompt(s, rows), name="context",
                             phase="context_pass", error=ContextPassError,
                             sampling_params=sampling_params, wait_timeout=wait_timeout,
                             capture_bytes=capture_bytes)


def capture_context(streams, rows: int = ROWS, *, sampling_params=None,
                    wait_timeout: float = 60.0, capture_bytes: int = CAPTURE_BYTES) -> Metrics:
    """The synchronous `acapture_context`."""
    return run_sync(acapture_context(streams, rows, sampling_params=sampling_params,
                                     wait_timeout=wait_timeout, capture_bytes=capture_bytes))
