"""`kvedit bench long` sizes itself before anything starts: the working set, the pool as a
share of it, the server's L1 from what the arms store, and a refusal naming the size needed
when an option cannot fit (issue 42: a run that failed 160 s in on a GPU, its default 1 GB
L1 holding a quarter of what the arms store). No engine here: the refusals must come first,
so they are checked with the command itself (a subprocess) and a deadline."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvedit.bench.long import run, sizing
from kvedit.bench.long.cli import parse
from kvedit.bench.long.prompts import make

BIG = ["--streams", "64", "--prompt-len", "2048", "--max-tokens", "2048"]


def test_the_l1_is_sized_from_what_the_no_budget_arm_stores():
    args = parse([*BIG, "--pool", "0.4"])
    plan = sizing.plan(args, make(args))
    bs = plan.block_size
    per_stream = -(-(2048 + 2048 + 1) // bs)
    assert plan.working_set_blocks == 64 * per_stream
    assert plan.kv_blocks == -(-int(0.4 * 64 * per_stream * 1000) // 1000)
    assert 0.39 < plan.pool_share < 0.41
    # tiny model, bf16: 4 layers x 2 KV heads x 64 x 2 (K, V) x 2 bytes
    assert plan.kv_bytes_per_token == 2048
    stored = 64 * 4224 * 2048   # every stream's chunks of 128, prompt and output
    assert plan.l1_need_gb == pytest.approx(1.25 * stored / 2**30, rel=1e-3)
    assert plan.l1_size_gb >= plan.l1_need_gb and plan.l1_size_gb % 0.25 == 0
    assert plan.arms == ["vllm_full", "vllm_two_phase", "none", "connector_one_phase", "host"]
    assert plan.estimate_s > 0


def test_the_arms_follow_the_options():
    args = parse(["--in-engine", "--no-vllm-full", "--no-host-arm", "--engine-policies",
                  "keynorm,snapkv:head", "--budgets", "1024,768", "--budget", "768"])
    assert sizing.arm_names(args) == ["none", "in_engine", "in_engine:keynorm",
                                      "in_engine:snapkv:head", "in_engine@1024"]


@pytest.mark.parametrize("argv,message", [
    ([*BIG, "--l1-size-gb", "0.1"], r"--l1-size-gb 0\.1: the no-budget arm stores .* pass "
                                    r"--l1-size-gb 0\.6[0-9] or more"),
    (["--kv-blocks", "2", "--prompt-len", "256", "--max-tokens", "512"],
     r"a KV pool of 2 blocks .* cannot hold one stream of 256\+512\+1"),
    (["--pool", "0"], r"--pool 0\.0: expected a share"),
    (["--model", "/nonexistent"], r"--model /nonexistent: not a built model name"),
])
def test_a_run_that_cannot_fit_is_refused_in_seconds(argv, message):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "kvedit.cli", "bench", "long", "--json", *argv],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and p.stdout == ""
    import re
    assert re.search(message, p.stderr), p.stderr
    assert time.monotonic() - t0 < 30   # seconds, not an engine start (a loaded CI box)


def test_dry_run_prints_the_plan_and_starts_nothing(monkeypatch):
    from kvedit.bench.long import speed

    monkeypatch.setattr(speed, "run", lambda *a: pytest.fail("an engine was started"))
    out = run.main(parse([*BIG, "--pool", "1.0", "--dry-run"]), print)
    assert out["dry_run"] is True
    s = out["sizing"]
    assert s["pool_share"] == pytest.approx(1.0, abs=0.01) and s["l1_size_gb"] >= 0.6
    json.dumps(out)
