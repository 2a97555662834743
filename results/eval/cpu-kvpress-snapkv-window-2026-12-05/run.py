"""kvpress SnapKVPress at 4k on the CPU (float32): default window 64 vs the question text."""
import json, sys, time
from pathlib import Path
from kvedit.harness.eval.tokenizer import load
from kvedit.harness.eval.tasks import build
from kvedit.harness.eval import reference as R
md = Path.home() / ".cache/kvedit/qwen2.5-coder-1.5b-instruct-v1"
tok = load(md)
picks = [("multikey", 0.1, 0, 0), ("multikey_confusable", 0.1, 0, 0), ("docqa", 0.1, 0, 0),
         ("passkey", 0.1, 0, 1)]
samples = [build(tok, t, 4096, d, i, seed) for t, d, i, seed in picks]
arms = [{"press": "SnapKVPress", "kwargs": kw, "ratio": r, "policy": "SnapKV",
         "question_in_context": True}
        for r in (0.75, 0.5) for kw in ({}, {"window_size": "question"})]
t0 = time.time()
lines = R.run_workers(R.runtime(None, print).python, R.job(samples, tok, md, arms), 2, print)
out = []
for ln in lines:
    s, a = samples[ln["id"]], arms[ln["arm"]]
    out.append({"seed": s.seed, "task": s.task, "depth": s.depth, "index": s.index,
                "window": a["kwargs"].get("window_size", 64), "ratio": a["ratio"],
                "answer": list(s.answers), "output": ln["answers"][0],
                "ok": s.correct(ln["answers"][0])})
Path(sys.argv[1]).write_text("\n".join(json.dumps(r) for r in out) + "\n")
print(f"{len(out)} answers in {time.time() - t0:.0f} s")
