"""Repair: a query-agnostic selection mended for one question, within the same budget.

Why a policy of its own: a cache compressed without knowing the question (KeyDiff, KeyNorm,
StreamingLLM, ...) serves any question, but keeps only about half of a set of facts that look
alike to it, and the model then answers with a look-alike (docs/eval.md, "Where the 4k losses
come from"). When a question arrives, its captured queries say which of the original tokens
it needs. `Repair` is the edit that, applied to the original (uncompressed) KV with those
queries, keeps what the query-agnostic `base` policy keeps at the same ratio except for a
share `restore` of the budget, which goes to the tokens the question attends to most among
the rest (RepairKV's idea: restore the evicted tokens a new question needs from host memory).
`restore=1` re-selects the whole budget by the question (the `scorer` alone); `restore=0` is
the base alone; a count above 1 restores that many tokens (RepairKV restores 96).

The kept count is the base's at `ratio` (`keep_indices`) or the engine's (`select`): a
repaired cache is exactly as large as the compressed one it replaces. The selection: the
base's best `k - r` tokens are kept, then the scorer's ranking fills the other `r` slots
from the tokens the base did not keep (its own protected tokens, the `sink` and the
question's rows where they lie among the edited ones, come first). Per head (`per_head`):
both policies rank per (layer, KV head) and each head is mended on its own.

Policies are named by their registry names (`base`, `scorer`) with plain-data options
(`base_args`, `scorer_args`), so a Repair crosses a wire as any policy does
(kvedit.edits.spec; an in-engine budget can score with it). This module registers itself in
`POLICIES` as "repair": it names other policies and so sits above the registry, which it
imports; nothing below imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from kvedit.edits.base import INF, DropPolicy, top_tokens
from kvedit.edits.spec import POLICIES
from kvedit.layout import ModelLayout

# Options Repair passes to both of its policies (when the policy has them).
SHARED = ("granularity", "chunk_size", "per_head", "protect_last", "edit_device")


@dataclass
class Repair(DropPolicy):
    """Keep what `base` keeps, but give `restore` of the budget (a fraction in [0, 1], or a
    number of tokens when > 1) to the tokens `scorer` ranks best among those `base` drops
    (module docstring). `sink`: the first tokens always kept (the scorer's `sink`, and the
    base's where it has one)."""
    granularity: str = "token"
    base: str = "keydiff"
    base_args: dict[str, Any] = field(default_factory=dict)
    scorer: str = "snapkv"
    scorer_args: dict[str, Any] = field(default_factory=dict)
    restore: float = 1.0
    sink: int = 0
    needs_queries: ClassVar[bool] = True
    queries_from: ClassVar[str | None] = "prompt"   # the question's: a query-aware result

    def __post_init__(self):
        super().__post_init__()
        who = type(self).__name__
        if self.granularity != "token":
            raise ValueError(f"{who} mends a selection token by token: granularity must be "
                             f"'token', got {self.granularity!r}")
        if isinstance(self.restore, bool) or not isinstance(self.restore, (int, float)) \
                or self.restore < 0 or (self.restore > 1 and self.restore != int(self.restore)):
            raise ValueError(f"{who}.restore is {self.restore!r}; expected a share of the kept "
                             f"tokens in [0, 1] or a whole number of tokens > 1")
        if self.sink < 0:
            raise ValueError(f"{who}.sink must be >= 0 tokens, got {self.sink}")
        self._base = self._make("base", self.base, self.base_args, query_aware=False)
        self._scorer = self._make("scorer", self.scorer, self.scorer_args, query_aware=True)

    def _make(self, role: str, name: str, args: dict, *, query_aware: bool) -> DropPolicy:
        who = type(self).__name__
        cls = POLICIES.get(name)
        if cls is None or cls is Repair:
            raise ValueError(f"{who}.{role} is {name!r}; expected one of "
                             f"{sorted(set(POLICIES) - {'repair'})}")
        if query_aware and not (cls.needs_queries and hasattr(cls, "token_scores")
                                and not cls.needs_reconstruction):
            raise ValueError(f"{who}.scorer must rank tokens by the question's queries (snapkv, "
                             f"tova); {name!r} does not")
        if not query_aware and cls.needs_queries:
            raise ValueError(f"{who}.base is the selection made without the question; {name!r} "
                             f"scores with captured queries")
        if not isinstance(args, dict):
            raise ValueError(f"{who}.{role}_args must be a dict of {name}'s options, got "
                             f"{type(args).__name__}")
        known = {f.name for f in fields(cls)}
        mine = {k: getattr(self, k) for k in SHARED if k in known}
        if "sink" in known and self.sink:
            mine["sink"] = self.sink
        try:
            return cls(**{"ratio": self.ratio, **mine, **args})
        except TypeError as e:
            raise ValueError(f"{who}.{role}_args {args!r} for {name!r}: {e}") from None

    @property
    def base_policy(self) -> DropPolicy:
        """The query-agnostic policy at this ratio: what compresses a cache before its
        question is known (and what this Repair mends)."""
        return self._base

    def restored(self, keep: int) -> int:
        """Of `keep` kept tokens, how many the question chooses."""
        if self.restore <= 1:
            return round(self.restore * keep)
        return min(int(self.restore), keep)

    def keep_indices(self, kv: torch.Tensor, layout: ModelLayout | None = None, *,
                     queries=None, query_start: int | None = None) -> torch.Tensor:
        self._check_kv(kv)
        units = self.units(kv.shape[2], layout)
        keep = units.tokens - min(self.num_drop(units), units.tokens - 1)
        return self.select(kv, keep, layout, queries=queries, query_start=query_start)

    def select(self, kv: torch.Tensor, keep: int, layout: ModelLayout | None = None, *,
               queries=None, query_start: int | None = None) -> torch.Tensor:
        """Exactly `keep` sorted token indices ([keep], or [L, H_kv, keep] per head): the
        base's best keep - r, then the question's best r of the rest."""
        self._check_kv(kv)
        T = self._check_keep(kv, keep)
        if keep == T:
            return self._all(kv, layout, T)
        r = self.restored(keep)
        if r == 0:
            return self._base.select(kv, keep, layout)
        dev = self._elsewhere(kv)
        there = kv if dev is None else kv.to(dev)
        if dev is not None and isinstance(queries, torch.Tensor):
            queries = queries.to(dev)
        window = self.captured_window(there, layout, queries, query_start)
        scores = self._scorer.token_scores(there, layout, window).to(kv.device)
        if r < keep:
            scores = self._with_base(kv, scores, self._base.select(kv, keep - r, layout))
        return top_tokens(self._protect(scores), keep)

    @staticmethod
    def _with_base(kv: torch.Tensor, scores: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """The question's scores with the base's kept tokens ranked first (inf), per head
        where either ranks per head."""
        if base.dim() > scores.dim():
            scores = scores.expand(*base.shape[:-1], scores.shape[-1])
        out = scores.clone()
        out.scatter_(-1, base.expand(*out.shape[:-1], base.shape[-1]), INF)
        return out


POLICIES["repair"] = Repair
