"""What the scheduler-side connector tells the worker side each step (plain data): each
sub-room's part of the step's plan, in one object vLLM hands from the scheduler to the
workers."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvedit.vllm.budget.plan import BudgetStep
from kvedit.vllm.capture.plan import QueryRun
from kvedit.vllm.transfer.plan import ChunkRun


@dataclass
class KVEditMetadata(KVConnectorMetadata):
    loads: list[ChunkRun] = field(default_factory=list)   # server -> paged, before forward
    stores: list[ChunkRun] = field(default_factory=list)  # paged -> server, after forward
    pre_stores: list[ChunkRun] = field(default_factory=list)  # paged -> server, before it
                                                              # (blocks this step reuses)
    queries: list[QueryRun] = field(default_factory=list)  # query rows to capture
    query_drops: list[str] = field(default_factory=list)   # requests gone: free their rows
    budgets: BudgetStep | None = None                      # in-engine budgets' work

