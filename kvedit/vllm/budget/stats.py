"""The in-engine budgets' counters on both sides, logged as JSON lines in vLLM's log
(`kvedit: in-engine stats {...}`, `... worker stats {...}`), which `kvedit bench long` reads
back (kvedit.bench.long.engine)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class BudgetStats:
    """Counters of this engine's in-engine budgets (logged as JSON; `bench long` reads them)."""
    requests: int = 0
    refused: int = 0
    compactions: int = 0
    early_compactions: int = 0  # of them: before the budget, for want of a free block
    tokens_dropped: int = 0
    blocks_released: int = 0   # the requests' block lists shrank by this many
    blocks_reused: int = 0     # blocks freed by a compaction that vLLM handed out again
    cow_blocks: int = 0        # kept blocks replaced rather than written (shared, or cached
                               # with cached_kept_blocks "copy")
    uncached_blocks: int = 0   # kept blocks taken out of the prefix cache, written in place
    no_room: int = 0           # compactions put off: no free block for a copy on write
    stashes: int = 0
    restores: int = 0
    recomputes: int = 0        # preempted with no room in the stash: recomputed in full
    rotations: int = 0         # requests preempted to let a stashed one take its turn
    decide_s: float = 0.0      # scheduler time spent deciding compactions
    pool_free: int = 0         # vLLM's free blocks when last logged
    pool_total: int = 0



@dataclass(slots=True)
class WorkerStats:
    steps: int = 0             # steps that compacted, stashed or restored
    compactions: int = 0
    tokens_in: int = 0         # resident tokens scored
    tokens_kept: int = 0
    stashed: int = 0
    restored: int = 0
    most_in_a_step: int = 0    # compactions in the busiest step
    batched: int = 0           # compactions run as one with others of their step
    compact_s: float = 0.0     # host time in run() (on the CPU: all of its work)
    device_s: float = 0.0      # CUDA: device time of the work run() queued
    shifted_steps: int = 0     # steps whose inputs were shifted for compacted requests
    shift_s: float = 0.0       # time spent shifting them (every step with one in the batch)
    query_scored: int = 0      # compactions a query-aware policy scored with its ring's rows
    query_rows: int = 0        # the ring rows those compactions scored with
