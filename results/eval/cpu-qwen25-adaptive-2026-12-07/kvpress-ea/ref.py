"""kvpress's presses on the eval's own prompts (Qwen2.5-1.5B, CPU float32, one worker):
does ExpectedAttentionPress keep the answers where kvedit's ExpectedAttention per head
(0/24 at 0.75, results/eval/cpu-qwen25-adaptive-2026-12-07) does not?"""
import sys, json, time
from pathlib import Path
from types import SimpleNamespace
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from kvedit.harness.eval import tasks, tokenizer
from kvedit.harness.eval.reference import run_reference
from kvedit.harness.eval.policyspec import header_sink

model = Path.home() / ".cache/kvedit/qwen2.5-coder-1.5b-instruct-v1"
tok = tokenizer.load(model)
samples = tasks.suite(tok, ["multikey", "multivalue"], [2048], 2, seed=0)
sink = header_sink(samples, True)
cfg = SimpleNamespace(reference_ratios=None, ratios=[0.75], reference_site=None,
                      policies=["expected_attention:per_head=on", "keydiff:per_head=on"])
t = time.time()
res, recs = run_reference(cfg, model, samples, tok, sink, workers=1)
print(json.dumps(res, indent=1)[:3000])
for r in recs:
    print(r["policy"], r["press"], r["task"], r["index"], r["ok"], r["answer"], repr(r["output"][:60]))
print("sink", sink, "seconds", round(time.time() - t))
