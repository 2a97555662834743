"""A policy's plain-data form (kvedit.edits.spec) and its budget fit (`DropPolicy.keeping`).

Every registered policy, given non-default fields, comes back from its spec equal to itself
(so an in-engine budget's worker scores with the very policy the user built); an object that
is no registered policy is refused by name. `keeping(n)` drops just enough units to leave at
most n tokens (and nothing when kv is short enough), and the SDK fits exactly the edits that
declare it (`Fits`), leaving any other fn as it is.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvedit.engine_budget import EngineBudget
from kvedit.edits import POLICIES, KeyNorm, RandomDrop, StreamingLLM, from_spec, to_spec
from kvedit.edits.spec import PolicySpec
from kvedit.sdk.contracts import Fits, fitted


def _given(cls):
    """An instance of `cls` with every field it has changed from its default where a value
    of the same kind is easy to make and the policy accepts it."""
    kw = {}
    for f in dataclasses.fields(cls):
        d = f.default
        if f.name in ("ratio", "per_head", "protect_last", "positions"):
            continue
        value = (not d if isinstance(d, bool) else d + 2 if isinstance(d, int)
                 else d * 2 + 1e-3 if isinstance(d, float) else None)
        try:
            if value is not None:
                cls(**kw, **{f.name: value})
                kw[f.name] = value
        except ValueError:   # a value this policy refuses (its own checks)
            pass
    assert kw, f"{cls.__name__}: no field could be changed"
    return cls(**kw)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_round_trips_through_its_spec(name):
    policy = _given(POLICIES[name])
    spec = to_spec(policy)
    assert spec.name == name and spec.args["granularity"] == policy.granularity
    assert from_spec(spec) == policy
    assert from_spec(PolicySpec(name, {})) == POLICIES[name]()    # defaults are left out
    assert "ratio" not in to_spec(policy, leave_out=("ratio",)).args


def test_a_foreign_object_is_refused_by_name():
    class Mine(KeyNorm):
        pass

    for other in (object(), Mine()):
        with pytest.raises(ValueError, match="is not one of the kvedit.edits policies"):
            to_spec(other)
    with pytest.raises(KeyError):
        from_spec(PolicySpec("nope"))
    budget = EngineBudget.from_policy(StreamingLLM(sink=8, window=128), 768, 128)
    assert isinstance(budget.policy_object(), StreamingLLM)
    assert (budget.policy_object().sink, budget.policy_object().window) == (8, 128)


def test_keeping_drops_just_enough_and_the_sdk_fits_what_declares_it():
    kv, tokens = torch.randn(2, 2, 1000, 8), list(range(1000))
    fit = RandomDrop(granularity="token", rerotate=False).keeping(600)
    out, kept = fit(kv, tokens)
    assert out.shape[2] == len(kept) == 600
    assert fit(kv[:, :, :500], tokens[:500])[0].shape[2] == 500   # short enough: unchanged
    chunks = RandomDrop(granularity="chunk", chunk_size=128, rerotate=False).keeping(600)
    # whole units: 4 of the 8 (the last is a partial one of 104 tokens)
    assert chunks(kv, tokens)[0].shape[2] in (4 * 128, 3 * 128 + 104)
    with pytest.raises(ValueError, match="less than one chunk of 128"):
        RandomDrop(chunk_size=128, rerotate=False).keeping(100)(kv, tokens)

    def plain(kv, tokens):
        return kv, tokens

    assert isinstance(KeyNorm(), Fits) and not isinstance(plain, Fits)
    assert fitted(plain, 10) is plain
    assert fitted(RandomDrop(granularity="token", rerotate=False), 10)(kv, tokens)[0].shape[2] \
        == 10
