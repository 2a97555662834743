"""`kvedit eval --reference kvpress` for real: kvpress 0.5.5 in its own environment (made
under the kvedit cache on first use, a few minutes), the eval's prompts through its presses
on SmolLM2 in transformers, answers back as JSON.

Reference for the plumbing: kvpress's uncompressed arm must answer exactly what transformers
greedy decoding of the same token ids answers in kvedit's environment (same model, float32),
and a press must really compress (its answers may differ from the baseline's)."""
from __future__ import annotations

import pytest
import torch

from kvedit.harness.eval.reference import PRESSES, run_reference
from kvedit.harness.eval.run import EvalConfig
from kvedit.harness.eval.tasks import suite
from kvedit.harness.eval.tokenizer import load


def greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_kvpress_arm_answers_the_eval_prompts(smollm2_model):
    """Expected Attention with no KVzip arm: ExpectedAttentionPress reads the RoPE from
    `self_attn.rotary_emb`, which kvpress's hook context sets and the shared prefill did
    not (it failed unless a KVzip arm's context had set it first)."""
    tok = load(smollm2_model)
    samples = suite(tok, ["passkey"], [512], 2, seed=0)
    cfg = EvalConfig(model=str(smollm2_model), policies=["key_norm", "snapkv",
                                                          "expected_attention"], ratios=[0.5])
    summary, records = run_reference(cfg, smollm2_model, samples, tok, samples[0].header,
                                     workers=1)
    assert summary["kvpress"] == "0.5.5"
    assert {(r["policy"], r["press"]) for r in summary["results"]} == {
        ("KeyNorm", "KnormPress"), ("SnapKV", "SnapKVPress"), ("AdaKV", "AdaKVPress"),
        ("ExpectedAttention", "ExpectedAttentionPress")}
    assert summary["baseline"]["n"] == 2 and all(r["n"] == 2 for r in summary["results"])
    base = [r for r in records if r["press"] is None]
    for s in samples:  # kvpress's uncompressed answer is transformers' greedy answer
        want = tok.decode(greedy(smollm2_model, s.prompt_ids, s.max_tokens))
        got = next(r["output"] for r in base if r["index"] == s.index)
        assert got.strip() == want.strip().split("<|im_end|>")[0].strip()
    assert PRESSES["KeyNorm"][0] == "KnormPress"


def test_one_shared_prefill_answers_as_every_press_on_its_own(smollm2_model):
    """The worker's shared path (one prefill for the presses of a sample, their answers
    decoded in batches; kvpress_shared.py) against kvpress's pipeline run press by press,
    on the same prompts: the same answer from every arm."""
    from kvedit.harness.eval import reference as R

    tok = load(smollm2_model)
    samples = suite(tok, ["passkey", "multikey"], [512], 1, seed=0)
    arm_list = R.arms(["key_norm", "keydiff:per_head=on:budget=layer", "snapkv", "tova",
                       "kvzip", "expected_attention"], [0.5, 0.75], samples[0].header)
    assert {a["press"] for a in arm_list} == {None, "KnormPress", "AdaKVPress", "SnapKVPress",
                                              "TOVAPress", "KVzipPress",
                                              "ExpectedAttentionPress"}
    rt = R.runtime(None)

    def answers(alone: bool) -> dict:
        lines = R.run_workers(rt.python, R.job(samples, tok, smollm2_model, arm_list,
                                               alone=alone), 1, env_extra=rt.env)
        return {(x["id"], x["arm"]): x["answers"][0] for x in lines}

    shared, alone = answers(False), answers(True)
    assert len(shared) == len(samples) * len(arm_list)
    assert shared == alone
