"""`kvedit demo` end to end on the real SmolLM2 (the session's vLLM on it), small sizes."""
from __future__ import annotations

import json

import pytest

from kvedit.cli import main


@pytest.mark.parametrize("policy,name", [("keydiff", "KeyDiff"), ("snapkv", "SnapKV")])
def test_demo_prints_throughput_and_accuracy_and_writes_both_charts(
        kv_server, smollm2_vllm, smollm2_model, tmp_path, capsys, policy, name):
    """KeyDiff is query-free; SnapKV (the default) makes the prefill capture the question's
    queries in the connector and scores with them."""
    rc = main(["demo", "--server-url", kv_server.url, "--server-http-url", kv_server.http_url,
               "--vllm-url", smollm2_vllm.base_url, "--served-model-name", smollm2_vllm.model,
               "--model", str(smollm2_model), "--tasks", "passkey", "--policy", policy,
               "--num-prompts", "2", "--prompt-len", "512", "--max-tokens", "8",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    for row in ("prefill throughput", "modify (s)", "decode prompt tokens",
                "decode throughput", "end to end", "answers right (hidden facts)"):
        assert row in out
    result = json.loads((tmp_path / "results.json").read_text())
    s = result["summary"]
    assert s["policy"] == name and s["num_prompts"] == 2
    # SnapKV has a `sink`: it keeps the prompts' header (template + instruction), as in eval.
    from kvedit.harness.eval.tasks import INSTRUCTION
    from kvedit.harness.eval.tokenizer import load

    header = len(load(smollm2_model).header(INSTRUCTION))
    assert s["sink"] == (header if policy == "snapkv" else None)
    # 512 context tokens = 2 chunks of 256; a token-granularity policy at 0.5 keeps 256.
    # The question (after the context) and the prefill token are re-sent in both arms.
    base, drop = s["decode_prompt_tokens"]["baseline"], s["decode_prompt_tokens"]["dropped"]
    assert base - drop == 2 * 256
    assert result["dropped"]["modify"]["tokens_after"] == 2 * 256
    # Answers are scored from the real model's output: the pass key at 512 tokens is easy for
    # SmolLM2 unedited (10/10 in our measurements), so at least one baseline answer is right.
    answers = result["answers"]
    assert [len(answers["baseline"]), len(answers["dropped"])] == [2, 2]
    assert s["accuracy"]["baseline"]["correct"] >= 1
    for row in answers["baseline"]:
        assert row["ok"] == (row["expected"][0] in row["answer"])
    for name in ("decode_throughput.png", "accuracy.png"):
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_demo_rejects_bad_flags(tmp_path):
    with pytest.raises(SystemExit, match="policy"):
        main(["demo", "--policy", "nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="tasks"):
        main(["demo", "--tasks", "nope", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="num_prompts"):
        main(["demo", "--num-prompts", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="needs the kvedit server"):
        main(["demo", "--vllm-url", "http://127.0.0.1:1", "--out", str(tmp_path)])
