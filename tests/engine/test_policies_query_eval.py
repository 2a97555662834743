"""`kvedit eval` with query-aware policies through the real path (the session's SmolLM2 vLLM):
the prefill captures each prompt's question (W = the un-editable tail), every query-aware cell
gets the queries through the SDK, and the query objects do not outlive the run."""
from __future__ import annotations

import json

import httpx
import pytest

from kvedit.cli import main
from kvedit.harness.eval.runner import editable, query_window
from kvedit.harness.eval.tasks import suite
from kvedit.harness.eval.tokenizer import load


def test_query_window_is_the_question(smollm2_model):
    tok = load(smollm2_model)
    for s in suite(tok, ["passkey", "multivalue"], [512], 2):
        w = query_window(s, 128)
        assert w == len(s.prompt_ids) - s.length == len(s.prompt_ids) - editable(s, 128)
        tail = tok.decode(s.prompt_ids[-w:])
        assert tail.lstrip().startswith("Question:") and "?" in tail  # the question, whole


def test_eval_runs_query_aware_cells(kv_server, smollm2_vllm, smollm2_model, tmp_path, capsys):
    def query_objects() -> int:
        return httpx.get(kv_server.http_url + "/status", timeout=10).json()["queries"]["objects"]

    before = query_objects()
    rc = main(["eval", "--model", str(smollm2_model), "--server-url", kv_server.url,
               "--server-http-url", kv_server.http_url, "--vllm-url", smollm2_vllm.base_url,
               "--served-model-name", smollm2_vllm.model, "--tasks", "passkey,multikey",
               "--lengths", "512", "--samples", "2", "--policies", "snapkv,tova,key_norm",
               "--ratios", "0.5", "--json", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["ratio"]) for r in out["results"]] == [
        ("SnapKV", 0.5), ("TOVA", 0.5), ("KeyNorm", 0.5)]
    for r in out["results"]:
        assert r["n"] == 4 and r["kept_fraction"] == 0.5
    assert "tail" in out["config"]["query_window"]
    # Every query object the prefill captured was handed to its edits and then deleted.
    assert query_objects() == before
