"""Score-only comparison from the cached KVzip scores (no model): per score and selection,
the share of (layer, head) entries kept over the asked needle, and how much two scores'
selections overlap."""
import math, json, sys
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from kvzip_cause import select, needle_kept
from kvedit.harness.eval.tasks import build
from kvedit.harness.eval.tokenizer import load

M = "/root/.cache/kvedit/qwen2.5-coder-1.5b-instruct-v1"
tok = load(M)
out = []
for name, (task, length, depth) in {"multikey_confusable-2048-0.1-0-0": ("multikey_confusable", 2048, 0.1),
                                    "passkey-1024-0.5-0-0": ("passkey", 1024, 0.5)}.items():
    have = torch.load(f"/tmp/i43a/analysis/cache/{name}.pt")
    s = build(tok, task, length, depth, 0, 0)
    T = s.length
    sc = have["scores"]
    for r in (0.5, 0.75):
        keep = T - math.floor(r * T)
        masks = {}
        for score in sc:
            for how in ("global", "layer", "head", "tmean", "tmax"):
                m = select(sc[score], how, keep)
                masks[(score, how)] = m
                out.append({"sample": name, "ratio": r, "score": score, "selection": how,
                            "needle_kept": round(needle_kept(m, s), 3),
                            "slots": round(float(m.sum(-1).max()) / T, 3)})
        for how in ("global", "layer", "head"):
            for a, b in (("kvedit", "kvpress"), ("fullden", "kvpress"), ("kvedit", "fullden")):
                if (a, how) in masks and (b, how) in masks:
                    x, y = masks[(a, how)], masks[(b, how)]
                    out.append({"sample": name, "ratio": r, "selection": how, "pair": f"{a}~{b}",
                                "jaccard": round(float((x & y).sum() / (x | y).sum()), 3)})
for o in out:
    print(json.dumps(o))
