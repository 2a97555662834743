"""Which query rows the scheduler side asks the workers to capture each step (plain data: a
part of the step's metadata, kvedit.vllm.metadata)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class QueryRun:
    """Rows of one request's query window that this step computes (query capture).

    The window is the request's last `rows` prompt tokens; this step computes rows
    [row0, row0 + len(slots)), whose tokens sit in the paged slots `slots` (block id x block
    size + offset: how the worker finds them in the step's slot mapping). keys[r] is the
    window's query_key on tensor-parallel rank r.
    """
    req_id: str
    keys: list[bytes]
    rows: int
    row0: int
    slots: list[int]
