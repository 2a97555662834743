"""kvedit: edit the KV cache of a live vLLM.

The public API is imported lazily, so `import kvedit` (and the `kvedit` command) stays light
and torch is loaded only when a name that needs it is used.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    "connect": "kvedit.sdk.context", "close": "kvedit.sdk.context",
    "aconnect": "kvedit.sdk.context", "aclose": "kvedit.sdk.context",
    "Context": "kvedit.sdk.context",
    "create_request": "kvedit.sdk.stream", "Stream": "kvedit.sdk.stream",
    "BatchedStream": "kvedit.sdk.batch", "LMCacheBatchedStream": "kvedit.sdk.batch",
    "Metrics": "kvedit.sdk.metrics",
    "openai_completion": "kvedit.sdk.openai", "TokenEvent": "kvedit.sdk.openai",
    "ModelLayout": "kvedit.layout", "RopeParams": "kvedit.layout",
    "EngineBudget": "kvedit.engine_budget", "HostBudget": "kvedit.sdk.driver",
    "Originals": "kvedit.sdk.originals", "Repair": "kvedit.edits.repair",
    "RepairError": "kvedit.sdk.repair",
    "KVEditError": "kvedit.sdk.errors", "ConnectError": "kvedit.sdk.errors",
    "StreamError": "kvedit.sdk.errors", "ModifyError": "kvedit.sdk.errors",
    "CompletionError": "kvedit.sdk.errors", "BatchError": "kvedit.sdk.errors",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvedit' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
