"""The entries of `kvedit bench long --in-engine --engine-policies LIST` (one more in-engine arm
per entry) and of `--budgets LIST` (the in_engine arm again at each budget), each parsed and
checked here before any engine starts.

Why a module of its own: what an entry may say (a policy, `:head`, the device query ring of a
query-aware policy) is checked without an engine, and long.py only runs the arms it gets.

An entry is NAME or NAME:head, and is its arm's key in the JSON (`in_engine_policies`):
- NAME: a kvedit.edits policy by registry key, short alias or class name (streaming, keynorm,
  snapkv, tova, keydiff, ...; kvedit.harness.vocab.policy_key), built with its defaults as
  --policy is.
- `:head`: one selection per (layer, KV head) (`per_head=True`, which the budget carries
  over). Refused where every head would keep the same tokens: a policy that scores by
  position alone (`reads_kv` False) is asked once on a stand-in of zeros, as the engine's
  worker asks it, and must answer per head (RandomDrop does; StreamingLLM does not).
- A query-aware policy (`needs_queries`: SnapKV, TOVA) scores with the device query ring, the
  queries of the request's last W computed tokens (EngineBudget.queries, docs/in-engine.md):
  W is --engine-queries, else the policy's own `window` (TOVA: 1), else DEFAULT_QUERIES. The
  budget's protect (default max(every, W)) keeps those tokens resident. A policy that scores
  with a reconstruction pass's queries (KVzip) is refused: one request runs no such pass.
Every entry's EngineBudget is built here with the run's budget, every and positions, so what
the engine would refuse (BudgetError) stops the run before it starts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvedit.engine_budget import MAX_QUERIES, BudgetError, EngineBudget
from kvedit.edits import DropPolicy, Units
from kvedit.harness.vocab import policy as make_policy
from kvedit.harness.vocab import policy_key
from kvedit.layout import ModelLayout

DEFAULT_QUERIES = 32  # SnapKV's observation window when the policy sets none


@dataclass(frozen=True)
class EngineEntry:
    name: str            # the entry as given: its arm's JSON key
    policy: DropPolicy
    queries: int         # rows of the device query ring (0: the policy scores without)


def entries(args) -> list[EngineEntry]:
    """The checked entries of args.engine_policies ([] when not given); SystemExit naming the
    entry, what was expected and the fix."""
    text, w = getattr(args, "engine_policies", None), getattr(args, "engine_queries", None)
    if text is not None and not text.strip():
        text = None   # given empty: none (e.g. over a preset's entries)
    if text is None:
        if w is not None:
            raise SystemExit("--engine-queries sets the query ring of --engine-policies' "
                             "query-aware entries (snapkv, tova); no --engine-policies given")
        return []
    if not getattr(args, "in_engine", False) or getattr(args, "accuracy_only", False):
        raise SystemExit("--engine-policies adds in-engine speed arms: it needs --in-engine "
                         "and runs without --accuracy-only")
    if w is not None and not 1 <= w <= MAX_QUERIES:
        raise SystemExit(f"--engine-queries {w}: expected a number of recent tokens in "
                         f"[1, {MAX_QUERIES}]")
    names = [x.strip() for x in text.split(",")]
    if not all(names):
        raise SystemExit(f"--engine-policies {text!r}: an empty entry; expected comma-separated "
                         "NAME or NAME:head, e.g. keynorm:head,snapkv")
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise SystemExit(f"--engine-policies: {dup} given twice; each entry is one arm and "
                         "its JSON key")
    out = [_entry(x, w, args) for x in names]
    if w is not None and not any(e.queries for e in out):
        raise SystemExit(f"--engine-queries {w}: none of --engine-policies {names} scores with "
                         "queries (snapkv, tova do)")
    return out


def budget_list(args) -> list[int]:
    """--budgets as numbers, the run's --budget first ([--budget] when not given); SystemExit
    naming a bad entry."""
    text = getattr(args, "budgets", None)
    if text is None:
        return [args.budget]
    if not getattr(args, "in_engine", False):
        raise SystemExit("--budgets runs the in_engine arm at each budget: it needs --in-engine")
    try:
        got = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--budgets {text!r}: expected comma-separated token counts, e.g. "
                         "1024,1536,2048") from None
    bad = [b for b in got if b <= args.every]
    if bad:
        raise SystemExit(f"--budgets {bad}: each budget must exceed --every {args.every} (a "
                         "compaction keeps budget - every tokens)")
    return [args.budget] + [b for b in dict.fromkeys(got) if b != args.budget]


def main_policy(args) -> DropPolicy:
    """--policy's object (the host and in_engine arms')."""
    return make_policy(policy_key(args.policy))


def queries_of(policy: DropPolicy, w: int | None = None) -> int:
    """The device query ring a policy needs in an in-engine budget: W = `w`, else the
    policy's own window (TOVA: 1), else DEFAULT_QUERIES; 0 for one that scores without."""
    if not policy.needs_queries:
        return 0
    return w or getattr(policy, "window", None) or DEFAULT_QUERIES


def _entry(entry: str, w: int | None, args) -> EngineEntry:
    name, sep, mod = entry.partition(":")
    if sep and mod != "head":
        raise SystemExit(f"--engine-policies entry {entry!r}: unknown suffix {mod!r}; "
                         "expected NAME or NAME:head (one selection per layer and KV head)")
    try:
        policy = make_policy(policy_key(name), per_head=bool(sep))
    except ValueError as e:
        raise SystemExit(f"--engine-policies entry {entry!r}: {e}") from None
    who = type(policy).__name__
    if policy.needs_reconstruction:
        raise SystemExit(f"--engine-policies entry {entry!r}: {who} scores with a "
                         "reconstruction pass's queries, which one in-engine request does not "
                         "run; expected a policy that scores alone or with its own recent "
                         "queries (snapkv, tova)")
    if sep and not _per_head_scores(policy):
        raise SystemExit(f"--engine-policies entry {entry!r}: {who} scores by position alone "
                         f"and keeps the same tokens in every head; use {name!r}, or :head "
                         "with a policy that scores per head (keynorm, keydiff, snapkv, ...)")
    queries = queries_of(policy, w)
    if queries > args.budget - args.every and not policy.queries_at_prefill:
        raise SystemExit(f"--engine-policies entry {entry!r}: its query ring of {queries} "
                         f"tokens stays resident, but a compaction keeps --budget {args.budget} "
                         f"- --every {args.every} = {args.budget - args.every}; lower "
                         "--engine-queries or raise --budget")
    try:
        EngineBudget.from_policy(policy, args.budget, args.every, positions=args.positions,
                                 queries=queries)
    except BudgetError as e:
        raise SystemExit(f"--engine-policies entry {entry!r} (queries {queries}, --budget "
                         f"{args.budget}, --every {args.every}): {e}") from None
    return EngineEntry(entry, policy, queries)


def _per_head_scores(policy: DropPolicy) -> bool:
    """Whether `policy` (per_head=True) may keep other tokens in each (layer, KV head): one
    that reads the KV scores per head; one that scores by position alone is asked."""
    if policy.reads_kv:
        return True
    layout = ModelLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32",
                         chunk_size=16)
    scores = policy.score(torch.zeros(2, 2, 16, 8), Units(size=1, count=16, tokens=16), layout)
    return scores.dim() == 3
