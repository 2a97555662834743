"""`kvedit bench long --engine-policies` without an engine: each entry becomes the policy
object and query ring its arm runs with, a bad entry is refused before anything starts with
a message naming it and what was expected, and the extra arms join `kv_limit_blocks` and the
comparison with plain vLLM under `in_engine:<entry>`."""
from __future__ import annotations

import argparse

import pytest

from kvedit.bench.long import figures, run, speed
from kvedit.bench.long.cli import parse
from kvedit.bench.long.policies import DEFAULT_QUERIES, budget_list, entries
from kvedit.edits import TOVA, KeyNorm, PromptAnchored, RandomDrop, SnapKV


def _args(*argv: str) -> argparse.Namespace:
    return parse(list(argv))


def test_entries_become_policies_with_head_and_query_ring():
    got = entries(_args("--in-engine", "--engine-policies",
                        "keynorm:head, snapkv,tova,random:head,SnapKV:head"))
    assert [(e.name, type(e.policy), e.policy.per_head, e.queries) for e in got] == [
        ("keynorm:head", KeyNorm, True, 0), ("snapkv", SnapKV, False, DEFAULT_QUERIES),
        ("tova", TOVA, False, 1),  # TOVA's own window: the last query
        ("random:head", RandomDrop, True, 0), ("SnapKV:head", SnapKV, True, DEFAULT_QUERIES)]
    # PromptAnchored ranks the prompt by its last 64 rows once: no ring, no protect needed
    a = entries(_args("--in-engine", "--budget", "96", "--every", "32", "--engine-policies",
                      "anchored"))
    assert (type(a[0].policy), a[0].queries) == (PromptAnchored, 64)
    w = entries(_args("--in-engine", "--engine-policies", "snapkv", "--engine-queries", "64"))
    assert w[0].queries == 64
    assert entries(_args("--in-engine")) == []


@pytest.mark.parametrize("argv,message", [
    (("--engine-policies", "snapkv"), r"needs --in-engine"),
    (("--in-engine", "--accuracy-only", "--engine-policies", "keynorm"), r"--accuracy-only"),
    (("--in-engine", "--engine-policies", "keynorm,h2o"),
     r"entry 'h2o': unknown policy 'h2o'; expected one of \[.*'key_norm'"),
    (("--in-engine", "--engine-policies", "keynorm:heads"),
     r"entry 'keynorm:heads': unknown suffix 'heads'; expected NAME or NAME:head"),
    (("--in-engine", "--engine-policies", "streaming:head"),
     r"entry 'streaming:head': StreamingLLM scores by position alone .* use 'streaming'"),
    (("--in-engine", "--engine-policies", "kvzip"), r"entry 'kvzip': KVzip .*reconstruction"),
    (("--in-engine", "--engine-policies", "keynorm,,snapkv"), r"an empty entry"),
    (("--in-engine", "--engine-policies", "snapkv,snapkv"), r"\['snapkv'\] given twice"),
    (("--in-engine", "--engine-policies", "keynorm", "--engine-queries", "8"),
     r"none of --engine-policies \['keynorm'\] scores with queries"),
    (("--in-engine", "--engine-queries", "8"), r"no --engine-policies given"),
    (("--in-engine", "--engine-policies", "snapkv", "--engine-queries", "0"),
     r"--engine-queries 0: expected .* \[1, 4096\]"),
    (("--in-engine", "--engine-policies", "snapkv", "--engine-queries", "700"),
     r"entry 'snapkv': its query ring of 700 .* 768 - --every 128 = 640; lower "
     r"--engine-queries"),
    (("--in-engine", "--positions", "logical", "--engine-policies", "leverage"),
     r"entry 'leverage' .*only positions 'compact'"),
])
def test_bad_entries_are_refused_up_front(argv, message):
    with pytest.raises(SystemExit, match=message):
        entries(_args(*argv))


def test_main_refuses_before_starting_anything(monkeypatch):
    monkeypatch.setattr(speed, "run", lambda *a: pytest.fail("an engine was started"))
    with pytest.raises(SystemExit, match="entry 'nope'"):
        run.main(_args("--in-engine", "--engine-policies", "nope"), print)
    with pytest.raises(SystemExit, match=r"--budgets \[64\]: each budget must exceed"):
        run.main(_args("--in-engine", "--every", "64", "--budgets", "1024,64"), print)
    with pytest.raises(SystemExit, match="needs --in-engine"):
        run.main(_args("--budgets", "1024"), print)
    with pytest.raises(SystemExit, match=r"unknown kv_connector_extra_config keys \['async_stor'\]"):
        run.main(_args("--connector-setting", "async_stor=false"), print)
    with pytest.raises(SystemExit, match=r"store 'bogus'; expected one of"):
        run.main(_args("--connector-setting", "store=bogus"), print)
    with pytest.raises(SystemExit, match=r"'x': expected KEY=VALUE"):
        run.main(_args("--connector-setting", "x"), print)


def test_connector_settings_are_read_as_json_where_they_parse():
    args = _args("--connector-setting", "async_store=false", "--connector-setting",
                 "store_wait_s=2.5", "--connector-setting", "store=eager")
    assert speed.connector_settings(args) == {"async_store": False, "store_wait_s": 2.5,
                                              "store": "eager"}
    assert speed.connector_settings(_args()) == {}


def test_budgets_put_the_runs_budget_first_once():
    assert budget_list(_args("--in-engine", "--budget", "1024", "--budgets",
                             "1536,1024,2048,1536")) == [1024, 1536, 2048]
    assert budget_list(_args("--budget", "512")) == [512]


def test_presets_fill_what_was_not_given():
    a = _args("--preset", "real-cpu", "--streams", "8")
    assert (a.streams, a.model, a.pool, a.kv_blocks, a.policy, a.host_arm) == (
        8, "qwen2.5-coder-1.5b", 0.4, None, "anchored", False)
    b = _args()
    assert (b.kv_blocks, b.pool, b.streams, b.host_arm) == (36, None, 8, True)
    assert _args("--no-host-arm").matched_arm is False


def test_extra_arms_join_the_block_limits_and_the_vllm_full_comparison():
    def arm(tput, step):
        return {"decode_tput": tput, "tokens_per_step": step, "mean_footprint_blocks": 4.0,
                "mean_footprint_tokens": 512.0, "preemptions": 2.0}

    out = {"none": arm(10.0, 2.0), "host": arm(12.0, 2.0), "in_engine": arm(15.0, 3.0),
           "in_engine_policies": {"snapkv:head": arm(20.0, 4.0)},
           "in_engine_budgets": {"1024": arm(16.0, 3.5)}, "vllm_full": arm(5.0, 1.0)}
    limits = figures.block_limits(out, 8, 12)
    assert list(limits) == ["vllm_full", "none", "host", "in_engine", "in_engine:snapkv:head",
                            "in_engine@1024"]
    assert limits["in_engine:snapkv:head"] == {"mean_blocks": 4.0, "limit": 3.0,
                                               "tokens_per_step": 4.0,
                                               "efficiency": 4.0 / 3.0}
    figures.vs_full(out)
    r = out["in_engine_policies"]["snapkv:head"]
    assert (r["vs_vllm_full_decode_throughput"], r["vs_vllm_full_step_gain"]) == (4.0, 4.0)
    assert out["in_engine"]["vs_vllm_full_decode_throughput"] == 3.0
    assert out["in_engine_budgets"]["1024"]["vs_vllm_full_step_gain"] == 3.5
    rows = figures.frontier(out, {"in_engine": {"count": {"correct": 3, "n": 4}}})
    assert [r["arm"] for r in rows][-1] == "in_engine@1024"
    assert rows[3]["answers"] == {"count": "3/4"}
    assert "in_engine@1024" in figures.table(rows)


def test_no_in_engine_turns_a_preset_s_in_engine_arm_off():
    assert _args("--preset", "real-gpu").in_engine is True
    args = _args("--preset", "real-gpu", "--no-in-engine", "--engine-policies", "")
    assert args.in_engine is False and entries(args) == []
