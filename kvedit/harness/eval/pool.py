"""Pool the answers of several `kvedit eval` runs into one gated report.

Why a module of its own: on a small or lent machine one run cannot hold every seed and
length (a 2-core box gives a locked command ~45 minutes; a 4k suite of the 1.5B model
prefills for most of that), so the suite is split into runs, one `--out` each (a seed, a
length). Gating pools the full-KV accuracy of each (task, length) over the seeds, so the
runs' figures cannot simply be averaged: this reads every run's `samples.jsonl` and computes
the `gated` block (with its `reuse` block) over all of them, exactly as one run would
(gating.py, report.py).

    python -m kvedit.harness.eval.pool results/eval/RUN-A results/eval/RUN-B ... \
        [--json] [--out pooled.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvedit.harness.eval import gating
from kvedit.harness.eval.policyspec import label, query_aware


def load(dirs: list[Path]) -> tuple[list[dict], list[dict]]:
    """(baseline records, cells) of every run: cells as gating.gated reads them, one per
    policy label and ratio, their records from every run. ValueError when two runs answered
    the same question of the same sample (runs must differ in seed or length)."""
    base: list[dict] = []
    cells: dict[tuple, list[dict]] = {}
    seen: dict[tuple, Path] = {}
    for d in dirs:
        path = Path(d) / "samples.jsonl"
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["policy"] in ("noop", "noop_control"):
                continue
            k = (r["policy"], r["ratio"], *gating.key(r))
            if k in seen and seen[k] != path:
                raise ValueError(f"{path} and {seen[k]} both answered {k}: pool runs of "
                                 f"different seeds or lengths")
            seen[k] = path
            if r["policy"] is None:
                base.append(r)
            else:
                cells.setdefault((label(r["policy"]), r["ratio"]), []).append(r)
    return base, [{"policy": p, "ratio": x, "records": recs}
                  for (p, x), recs in cells.items()]


def pooled(dirs: list[Path]) -> dict:
    base, cells = load(dirs)
    seeds = sorted({r.get("seed", 0) for r in base})
    g = gating.gated(base, cells, seeds, aware=query_aware)
    g["acceptance"] = gating.acceptance(g, query_aware)
    return {"runs": [str(d) for d in dirs], "seeds": seeds,
            "lengths": sorted({r["length"] for r in base}),
            "samples": len({gating.key({**r, "question": 0}) for r in base}),
            "questions": {p["policy"] + f" {p['ratio']:g}": len(p["records"]) for p in cells},
            "gated": g}


def reuse_table(g: dict) -> str:
    """The gated reuse block: every question of the multi-question samples, ÷ full KV."""
    block = g.get("reuse")
    if not block:
        return "reuse: no multi-question samples among the gated tasks"
    b = block["baseline"]
    lines = [f"reuse (gated, every question): full KV {b['accuracy']:.2f} of {b['n']}",
             "policy  ratio  accuracy  n  x full KV  95% CI (x)  " +
             "  ".join(f"x@{n}" for n in b["by_length"])]
    for r in block["results"]:
        rci = r["relative_ci"] or (0, 0)
        per = "  ".join(f"{r['by_length'][n]['relative_accuracy'] or 0:.2f}"
                        for n in b["by_length"])
        lines.append(f"{r['policy']}  {r['ratio']:g}  {r['accuracy']:.2f}  {r['n']}  "
                     f"{r['relative_accuracy']:.2f}  [{rci[0]:.2f}, {rci[1]:.2f}]  {per}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvedit.harness.eval.pool",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="`kvedit eval --out` directories")
    p.add_argument("--json", action="store_true", help="print only the JSON")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    missing = [str(d) for d in args.dirs if not (d / "samples.jsonl").is_file()]
    if missing:
        raise SystemExit(f"no samples.jsonl in {missing} (expected `kvedit eval --out` dirs)")
    try:
        out = pooled(args.dirs)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    text = json.dumps(out, indent=2)
    if args.out:
        args.out.write_text(text)
    if args.json:
        print(text)
    else:
        print(gating.table(out["gated"]) + "\n\n" + reuse_table(out["gated"]), file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
