"""`kvedit eval` end to end through the real path on a few samples: the session's vLLM on
SmolLM2 prefills, the SDK modifies with each policy, vLLM decodes; plus the decode-gain arms'
plumbing on the same vLLM (the KV-bound gain itself is what the default
suite measures and reports, never asserted: timings are noisy)."""
from __future__ import annotations

import json
import re

import pytest

from kvedit.cli import main
from kvedit.harness.eval.gain import GainConfig


def test_eval_end_to_end_json_table_charts(kv_server, smollm2_vllm, smollm2_model, tmp_path,
                                           capsys):
    rc = main(["eval", "--model", str(smollm2_model), "--server-url", kv_server.url,
               "--server-http-url", kv_server.http_url, "--vllm-url", smollm2_vllm.base_url,
               "--served-model-name", smollm2_vllm.model, "--tasks", "passkey,vartrack",
               "--lengths", "512", "--samples", "1", "--seeds", "0,1",
               "--policies", "KeyDiff,streaming_llm", "--ratios", "0.5", "--json",
               "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out == json.loads((tmp_path / "results.json").read_text())
    base = out["baseline"]
    assert base["n"] == 4 and 0 <= base["accuracy"] <= 1
    lo, hi = base["ci"]
    assert lo <= base["accuracy"] <= hi
    assert set(base["by_task"]) == {"passkey", "vartrack"}
    assert base["by_task"]["passkey"]["correct"] >= 1  # real answers from the real model
    assert [(r["policy"], r["ratio"]) for r in out["results"]] == [("KeyDiff", 0.5),
                                                                   ("StreamingLLM", 0.5)]
    for r in out["results"]:
        assert r["n"] == 4 and r["ci"][0] <= r["accuracy"] <= r["ci"][1]
        # 512 context tokens = 2 chunks of the session server's 256: exactly half survives,
        # and at token granularity the kept 256 tokens are one whole stored chunk.
        assert r["kept_fraction"] == 0.5 and r["stored_fraction"] == 0.5
        assert r["decode_gain"] is None  # the gain arms need a vLLM eval starts itself
    assert set(out["acceptance"]) == {
        "pooled_baseline", "best_at_0.5_vs_pooled_baseline", "best_at_0.75_vs_pooled_baseline",
        "best_at_0.5_vs_each_seed_baseline", "reuse_best_query_agnostic_at_0.5"}
    # two seeds in one run: each seed's suite on its own, and pooled
    assert [s["seed"] for s in out["seeds"]] == [0, 1]
    assert [s["baseline"]["n"] for s in out["seeds"]] == [2, 2]
    assert out["pooled"]["baseline"]["correct"] == sum(s["baseline"]["correct"]
                                                       for s in out["seeds"])
    for r in out["pooled"]["results"]:
        per_seed = [x for s in out["seeds"] for x in s["results"]
                    if (x["policy"], x["ratio"]) == (r["policy"], r["ratio"])]
        assert r["correct"] == sum(x["correct"] for x in per_seed) and r["n"] == 4
    # reuse: the vartrack contexts' two questions, each edited once
    reuse = out["reuse"]
    assert reuse["baseline"]["n"] == 2 * 2
    assert {(r["policy"], r["query_aware"]) for r in reuse["results"]} == {
        ("KeyDiff", False), ("StreamingLLM", False)}
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    # (baseline + the no-op edit + its control + 2 policies) x 4 mains + (baseline + 2
    # policies) x 2 further questions (the no-op and its control: main answers only)
    assert len(records) == 5 * 4 + 2 * 3
    assert out["partial"] is False and out["progress"]["groups_done"] == 1
    assert out["progress"]["stopped_by_deadline"] is None
    noop = [r for r in records if r["policy"] == "noop" and r["question"] == 0]
    assert out["noop"]["n"] == 4 and out["noop"]["same"] == sum(r["same_as_baseline"]
                                                                for r in noop)
    # The control decodes the same prompts again with no edit at all: nothing dropped, and
    # its answers judged against the baseline's like the no-op's.
    control = [r for r in records if r["policy"] == "noop_control"]
    assert len(control) == 4 and all(r["kept_fraction"] == 1.0 for r in control)
    assert out["noop"]["control"]["n"] == 4
    assert out["noop"]["control"]["same"] == sum(r["same_as_baseline"] for r in control)
    gated = out["gated"]  # the pairs the full KV answers at >= 0.8 count, the rest beside
    assert {(t["task"], t["length"]) for t in gated["tasks"]} == {("passkey", 512),
                                                                  ("vartrack", 512)}
    assert gated["baseline"]["n"] + gated["not_gated"]["baseline"]["n"] == 4
    assert all(t["gated"] == (t["accuracy"] >= 0.8) for t in gated["tasks"])
    assert [(r["policy"], r["ratio"]) for r in gated["results"]] == [("KeyDiff", 0.5),
                                                                     ("StreamingLLM", 0.5)]
    assert sorted({(r["seed"], r["question"]) for r in records if r["task"] == "vartrack"}) \
        == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rec in records:  # every verdict is the check applied to the stored answer
        numbers = set(re.findall(r"\d+", rec["output"]))
        assert rec["ok"] == all(a in numbers for a in rec["answer"])
    for name in ("accuracy_vs_ratio.png", "accuracy_vs_gain.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_a_killed_eval_leaves_the_figures_of_the_cells_it_finished(kv_server, smollm2_vllm,
                                                                   smollm2_model, tmp_path):
    """results.json is rewritten after every cell: SIGTERM the run once it has one, and what
    is on disk is a whole JSON of what finished, marked partial, with its counts."""
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "kvedit.cli", "eval", "--model", str(smollm2_model),
           "--server-url", kv_server.url, "--server-http-url", kv_server.http_url,
           "--vllm-url", smollm2_vllm.base_url, "--served-model-name", smollm2_vllm.model,
           "--tasks", "passkey", "--lengths", "512", "--samples", "4", "--group-size", "2",
           "--policies", "keydiff,streaming_llm,key_norm,random,uniform", "--ratios",
           "0.25,0.5,0.75", "--no-progress", "--no-reuse", "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    path = tmp_path / "results.json"
    try:
        end = time.monotonic() + 600
        while time.monotonic() < end and proc.poll() is None:
            if path.exists() and json.loads(path.read_text())["results"]:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = json.loads(path.read_text())
    assert out["partial"] is True and out["progress"]["groups"] == 2
    assert out["baseline"]["n"] >= 2 and 1 <= len(out["results"]) < 15
    for r in out["results"]:  # a cell counts the samples of the groups it finished
        assert r["n"] == r["samples"] and r["n"] in (2, 4)
    # every answer so far is on disk beside it, whole lines
    recs = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sum(r["policy"] is None for r in recs) >= out["baseline"]["n"]
    assert sum(r["policy"] not in (None, "noop", "noop_control") for r in recs) >= sum(
        r["n"] for r in out["results"])
    assert not (tmp_path / "results.json.tmp").exists()


def test_an_eval_past_its_deadline_starts_nothing_and_says_so(kv_server, smollm2_vllm,
                                                               smollm2_model, tmp_path,
                                                               capsys):
    rc = main(["eval", "--model", str(smollm2_model), "--server-url", kv_server.url,
               "--server-http-url", kv_server.http_url, "--vllm-url", smollm2_vllm.base_url,
               "--served-model-name", smollm2_vllm.model, "--tasks", "passkey",
               "--lengths", "512", "--samples", "1", "--policies", "keydiff", "--ratios", "0.5",
               "--deadline-s", "0.001", "--json", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["progress"]["groups_done"] == 0 and out["baseline"]["n"] == 0
    assert "group 1/1 not started" in out["progress"]["stopped_by_deadline"]
    assert out["results"] == [] and out["partial"] is False


def test_gain_arms_share_one_prefill_and_keep_what_the_policy_keeps(kv_server, smollm2_vllm):
    from kvedit.edits import DropMiddle
    from kvedit.harness.eval.gain import GainRun
    from kvedit.sdk.context import connect
    from kvedit.sdk.openai import openai_completion

    cfg = GainConfig(num_prompts=2, prompt_len=512, max_tokens=8, kv_blocks=21)
    vp = smollm2_vllm  # the session's one vLLM on SmolLM2 (not KV-bound: plumbing only)
    with connect(kv_server.url, kv_server.http_url, vp.model, timeout=60) as ctx:
        g = GainRun(ctx, openai_completion(vp.base_url, vp.model), vp.base_url, cfg, 128,
                    progress=False)
        g.prefill()
        held = dict(ctx.refs)
        b = g.arm()
        d = g.arm(DropMiddle(0.5, granularity="token"))
        assert b["kept_tokens"] == 512 and d["kept_tokens"] == 256
        assert "modify_s" in d and "modify_s" not in b
        assert b["tokens_per_step"] and d["tokens_per_step"]  # read from vLLM's counters
        assert dict(ctx.refs) == held  # each arm released its own chunks, not the prefill's
        gains = GainRun.gains(d, g.reference())
        assert gains["decode_gain"] > 0 and gains["decode_gain_bound"] == cfg.bound(256, 128)
        g.close()
        assert not ctx.refs


def test_gain_bound_counts_decode_waves():
    cfg = GainConfig()  # 12 x (512 + 32) tokens = 5 blocks each, 12 blocks
    assert cfg.at_once(512 + 32, 128) == 2
    assert [cfg.bound(k, 128) for k in (384, 256, 128)] == [1.5, 2.0, 3.0]
    with pytest.raises(ValueError, match="cannot hold one request"):
        GainConfig(kv_blocks=4).bound(256, 128)


def test_eval_rejects_bad_flags(tmp_path):
    base = ["eval", "--out", str(tmp_path), "--model", "tiny"]
    with pytest.raises(SystemExit, match="--policies: unknown"):
        main([*base, "--policies", "nope"])
    with pytest.raises(SystemExit, match="--tasks: unknown"):
        main([*base, "--tasks", "nope"])
    with pytest.raises(SystemExit, match="multiple of 128"):
        main([*base, "--lengths", "500"])
    with pytest.raises(SystemExit, match="--ratios"):
        main([*base, "--ratios", "1.5"])
    with pytest.raises(SystemExit, match="needs the kvedit server"):
        main([*base, "--vllm-url", "http://127.0.0.1:1"])


def test_the_header_sink_goes_to_every_policy_with_a_sink_and_only_to_those():
    from dataclasses import replace

    from kvedit.edits import POLICIES
    from kvedit.harness.eval.policyspec import header_sink, make_policy, sink_policies
    from kvedit.harness.eval.tasks import Sample

    with_sink = set(sink_policies())
    assert {"streaming_llm", "snapkv", "tova"} <= with_sink
    assert not {"keydiff", "key_norm", "random"} & with_sink
    for name in POLICIES:
        pol = make_policy(name, 0.5, "token", 49)
        assert getattr(pol, "sink", None) == (49 if name in with_sink else None)
        # None = each policy's own default (StreamingLLM 4 attention sinks, SnapKV/TOVA 0)
        assert getattr(make_policy(name, 0.5, "token"), "sink", None) == \
            getattr(POLICIES[name](), "sink", None)
    s = Sample("passkey", 512, 0.5, 0, [1] * 520, ("1",), (60,), ((1,),), 8, header=49)
    assert header_sink([s, s], True) == 49 and header_sink([s], False) is None
    with pytest.raises(ValueError, match="header lengths differ"):
        header_sink([s, replace(s, header=50)], True)
