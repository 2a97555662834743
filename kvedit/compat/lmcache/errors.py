"""The LMCache SDK's error types, each also a kvedit KVEditError.

LMCache code catches these by their LMCache names (RuntimeError subclasses); kvedit code can
catch KVEditError. The kvedit error that caused one is its `__cause__`; a failure of several
streams keeps every stream's error in `.errors`.
"""
from __future__ import annotations

from kvedit.sdk.errors import KVEditError


class LMCacheSDKError(KVEditError, RuntimeError):
    """A context could not be made or used (server unreachable, model not registered)."""


class LMCacheRequestStreamError(KVEditError, RuntimeError):
    """A request stream's operation failed; the message names the stream(s) and why."""

    def __init__(self, message: str, errors: list[BaseException] | None = None):
        super().__init__(message)
        self.errors = errors or []


class LMCacheBatchedStreamError(KVEditError, RuntimeError):
    """A batch operation was asked for something the batch does not hold or do."""
