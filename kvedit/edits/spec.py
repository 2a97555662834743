"""Policies by name: the registry (`POLICIES`) and a policy's plain-data form.

Why a module of its own: a policy object must cross a wire (an in-engine budget carries the
policy its worker scores with, kvedit.engine_budget) and commands name policies on the command line;
both need a policy's name and its settings as plain data, and only the edits room knows its
own classes. `to_spec(policy)` gives its registry name and the fields it was given (the
defaults left out, `granularity` always); `from_spec(spec)` builds the object back. So no
other room names a policy family.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvedit.edits.anchored import PromptAnchored
from kvedit.edits.base import DropPolicy
from kvedit.edits.expected_attention import ExpectedAttention
from kvedit.edits.kvzip import KVzip
from kvedit.edits.policies import (
    DropMiddle,
    KeyDiff,
    KeyNorm,
    LeverageScore,
    RandomDrop,
    SnapKVProxy,
    StreamingLLM,
    UniformDrop,
)
from kvedit.edits.query_policies import TOVA, SnapKV

POLICIES: dict[str, type[DropPolicy]] = {
    "drop_middle": DropMiddle, "uniform": UniformDrop, "streaming_llm": StreamingLLM,
    "key_norm": KeyNorm, "snapkv_proxy": SnapKVProxy, "keydiff": KeyDiff,
    "leverage": LeverageScore, "random": RandomDrop, "snapkv": SnapKV, "tova": TOVA,
    "kvzip": KVzip, "expected_attention": ExpectedAttention, "prompt_anchored": PromptAnchored,
}


@dataclass(frozen=True)
class PolicySpec:
    """A policy as plain data: its POLICIES name and the dataclass fields it was given."""
    name: str
    args: dict[str, Any] = field(default_factory=dict)


def to_spec(policy, leave_out: tuple[str, ...] = ()) -> PolicySpec:
    """`policy`'s name and the fields that differ from its class's defaults (`granularity`
    always, so the receiver need not know the default); `leave_out` names fields the caller
    carries itself. ValueError when the policy is no POLICIES class."""
    names = [n for n, cls in POLICIES.items() if type(policy) is cls]
    if not names:
        raise ValueError(f"{type(policy).__name__} is not one of the kvedit.edits policies "
                         f"{sorted(c.__name__ for c in POLICIES.values())}")
    args = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)
            if f.name not in leave_out
            and (getattr(policy, f.name) != f.default or f.name == "granularity")}
    return PolicySpec(names[0], args)


def from_spec(spec: PolicySpec, **fields: Any) -> DropPolicy:
    """A new policy object from `spec` (`fields` set over its args). KeyError for an
    unknown name; TypeError or ValueError for fields the policy does not take or refuses."""
    return POLICIES[spec.name](**{**spec.args, **fields})
