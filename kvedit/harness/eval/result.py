"""What an eval leaves: results.json (every figure, rewritten whole after each cell, so a
killed run leaves what finished), samples.jsonl's kvpress twin, table.md, the charts and
the lines printed at the end. It reads a run's state and changes none of it."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from kvedit.harness.eval.policyspec import label, needs_queries, parse_spec, query_aware, \
    sink_policies
from kvedit.harness.eval.pooled import with_reference

NOTES = ("accuracy: greedy; a sample is correct when every expected answer is in the answer "
         "(numbers as whole numbers, words as whole words) and no distractor's value is. "
         "gated: only the (task, length) pairs whose full-KV accuracy (pooled over seeds) is "
         ">= 0.8, relative to the full KV of the same samples; baseline/results: every task, "
         "pooled over the seeds (seeds: each on its own); reuse: every question of the "
         "multi-question samples, asked of one edited cache; noop: the edit path with nothing "
         "dropped, its answers against the baseline's (noop.control: the same prompts decoded "
         "again with no edit, the floor). kept_fraction: context tokens that survive the edit "
         "(stored or recomputed); query-aware policies (SnapKV, TOVA) score with the queries "
         "vLLM captured for the prompt's tail (the question), KVzip with those of its "
         "reconstruction pass; decode_gain: wall-clock decode throughput vs the unedited "
         "batch, step_gain: decode tokens per vLLM engine step (contention-free).")


def write_json(path: Path, result: dict) -> None:
    """Written whole or not at all (a reader never sees half a file, a kill never leaves one)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(path)


def write_jsonl(path: Path, records) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def build(run, elapsed: float, final: bool = True) -> dict:
    """results.json of `run` (kvedit.harness.eval.run.EvalRun) as it stands."""
    from kvedit.harness.eval import gating, report

    cfg, acc = run.cfg, run.acc
    rows = acc.rows(run.gains)
    base, results = report.summarize(acc.base_records, rows)
    seeds = report.by_seed(acc.base_records, rows, cfg.seeds)
    reuse = report.reuse(acc.base_records, rows, query_aware) if cfg.reuse else None
    noops = {name: report.noop(t.records) for name, t in acc.noop_tallies.items()}
    noop = noops.get("noop")
    if noop is not None and "noop_control" in noops:
        noop["control"] = noops["noop_control"]
    g = gating.gated(acc.base_records, rows, cfg.seeds, aware=query_aware)
    reference = run.reference_result
    if reference is not None:
        with_reference(reference, run.reference_records, acc.base_records, rows, cfg.seeds)
    g["acceptance"] = gating.acceptance(g, query_aware, noop, reference)
    run.timings["total_s"] = elapsed
    for row in results:
        row.pop("gain_baseline", None)
    return {
        "model": cfg.model, "model_dir": str(run.model_dir), "partial": not final,
        "progress": _progress(run), "config": _config(run),
        "baseline": base, "results": results, "gated": g, "noop": noop,
        "pooled": report.compact(base, results),
        "seeds": seeds, "reuse": reuse, "reference": reference,
        "kvzip_cost": report.kvzip_cost(acc.base_info),
        "gain_baseline": (run.gains or {}).get("baseline"),
        "acceptance": report.acceptance(base, results, seeds, reuse, reference),
        "timings": {**run.timings, "baseline": acc.base_info},
        "notes": NOTES,
    }


def _progress(run) -> dict:
    acc, groups = run.acc, run.sizing.groups
    return {"groups_done": acc.groups_done, "groups_cut": acc.groups_cut,
            "groups": len(groups),
            "samples_done": sum(len(g) for g in groups[:acc.groups_done]),
            "samples": len(run.samples), "stopped_by_deadline": run.deadline.stopped}


def _config(run) -> dict:
    cfg, sz = run.cfg, run.sizing
    return {**asdict(cfg), "gain_workload": asdict(run.gcfg) if cfg.gain else None,
            "samples_total": len(run.samples), "edit_device": sz.edit_device,
            "dtype": sz.dtype, "in_flight": sz.in_flight,
            "modify_concurrency": sz.modify_concurrency, "cells_at_once": sz.at_once,
            "header_sink": ({"tokens": run.sink, "policies": [
                label(k) for k in cfg.policies if parse_spec(k)[0] in sink_policies()]}
                if run.sink is not None else None),
            "query_window": ("the prompt's un-editable tail (question + answer prime), "
                             f"{min(run.tails)}-{max(run.tails)} tokens"
                             if needs_queries(cfg.policies) else None)}


def write(run, result: dict, out: Path, log) -> None:
    """results.json, the kvpress answers, table.md and the charts into `out`; the tables,
    the no-op line, the deadline's stop and the acceptance printed through `log`."""
    from kvedit.harness.eval import gating, report

    base, results = result["baseline"], result["results"]
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result)
    charts = []
    if results:
        cfg = run.cfg
        charts = report.charts(base, results, out, f"{run.model_dir.name}, "
                               f"{len(run.samples)} samples ({', '.join(cfg.tasks)}; "
                               f"{'/'.join(map(str, cfg.lengths))} tokens; seeds "
                               f"{','.join(map(str, cfg.seeds))})")
    if result["reference"] is not None:
        write_jsonl(out / "kvpress_samples.jsonl", run.reference_records)
        ref = result["reference"]
        charts.append(report.side_by_side_chart(ref["side_by_side"],
                                                out / "kvedit_vs_kvpress.png",
                                                ref.get("precision", "float32")))
    (out / "table.md").write_text(report.markdown(base, results) if results else "")
    log("\n" + report.table(base, results))
    log("\n" + gating.table(result["gated"]))
    if result["noop"]:
        control = result["noop"].get("control")
        log(f"\nno-op edit: {result['noop']['same']}/{result['noop']['n']} answers the same "
            f"as the baseline's" + (f"; without any edit (reloaded): {control['same']}/"
                                    f"{control['n']}" if control else ""))
    progress = result["progress"]
    if progress["stopped_by_deadline"]:
        log(f"\nstopped by the deadline after {progress['groups_done']}/"
            f"{progress['groups']} groups ({progress['samples_done']}/"
            f"{progress['samples']} samples): {progress['stopped_by_deadline']}")
    log(f"\nacceptance (gated): {json.dumps(result['gated']['acceptance'])}")
    log(f"wrote {out / 'results.json'}, {out / 'samples.jsonl'}"
        + "".join(f", {p}" for p in charts) + f" in {result['timings']['total_s']:.0f} s")
