"""What the scheduler side tells the workers about in-engine budgets each step (plain data).

All block ids are vLLM scheduler block ids of the request's single KV cache group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvedit.engine_budget import EngineBudget


@dataclass(slots=True)
class Compaction:
    """Keep `keep` of the `resident` tokens in `old_blocks` (slots 0..resident-1), chosen by
    the request's policy, and write them to slots 0..keep-1 of `new_blocks`. Afterwards the
    request's logical position p sits in slot p - `offset` (for p past the kept tokens)."""
    req_id: str
    budget: EngineBudget
    resident: int
    keep: int
    old_blocks: list[int]
    new_blocks: list[int]
    offset: int


@dataclass(slots=True)
class Stash:
    """A compacted request was preempted: copy its `resident` tokens (slots of the worker's
    current block list) to host memory before the step reuses its blocks."""
    req_id: str
    resident: int


@dataclass(slots=True)
class Restore:
    """A stashed request resumes: write its stash to slots 0..resident-1 of `blocks`."""
    req_id: str
    blocks: list[int]
    offset: int


@dataclass(slots=True)
class RankPrompt:
    """Rank a request's computed prompt by the queries its ring holds. `computed`: the
    tokens whose queries are in the ring by this step (the ring's newest row is token
    computed - 1: under async scheduling a decode step may already have run, its row after
    the prompt's)."""
    req_id: str
    prompt_tokens: int
    computed: int
    budget: EngineBudget


@dataclass(slots=True)
class BudgetStep:
    compactions: list[Compaction] = field(default_factory=list)
    stashes: list[Stash] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)  # drop offsets and stashes of these
    # requests whose policy scores with queries: keep the queries of their last W tokens
    capture: list[tuple[str, int]] = field(default_factory=list)
    # requests whose prompt was just computed and whose policy ranks it once by its last
    # queries (PromptAnchored), ranked before this step's compactions
    rank_prompt: list[RankPrompt] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.compactions or self.stashes or self.restores or self.forget
                    or self.capture or self.rank_prompt)
