"""Errors the SDK raises: each message names the stream (if any), what was wrong and what
was expected."""
from __future__ import annotations


class KVEditError(Exception):
    """Base of every error the kvedit SDK raises on purpose."""


class ConnectError(KVEditError):
    """connect() could not reach the server, or the model never registered."""


class StreamError(KVEditError):
    """One stream's operation failed; `.stream` is the stream, the message names it."""

    def __init__(self, stream, reason: str):
        super().__init__(f"{stream.label}: {reason}")
        self.stream = stream
        self.reason = reason


class ModifyError(StreamError):
    """modify() failed for a stream; the stream is unchanged and its original KV is kept."""


class MissingQueries(ModifyError):
    """fn needs captured queries (kvedit.sdk.queries) and the stream has none in the server."""


class CompletionError(StreamError):
    """The completion server (vLLM) failed or answered something unusable."""


class BatchError(KVEditError):
    """Several streams of a batch failed; `.errors` holds one StreamError per failed stream."""

    def __init__(self, phase: str, errors: list[BaseException], total: int):
        lines = "\n".join(_lines(errors))
        super().__init__(f"{phase} failed for {len(errors)} of {total} streams:\n{lines}")
        self.errors = errors


def _lines(errors: list[BaseException]) -> list[str]:
    """One line per distinct reason: when an engine dies every stream of a batch fails with
    the same message, and 64 copies of it hid what it said."""
    by_reason: dict[str, list[BaseException]] = {}
    for e in errors:
        key = f"{type(e).__name__}: {e.reason}" if isinstance(e, StreamError) else str(e)
        by_reason.setdefault(key, []).append(e)
    out = []
    for es in by_reason.values():
        if len(es) == 1 or not isinstance(es[0], StreamError):
            out += [f"  - {e}" for e in es]
            continue
        names = ", ".join(e.stream.label for e in es[:3]) + (", ..." if len(es) > 3 else "")
        out.append(f"  - {len(es)} streams ({names}): {es[0].reason}")
    return out


def raise_batch(phase: str, errors: list[BaseException], total: int) -> None:
    """One failure is raised as itself (easy to catch); several as a BatchError."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise BatchError(phase, errors, total)
