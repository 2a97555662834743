"""The request fields (kvedit.request_params): what the SDK writes into a request's
`kv_transfer_params` is what the connector's scheduler side reads back, field by field and
all together; a field asked wrongly comes back as its reason (naming the field and what was
expected), never as an exception in vLLM's scheduler; the writer merges into what the caller
already had (a dict, vLLM's SamplingParams, a dataclass, any object with the attribute)
without changing it. And the acceptance rule: each field's name is written in exactly one
module of kvedit, this one (a text search, as `git grep -w` finds it).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvedit import request_params as RP
from kvedit.engine_budget import EngineBudget
from kvedit.request_params import RequestAsks, read_asks, with_asks

ROOT = Path(__file__).resolve().parents[2]
BUDGET = EngineBudget(768, 128, "key_norm", {"granularity": "chunk"}, protect=16,
                      positions="logical", per_head=True)


@pytest.mark.parametrize("asks", [
    RequestAsks(), RequestAsks(store_eager=True), RequestAsks(capture=64),
    RequestAsks(budget=BUDGET), RequestAsks(store_eager=True, capture=1, budget=BUDGET),
])
def test_what_is_written_is_what_is_read(asks):
    params = with_asks({"max_tokens": 3, "kv_transfer_params": {"other": 1}}, asks)
    ktp = params["kv_transfer_params"]
    assert ktp["other"] == 1 and params["max_tokens"] == 3
    assert read_asks(ktp) == asks
    assert set(ktp) - {"other"} == {f for f, on in ((RP.STORE_FIELD, asks.store_eager),
                                                    (RP.CAPTURE_FIELD, asks.capture),
                                                    (RP.BUDGET_FIELD, asks.budget)) if on}


def test_bad_fields_are_reasons_not_exceptions():
    asks = read_asks({RP.STORE_FIELD: "later", RP.CAPTURE_FIELD: 5000,
                      RP.BUDGET_FIELD: {"tokens": 256, "colour": 1}})
    assert not asks.store_eager and asks.capture == 0 and asks.budget is None
    assert asks.capture_error == ("kv_transfer_params['kvedit_capture_queries'] is 5000; "
                                  "expected an integer number of prompt tokens in [1, 4096] "
                                  "(0 or absent: no capture)")
    assert re.match(r"kv_transfer_params\['kvedit_budget'\]: unknown fields \['colour'\]",
                    asks.budget_error)
    assert read_asks({RP.BUDGET_FIELD: {"tokens": 256, "policy": "snapkv"}}).budget_error == (
        "kv_transfer_params['kvedit_budget']: EngineBudget.policy 'snapkv' scores with "
        "captured queries: set queries to the number of recent tokens whose queries it scores "
        "with (e.g. 32), and protect to at least that")
    for nothing in (None, [], "x", {}, {"other": 1}, {RP.CAPTURE_FIELD: 0}):
        assert read_asks(nothing) == RequestAsks()


def test_the_writer_keeps_the_callers_params():
    from vllm import SamplingParams

    mine = {"max_tokens": 1, "kv_transfer_params": {"other": 2}}
    out = with_asks(mine, RequestAsks(capture=8))
    assert mine == {"max_tokens": 1, "kv_transfer_params": {"other": 2}}
    assert out["kv_transfer_params"] == {"other": 2, RP.CAPTURE_FIELD: 8}
    assert with_asks(None, RequestAsks(store_eager=True)) == {
        "kv_transfer_params": {RP.STORE_FIELD: "eager"}}
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"other": 2}})
    asked = with_asks(sp, RequestAsks(budget=BUDGET))   # offline LLM: in extra_args
    assert read_asks(asked.extra_args["kv_transfer_params"]).budget == BUDGET
    assert sp.extra_args == {"kv_transfer_params": {"other": 2}}

    @dataclasses.dataclass(frozen=True)
    class Params:
        max_tokens: int = 1
        kv_transfer_params: dict | None = None

    assert with_asks(Params(), RequestAsks(capture=4)).kv_transfer_params == {
        RP.CAPTURE_FIELD: 4}


def test_params_that_cannot_carry_them():
    """Only the store asked: the params go unchanged (the connector's store mode decides);
    capture or a budget asked: TypeError naming what needed it."""
    class Bare:
        __slots__ = ("max_tokens",)

    bare = Bare()
    assert with_asks(bare, RequestAsks(store_eager=True)) is bare
    with pytest.raises(TypeError, match="capture_queries and an in-engine budget needs "
                                        "sampling params that can carry kv_transfer_params"):
        with_asks(bare, RequestAsks(store_eager=True, capture=4, budget=BUDGET))


def test_each_field_name_is_written_in_one_module():
    names = (RP.STORE_FIELD, RP.CAPTURE_FIELD, RP.BUDGET_FIELD)
    found = {n: [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "kvedit").rglob("*.py"))
                 if re.search(rf"\b{n}\b", p.read_text())] for n in names}
    assert found == {n: ["kvedit/request_params.py"] for n in names}
