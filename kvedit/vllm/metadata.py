"""What the scheduler-side connector tells the worker side each step (plain data)."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvedit.vllm.budget_plan import BudgetStep


@dataclass(slots=True)
class ChunkRun:
    """Consecutive chunks of one request.

    keys[r][i] is the key of chunk `first + i` on tensor-parallel rank r. Tokens
    [start, end) of those chunks are copied (a load may start or end mid-chunk); block_ids
    are the request's vLLM block ids, which map a token position to its paged slot.
    """
    req_id: str
    first: int
    keys: list[list[bytes]]
    start: int
    end: int
    block_ids: list[int]


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


@dataclass
class KVEditMetadata(KVConnectorMetadata):
    loads: list[ChunkRun] = field(default_factory=list)   # server -> paged, before forward
    stores: list[ChunkRun] = field(default_factory=list)  # paged -> server, after forward
    pre_stores: list[ChunkRun] = field(default_factory=list)  # paged -> server, before it
                                                              # (blocks this step reuses)
    queries: list[QueryRun] = field(default_factory=list)  # query rows to capture
    query_drops: list[str] = field(default_factory=list)   # requests gone: free their rows
    budget: BudgetStep | None = None                       # in-engine budgets' work

