"""What the scheduler side asks the workers to copy between the server and vLLM's paged
blocks each step (plain data: a part of the step's metadata, kvedit.vllm.metadata)."""
from __future__ import annotations

from dataclasses import dataclass


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
