"""`kvedit bench serve` as a package: run.py (the bench) and workloads.py (what it sends).

The names the bench had as one module stay reachable here for its importers until they move.
"""
from __future__ import annotations

import importlib


def __getattr__(name: str):
    run = importlib.import_module("kvedit.bench.serve.run")
    try:
        return getattr(run, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
