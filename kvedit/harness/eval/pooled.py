"""Figures over several `kvedit eval` runs pooled: what a run is cut into when one command
may not run long (a lent GPU machine's calls, a shared CPU's turns), read back as one.

Why a module of its own: a run's figures are computed from its answers (samples.jsonl, and
kvpress_samples.jsonl beside it), not from its running state, so the same functions that
write a run's results.json can pool any number of runs' answers: the baseline, every policy
x ratio cell, the gated figures and their acceptance, and kvpress side by side. The runs
must be of one model; seeds, tasks, lengths and policies may differ (a cell pools whatever
answered it). The kvpress comparison (`with_reference`) is shared with the live run.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvedit.harness.eval import gating, report
from kvedit.harness.eval.policyspec import label, query_aware

NOOP = ("noop", "noop_control")


def with_reference(reference: dict, reference_records: list[dict], base_records: list[dict],
                   rows: list[dict], seeds: list[int]) -> dict:
    """`reference` (the kvpress arm's summary) with kvedit beside it on the samples kvpress
    answered: side by side per policy, each press's and each policy's gated figures."""
    same = {gating.key({**r, "question": 0}) for r in reference_records}

    def answered(recs):
        return [r for r in report.main_records(recs) if gating.key(r) in same]

    _, mine = report.summarize(base_records, rows, answered)
    reference["side_by_side"] = report.side_by_side(mine, reference)
    pairs = gating.gated_pairs(base_records)
    reference["gated_results"] = gating.reference_gated(reference_records, pairs)
    reference["kvedit_gated"] = gating.gated(
        [r for r in base_records if gating.key(r) in same],
        [{**c, "records": answered(c["records"])} for c in rows], seeds,
        aware=query_aware)["results"]
    return reference


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _cells(records: list[dict]) -> list[dict]:
    """Rows as report.summarize reads them, one per (policy label, ratio)."""
    by: dict[tuple, list[dict]] = {}
    for r in records:
        by.setdefault((label(r["policy"]), r["ratio"]), []).append(r)
    rows = []
    for (policy, ratio), recs in by.items():
        main = report.main_records(recs)
        tokens = sum(r["length"] for r in main)
        kept = sum(r["kept_fraction"] * r["length"] for r in main) / tokens if tokens else None
        rows.append({"policy": policy, "ratio": ratio, "records": recs, "kept_fraction": kept})
    return rows


def _reference(records: list[dict]) -> dict | None:
    if not records:
        return None
    base = [r for r in records if r["press"] is None]
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        if r["press"] is not None:
            cells.setdefault((r["policy"], r["press"], r["ratio"]), []).append(r)
    b, rows = report.summarize(base, [{"policy": p, "press": x, "ratio": q, "records": recs}
                                      for (p, x, q), recs in cells.items()])
    keep = ("policy", "press", "ratio", "accuracy", "ci", "correct", "n", "by_task")
    return {"baseline": {k: b[k] for k in ("accuracy", "ci", "correct", "n")},
            "results": [{k: r[k] for k in keep} for r in rows],
            "samples_done": len({gating.key({**r, "question": 0}) for r in base})}


def pool(dirs: list[Path]) -> dict:
    """The figures of the runs in `dirs` pooled (module docstring)."""
    if not dirs:
        raise ValueError("pool: no run directories given")
    records, kvpress, models, commands = [], [], set(), []
    for d in dirs:
        d = Path(d)
        if not (d / "samples.jsonl").exists():
            raise ValueError(f"{d} holds no samples.jsonl: not a kvedit eval run's --out")
        records += _jsonl(d / "samples.jsonl")
        kvpress += _jsonl(d / "kvpress_samples.jsonl")
        res = d / "results.json"
        if res.exists():
            models.add(json.loads(res.read_text()).get("model"))
        commands.append(str(d))
    if len(models) > 1:
        raise ValueError(f"pool: the runs are of different models {sorted(map(str, models))}")
    base_records = [r for r in records if r["policy"] is None]
    cells = [r for r in records if r["policy"] is not None and r["policy"] not in NOOP]
    rows = _cells(cells)
    seeds = sorted({r["seed"] for r in base_records})
    base, results = report.summarize(base_records, rows)
    g = gating.gated(base_records, rows, seeds, aware=query_aware)
    noop = report.noop([r for r in records if r["policy"] == "noop"]) \
        if any(r["policy"] == "noop" for r in records) else None
    reference = _reference(kvpress)
    if reference is not None:
        with_reference(reference, kvpress, base_records, rows, seeds)
    g["acceptance"] = gating.acceptance(g, query_aware, noop, reference)
    return {"pooled_from": commands, "model": models.pop() if models else None,
            "baseline": base, "results": results, "gated": g, "noop": noop,
            "reuse": report.reuse(base_records, rows, query_aware),
            "seeds": report.by_seed(base_records, rows, seeds), "reference": reference}
