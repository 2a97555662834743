"""`kvedit eval` with the policies that score with the context's own queries (Expected
Attention; a head-adaptive budget's null keys) through the real path on SmolLM2: one context
pass per sample after the prefill, its queries shared by every such cell, the cells of a
group run together (`--cells-at-once`), and the slots a head-adaptive edit really keeps
reported as its kept fraction (more than the nominal ratio leaves: its largest head's)."""
from __future__ import annotations

import json

from kvedit.cli import main


def test_context_policies_run_through_the_eval(kv_server, smollm2_vllm, smollm2_model,
                                               tmp_path, capsys):
    rc = main(["eval", "--model", str(smollm2_model), "--server-url", kv_server.url,
               "--server-http-url", kv_server.http_url, "--vllm-url", smollm2_vllm.base_url,
               "--served-model-name", smollm2_vllm.model, "--tasks", "passkey",
               "--lengths", "512", "--samples", "2", "--policies",
               "expected_attention:per_head=on,keydiff:per_head=on:budget=layer,keydiff:"
               "per_head=on", "--ratios", "0.75", "--cells-at-once", "2", "--no-noop",
               "--no-reuse", "--json", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["cells_at_once"] == 2
    info = out["timings"]["baseline"]
    assert info["context_pass_s"] > 0 and info["context_pass_tokens"] > 0
    rows = {r["policy"]: r for r in out["results"]}
    assert set(rows) == {"ExpectedAttention:per_head=True", "KeyDiff:per_head=True",
                         "KeyDiff:per_head=True:budget=layer"}
    for r in rows.values():
        assert r["n"] == 2 and r["ci"][0] <= r["accuracy"] <= r["ci"][1]
    # 512 tokens at 0.75: 128 kept per head with equal counts; the adaptive heads share
    # 2 x 128 per layer and the largest needs more slots
    assert rows["KeyDiff:per_head=True"]["kept_fraction"] == 0.25
    assert rows["ExpectedAttention:per_head=True"]["kept_fraction"] == 0.25
    assert 0.25 < rows["KeyDiff:per_head=True:budget=layer"]["kept_fraction"] <= 1.0
    records = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4   # baseline + 3 cells, 2 samples each
