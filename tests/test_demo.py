"""`kvedit demo` end to end, small sizes, on the session's kvedit server and vLLM."""
from __future__ import annotations

import json

import pytest

from kvedit.cli import main


@pytest.mark.vllm
def test_demo_writes_table_json_and_png(kv_server, vllm_server, tmp_path, capsys):
    rc = main(["demo", "--server-url", kv_server.url, "--server-http-url", kv_server.http_url,
               "--vllm-url", vllm_server.base_url, "--served-model-name", vllm_server.model,
               "--num-prompts", "2", "--prompt-len", "1024", "--max-tokens", "8",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    for row in ("prefill throughput", "modify (s)", "decode prompt tokens",
                "decode throughput", "end to end"):
        assert row in out
    result = json.loads((tmp_path / "results.json").read_text())
    s = result["summary"]
    assert s["policy"] == "DropMiddle" and s["num_prompts"] == 2
    # 4 chunks, drop 2: the decode prompts are half as long (+1 prefill token each).
    assert s["decode_prompt_tokens"] == {"baseline": 2 * 1025, "dropped": 2 * 513}
    assert s["decode_tput"]["baseline"] > 0 and s["decode_tput"]["dropped"] > 0
    assert result["dropped"]["modify"]["tokens_after"] == 2 * 512
    png = (tmp_path / "decode_throughput.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_demo_rejects_bad_flags(tmp_path):
    with pytest.raises(SystemExit, match="policy"):
        main(["demo", "--policy", "nope", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="num_prompts"):
        main(["demo", "--num-prompts", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="needs the kvedit server"):
        main(["demo", "--vllm-url", "http://127.0.0.1:1", "--out", str(tmp_path)])
