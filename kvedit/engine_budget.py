"""The in-engine budget contract: what a request asks of vLLM to have its KV kept within a
budget, compacted in place (docs/in-engine.md).

One module, imported by both sides of the wire: the SDK writes it
(`create_request(..., budget=EngineBudget(...))`, or `BatchedStream.run` given one where an
edit fn goes: `EngineBudget.from_policy(KeyNorm(), 768, 128)`), the connector's scheduler
side rebuilds and validates it when the request arrives and hands the parsed value to the
workers. On the wire it is the `to_dict()` of an EngineBudget under the budget field of a
request's `kv_transfer_params` (kvedit.request_params writes and reads it):

    {"tokens": 768, "every": 128, "policy": "key_norm", "args": {}, "protect": 16,
     "positions": "compact", "per_head": false, "queries": 0}

- tokens: the most KV tokens the engine holds for the request once its prompt is computed
  (the prompt itself is computed whole, however long).
- every: when the next token would pass `tokens`, the request is compacted to
  `tokens - every` kept tokens, so it compacts at most once per `every` generated tokens.
- policy, args: a `kvedit.edits.POLICIES` name and its dataclass fields; the worker scores the
  request's resident tokens with that very policy object (`DropPolicy.select`). `ratio` is
  set per compaction; `granularity` defaults to "token".
- protect: the most recent tokens always kept (in every head). Default: `every` (and at least
  `queries`), at most what a compaction keeps: a token is not dropped before `every` newer
  ones follow it. 0 lets a policy that scores by content drop the newest tokens, which cuts
  a generation's local context (docs/in-engine.md, "Protecting the newest tokens").
- positions: "compact" re-rotates kept keys to contiguous positions and numbers new tokens
  after them (what the host path's edit does); "logical" leaves RoPE alone and new tokens at
  their true positions.
- per_head: one selection per (layer, KV head), equal counts (kvedit.edits.base).
- queries: for a query-aware policy (SnapKV, TOVA), the worker keeps the post-RoPE queries of
  the request's last `queries` computed tokens and the policy scores with them (the most
  recent tokens are the observation window); `protect` must cover them, so the window's
  tokens stay resident. Such a request computes its whole prompt (no prefix-cache hits).
  A policy that ranks the prompt once by its last rows (`queries_at_prefill`:
  PromptAnchored) uses them once, when the prompt is computed, and keeps no ring during
  decode; its window is the prompt's tail, so `protect` need not cover it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from kvedit.edits.spec import POLICIES, PolicySpec, from_spec, to_spec

Positions = Literal["compact", "logical"]
FIELDS = ("tokens", "every", "policy", "args", "protect", "positions", "per_head", "queries")
MAX_QUERIES = 4096


def _ranks_at_prefill(policy: str) -> bool:
    """A policy that scores with the prompt's last queries once, at prefill (PromptAnchored):
    no query ring during decode, and its window needs no protection."""
    cls = POLICIES.get(policy) if isinstance(policy, str) else None
    return bool(getattr(cls, "queries_at_prefill", False))


class BudgetError(ValueError):
    """A request's budget is malformed or cannot apply in this engine."""


@dataclass(frozen=True)
class EngineBudget:
    tokens: int
    every: int = 64
    policy: str = "streaming_llm"
    args: dict[str, Any] = field(default_factory=dict)
    protect: int | None = None  # None: the default above, resolved at construction
    positions: Positions = "compact"
    per_head: bool = False
    queries: int = 0

    def __post_init__(self):
        self._check()

    @property
    def ranks_prompt(self) -> bool:
        """Its policy ranks the prompt once, by the prompt's last `queries` rows, when the
        prompt is computed (PromptAnchored), and keeps no query ring during decode."""
        return _ranks_at_prefill(self.policy)

    @property
    def keep(self) -> int:
        """Tokens kept by each compaction."""
        return self.tokens - self.every

    @classmethod
    def from_policy(cls, policy, tokens: int, every: int, *, positions: Positions = "compact",
                    protect: int | None = None, queries: int = 0) -> EngineBudget:
        """The budget that scores with `policy` (a kvedit.edits policy object, in its
        plain-data form: kvedit.edits.spec): per_head carries over, and protect_last when
        set (`protect` overrides it; neither: the budget's default protect)."""
        try:
            spec = to_spec(policy, leave_out=("ratio", "per_head", "protect_last"))
        except ValueError as e:
            raise BudgetError(f"an in-engine budget scores with a kvedit.edits policy by "
                              f"name; {e}") from None
        return cls(tokens, every, spec.name, spec.args,
                   (policy.protect_last or None) if protect is None else protect, positions,
                   policy.per_head, queries)

    def to_dict(self) -> dict:
        """The budget as plain data (what a request carries; `from_dict` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw) -> EngineBudget:
        """The budget `raw` describes; BudgetError naming the field and what was expected."""
        if not isinstance(raw, dict):
            raise BudgetError(f"the budget is {raw!r}; expected an object with fields "
                              f"{list(FIELDS)} (tokens required)")
        unknown = sorted(set(raw) - set(FIELDS))
        if unknown or "tokens" not in raw:
            raise BudgetError(f"unknown fields {unknown}, or no 'tokens'; expected fields "
                              f"{list(FIELDS)} (tokens required)")
        return cls(**raw)

    def policy_object(self):
        """The DropPolicy this budget scores with (a new object)."""
        spec = PolicySpec(self.policy, {"granularity": "token", **self.args})
        try:
            return from_spec(spec, per_head=self.per_head, protect_last=self.protect)
        except (TypeError, ValueError) as e:
            raise BudgetError(f"EngineBudget.args {self.args!r} for policy {self.policy!r}: "
                              f"{e}") from None

    def _check(self) -> None:
        def bad(name: str, expected: str):
            return BudgetError(f"EngineBudget.{name} is {getattr(self, name)!r}; expected "
                               f"{expected}")

        for name in ("tokens", "every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise bad(name, "a positive integer number of tokens")
        if self.protect is None:  # frozen: set once, so both sides of the wire see a number
            q = self.queries if isinstance(self.queries, int) else 0
            if _ranks_at_prefill(self.policy):
                q = 0  # its window is the prompt's tail, kept as part of the prompt
            object.__setattr__(self, "protect", max(0, min(max(self.every, q), self.keep)))
        if isinstance(self.protect, bool) or not isinstance(self.protect, int) \
                or self.protect < 0:
            raise bad("protect", "an integer number of recent tokens >= 0")
        if self.keep < max(1, self.protect):
            raise BudgetError(f"EngineBudget: tokens {self.tokens} - every {self.every} leaves "
                              f"{self.keep} tokens per compaction; it must keep at least 1 and "
                              f"the {self.protect} protected ones (raise tokens or lower every)")
        if self.positions not in get_args(Positions):
            raise bad("positions", f"one of {list(get_args(Positions))}")
        if not isinstance(self.per_head, bool):
            raise bad("per_head", "true or false")
        if not isinstance(self.args, dict) or "ratio" in self.args \
                or {"per_head", "protect_last"} & set(self.args):
            raise bad("args", "a dict of the policy's fields other than ratio, per_head and "
                              "protect_last (set per compaction or by the budget's own fields)")
        if self.policy not in POLICIES:
            raise bad("policy", f"one of {sorted(POLICIES)}")
        q = self.queries
        if isinstance(q, bool) or not isinstance(q, int) or not 0 <= q <= MAX_QUERIES:
            raise bad("queries", f"a number of recent tokens in [0, {MAX_QUERIES}]")
        pol = self.policy_object()
        if pol.needs_queries and not q:
            raise BudgetError(f"EngineBudget.policy {self.policy!r} scores with captured "
                              "queries: set queries to the number of recent tokens whose "
                              "queries it scores with (e.g. 32), and protect to at least that")
        if q and not pol.needs_queries:
            raise bad("queries", f"0 for policy {self.policy!r}, which scores without queries")
        if q > self.protect and not pol.queries_at_prefill:
            raise BudgetError(f"EngineBudget: protect {self.protect} must be >= queries {q} (the "
                              "tokens whose queries score the others stay resident)")
        if self.positions == "logical" and self.policy == "leverage":
            raise BudgetError(f"EngineBudget: policy 'leverage' un-rotates keys assuming token "
                              "i sits at position i, which only positions 'compact' keeps true")
