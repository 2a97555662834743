"""`kvedit eval`'s reuse-with-repair cell (kvedit.harness.eval.repair_cell) through the real
path: the session's vLLM on SmolLM2, each multi-question context compressed once by a
query-agnostic policy and repaired from its original for each of its questions.

Reference for "repair gives answers back": the same run's reuse cell of the base policy
alone, on the same prompts (StreamingLLM at 0.75 keeps the header and the newest tokens, so
needles at depth 0.1-0.7 are gone from its cache; the repair re-selects from the original).
"""
from __future__ import annotations

import json

from kvedit.cli import main


def test_reuse_with_repair_answers_every_question_from_one_compressed_cache(
        kv_server, smollm2_vllm, smollm2_model, tmp_path, capsys):
    rc = main(["eval", "--model", str(smollm2_model), "--server-url", kv_server.url,
               "--server-http-url", kv_server.http_url, "--vllm-url", smollm2_vllm.base_url,
               "--served-model-name", smollm2_vllm.model, "--tasks", "multikey",
               "--lengths", "512", "--samples", "3", "--no-noop",
               "--policies", "streaming_llm,repair:base=streaming_llm", "--ratios", "0.75",
               "--json", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    base = [r for r in records if r["policy"] == "streaming_llm"]
    fixed = [r for r in records if r["policy"] == "repair:base=streaming_llm"]
    # every question of the 3 contexts (3 each), from one compressed cache of the same size
    assert len(base) == len(fixed) == 9
    assert sorted((r["index"], r["question"]) for r in fixed) == [
        (i, q) for i in range(3) for q in range(3)]
    assert {r["kept_fraction"] for r in fixed} == {r["kept_fraction"] for r in base}
    cell = next(r for r in out["results"] if r["policy"] == "Repair:base=streaming_llm")
    assert cell["repaired"] == 9 and cell["repair_skipped"] == 0
    assert cell["repair_s"] > 0 and cell["repair_capture_s"] > 0
    reuse = {r["policy"]: r for r in out["reuse"]["results"]}
    assert reuse["Repair:base=streaming_llm"]["query_aware"] is True
    assert reuse["Repair:base=streaming_llm"]["n"] == 9
    # the repaired caches answer more questions than the compressed one they came from
    assert sum(r["ok"] for r in fixed) > sum(r["ok"] for r in base)
