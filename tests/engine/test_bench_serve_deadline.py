"""`kvedit bench serve --deadline-s --out` on a real vLLM (the tiny model, one small arm): a run
that would end past the deadline is not started, and the JSON of the runs done is written to
--out as well as printed (what a machine that lends a command a fixed time leaves behind)."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_deadline_stops_after_the_first_run_and_out_holds_the_result(tiny_model, tmp_path):
    out = tmp_path / "serve.json"
    cmd = [sys.executable, "-m", "kvedit.cli", "bench", "serve", "--arms", "vllm",
           "--model", str(tiny_model), "--docs", "1", "--doc-tokens", "512",
           "--question-tokens", "16", "--answer-tokens", "2", "--users", "1", "--rounds", "1",
           "--system-tokens", "256", "--user-tokens", "64", "--random-prompts", "1",
           "--random-tokens", "256", "--repeats", "3", "--deadline-s", "0",
           "--out", str(out), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "stopping after 1 of 3 runs" in p.stderr, p.stderr[-3000:]
    printed = json.loads(p.stdout)
    assert printed["repeats"] == 1 and len(printed["runs"]["vllm"]) == 1
    assert json.loads(out.read_text()) == printed
    assert not (tmp_path / "serve.json.tmp").exists()
    assert printed["arms"]["vllm"]["query_ttft_s"] > 0
