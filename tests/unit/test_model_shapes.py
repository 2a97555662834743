"""`kvedit tiny-model --shape qwen3-8b DIR`: Qwen3-8B's layers and widths (36 layers x 8 KV heads
x 128, 144 KiB of bf16 KV per token; its published 8.19 B parameters less the embedding and
head rows of the vocabulary it does not have: 7.01 B) with the tiny tokenizer and no weight
files, through the real command; an unknown shape is refused by name."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _kvedit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from kvedit.cli import main; "
                           "sys.exit(main())", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.mark.slow  # the command in a fresh interpreter, then transformers builds a 36-layer meta model
def test_qwen3_8b_shape_has_its_parameter_count_and_kv_size(tmp_path):
    from transformers import AutoConfig, Qwen3ForCausalLM

    from kvedit.bench.serve.workloads import kv_bytes_per_token

    r = _kvedit("tiny-model", "--shape", "qwen3-8b", str(tmp_path / "q8b"))
    assert r.returncode == 0, r.stderr
    out = Path(r.stdout.strip())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    cfg = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen3ForCausalLM(cfg).parameters())
    qwen3_8b = 8_190_735_360                       # with its 151,936-token vocabulary
    assert n == qwen3_8b - 2 * (151936 - 8192) * 4096
    assert kv_bytes_per_token(out, "bfloat16") == (2 * 36 * 8 * 128 * 2, 8192)
    assert json.loads((out / "config.json").read_text())["architectures"] == \
        ["Qwen3ForCausalLM"]


def test_unknown_shape_is_refused_by_name(tmp_path):
    r = _kvedit("tiny-model", "--shape", "llama-70b", str(tmp_path / "x"))
    assert r.returncode == 2 and "invalid choice: 'llama-70b'" in r.stderr
    assert "qwen3-8b" in r.stderr
