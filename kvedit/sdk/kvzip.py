"""KVzip's reconstruction pass through vLLM: the queries that score a cache for any question.

KVzip (kvedit.edits.KVzip) ranks a context's keys by the attention they receive while the
model repeats the context. `reconstruct` runs that pass for every stream: one request of

    region + repeat_ids + region[start:]

where `region` is what `modify` edits (the stream's full chunks), through the stream's own
engine and salt, asking vLLM to capture the queries of `repeat_ids + region[start:]` (the
window). The region's KV is already in the kvedit server, and a capturing request loads the
tokens before its window from there (docs/queries.md), so vLLM computes only the window:
the pass costs about one more prefill of the region, with attention over twice its length.
Afterwards each stream holds the pass's captured queries as its own: the next
`modify(KVzip(...))` receives them (rows after the region: every row sees every key), and
any number of later questions are answered from the one edited cache.

The pass's own chunks beyond the region (the repeat prompt and the copy) are deleted once
the server has them; vLLM's prefix cache keeps its blocks until it needs the room.

Bound: the window is at most MAX_WINDOW (4096) rows, so `len(repeat_ids) + len(region) -
start` must fit; a longer region is refused with the numbers (kvpress splits the
reconstruction into pieces of 2048 tokens, each with its own pass; not done here).
Passes in flight, the check that each pass's queries are stored, and the deletion of the
pass's own chunks are every capturing pass's (`passes.py`; the context pass shares them).
"""
from __future__ import annotations

from kvedit.query_contract import MAX_WINDOW
from kvedit.sdk import passes
from kvedit.sdk.loop import run_sync
from kvedit.sdk.metrics import Metrics
from kvedit.sdk.passes import CAPTURE_BYTES, PassError
from kvedit.sdk.stream import Stream

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."  # kvpress's and the paper's


class ReconstructError(PassError):
    """The reconstruction pass could not run for a stream; the stream is unchanged."""


def pass_prompt(stream: Stream, repeat_ids: list[int], start: int = 0) -> tuple[list[int], int]:
    """(the pass's prompt, its window W) for `stream`; ReconstructError when it cannot run."""
    region = passes.region(stream, ReconstructError, "the pass to score")
    if not 0 <= start < len(region):
        raise ReconstructError(stream, f"start must be a token index in [0, {len(region)}) "
                                       f"(the edited region), got {start}")
    window = len(repeat_ids) + len(region) - start
    if window > MAX_WINDOW:
        raise ReconstructError(
            stream, f"the pass would capture {window} query rows ({len(repeat_ids)} repeat "
                    f"tokens + {len(region) - start} repeated tokens), more than the capture "
                    f"bound {MAX_WINDOW}: skip a prefix with start= or edit a shorter region")
    return region + list(repeat_ids) + region[start:], window


def _in_flight(streams, repeat_ids, start: int, capture_bytes: int) -> int:
    """How many passes may run at once (passes.in_flight)."""
    return passes.in_flight(streams, lambda s: pass_prompt(s, repeat_ids, start), capture_bytes)


async def areconstruct(streams, repeat_ids, *, start: int = 0, sampling_params=None,
                       wait_timeout: float = 60.0,
                       capture_bytes: int = CAPTURE_BYTES) -> Metrics:
    """Run KVzip's reconstruction pass for every stream (module docstring), concurrently.
    `repeat_ids`: the repeat prompt's token ids (e.g. the tokenizer's encoding of
    REPEAT_PROMPT followed by the chat template's end of the user turn and start of the
    assistant's); `start`: the first region token repeated (e.g. after the chat template's
    opening, as kvpress). `capture_bytes`: query rows of the passes run at once (keep it at
    or under the connector's `max_capture_bytes`). Returns Metrics("reconstruct"): the
    pass's prompt and cached tokens and its wall time (its cost against the plain
    prefill)."""
    ids = [int(t) for t in repeat_ids]
    if not ids:
        raise ValueError("repeat_ids is empty: the pass needs a prompt that asks the model "
                         "to repeat its context (REPEAT_PROMPT, tokenized)")
    return await passes.arun(streams, lambda s: pass_prompt(s, ids, start),
                             name="reconstruction", phase="reconstruct",
                             error=ReconstructError, sampling_params=sampling_params,
                             wait_timeout=wait_timeout, capture_bytes=capture_bytes)


def reconstruct(streams, repeat_ids, *, start: int = 0, sampling_params=None,
                wait_timeout: float = 60.0, capture_bytes: int = CAPTURE_BYTES) -> Metrics:
    """The synchronous `areconstruct`."""
    return run_sync(areconstruct(streams, repeat_ids, start=start,
                                 sampling_params=sampling_params, wait_timeout=wait_timeout,
                                 capture_bytes=capture_bytes))


def share_queries(src: Stream, dst: Stream) -> None:
    """`dst` (a stream of the same prompt and salt, e.g. a fresh one per edit) holds the
    queries `src` holds, so one reconstruction pass serves several edits."""
    if src.queries is None:
        raise ReconstructError(src, "it holds no captured queries to share (run "
                                    "reconstruct() first)")
    passes.share_queries(src, dst)
