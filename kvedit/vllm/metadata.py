"""What the scheduler-side connector tells the worker side each step (plain data)."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


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


@dataclass
class KVEditMetadata(KVConnectorMetadata):
    loads: list[ChunkRun] = field(default_factory=list)   # server -> paged, before forward
    stores: list[ChunkRun] = field(default_factory=list)  # paged -> server, after forward
