"""`kvedit eval` output: the JSON summary, the table, and the two charts.

JSON (the acceptance check reads it): top level "baseline": {"accuracy", "ci", ...} and
"results": [{"policy", "ratio", "accuracy", "ci", "decode_gain", ...}, ...], each with the
same accuracy broken down by task, length and needle depth.
"""
from __future__ import annotations

from pathlib import Path

from kvedit.harness.eval.stats import accuracy, by


def _groups(records) -> dict:
    return {
        "by_task": {k: v.to_dict() for k, v in by(records, lambda r: r["task"]).items()},
        "by_length": {str(k): v.to_dict() for k, v in by(records, lambda r: r["length"]).items()},
        "by_depth": {f"{k:g}": v.to_dict() for k, v in by(records, lambda r: r["depth"]).items()},
        "by_seed": {str(k): v.to_dict() for k, v in by(records, lambda r: r.get("seed", 0)).items()},
    }


def main_records(records) -> list[dict]:
    """The main suite: every sample's own (first) question."""
    return [r for r in records if r.get("question", 0) == 0]


def reuse_records(records) -> list[dict]:
    """The reuse suite: every question of the samples that have several."""
    return [r for r in records if r.get("questions", 1) > 1]


def summarize(base_records, cells: list[dict], pick=main_records) -> tuple[dict, list[dict]]:
    """(baseline, results) as the JSON has them, over the records `pick` keeps. `cells`:
    dicts with policy, ratio, records, kept/stored fractions, timings and the gain fields
    (not changed)."""
    base_records = pick(base_records)
    base = {**accuracy(r["ok"] for r in base_records).to_dict(), **_groups(base_records)}
    results = []
    for c in cells:
        recs = pick(c["records"])
        acc = accuracy(r["ok"] for r in recs)
        row = {"policy": c["policy"], "ratio": c["ratio"], **acc.to_dict()}
        row["relative_accuracy"] = (acc.value / base["accuracy"]
                                    if acc.value is not None and base["accuracy"] else None)
        row.update({"decode_gain": None, "step_gain": None, "decode_gain_bound": None})
        row.update({k: v for k, v in c.items() if k not in ("policy", "ratio", "records")})
        row.update(_groups(recs))
        results.append(row)
    return base, results


_BRIEF = ("accuracy", "ci", "correct", "n")


def compact(base: dict, results: list[dict]) -> dict:
    """{baseline, results} with accuracy and interval only (the pooled view)."""
    return {"baseline": {k: base[k] for k in _BRIEF},
            "results": [{"policy": r["policy"], "ratio": r["ratio"],
                         **{k: r[k] for k in _BRIEF}} for r in results]}


def noop(records) -> dict:
    """The no-op edit (retrieve -> identity -> store -> decode), or its control (no edit,
    runner.Reload): how many of its answers are the unedited baseline's, word for word, and
    its accuracy."""
    main = main_records(records)
    same = [r["same_as_baseline"] for r in main if "same_as_baseline" in r]
    return {"same": sum(same), "n": len(same),
            "same_fraction": sum(same) / len(same) if same else None,
            **accuracy(r["ok"] for r in main).to_dict()}


def kvzip_cost(baseline_info: dict) -> dict | None:
    """KVzip's reconstruction pass against the plain prefill of the same prompts (wall time
    of each phase, all samples at once; the pass's context tokens come from the server)."""
    if "reconstruct_s" not in baseline_info:
        return None
    pre, rec = baseline_info["prefill_s"], baseline_info["reconstruct_s"]
    return {"prefill_s": pre, "reconstruct_s": rec,
            "prefill_tokens": baseline_info["prefill_tokens"],
            "reconstruct_tokens": baseline_info["reconstruct_tokens"],
            "reconstruct_cached_tokens": baseline_info.get("reconstruct_cached_tokens"),
            "reconstruct_vs_prefill": rec / pre if pre else None,
            "total_vs_prefill": (pre + rec) / pre if pre else None}


def by_seed(base_records, cells: list[dict], seeds: list[int]) -> list[dict]:
    """[{seed, baseline, results}]: the main suite of each seed on its own."""
    out = []
    for k in seeds:
        def pick(recs, k=k):
            return [r for r in main_records(recs) if r.get("seed", 0) == k]
        base, results = summarize(base_records, cells, pick)
        out.append({"seed": k, "baseline": base, "results": [
            {key: r[key] for key in ("policy", "ratio", "accuracy", "ci", "correct", "n",
                                     "relative_accuracy", "by_task")} for r in results]})
    return out


def reuse(base_records, cells: list[dict], aware) -> dict | None:
    """The reuse suite pooled over seeds: baseline and per policy x ratio, with
    `query_aware(policy name)` saying whether the policy scored with the first question."""
    if not reuse_records(base_records):
        return None
    base, results = summarize(base_records, cells, reuse_records)
    keep = ("policy", "ratio", "accuracy", "ci", "correct", "n", "relative_accuracy",
            "by_task")
    return {"baseline": {k: base[k] for k in ("accuracy", "ci", "correct", "n", "by_task")},
            "results": [{**{k: r[k] for k in keep}, "query_aware": aware(r["policy"])}
                        for r in results]}


def _at(results, ratio):
    return [x for x in results if abs(x["ratio"] - ratio) < 1e-9 and x["accuracy"] is not None]


def _best(results, ratio):
    return max(_at(results, ratio), key=lambda x: x["accuracy"], default=None)


def side_by_side(results: list[dict], reference: dict) -> list[dict]:
    """Per press with a kvedit peer and ratio: kvedit's accuracy, kvpress's with its 95%
    interval, the difference, and whether kvedit's lies inside kvpress's interval."""
    mine = {(r["policy"], r["ratio"]): r for r in results}
    out = []
    for r in reference["results"]:
        peer = mine.get((r["policy"], r["ratio"]))
        row = {"policy": r["policy"], "press": r["press"], "ratio": r["ratio"],
               "kvpress": r["accuracy"], "kvpress_ci": r["ci"],
               "kvedit": peer and peer["accuracy"], "kvedit_ci": peer and peer["ci"]}
        if peer and r["ci"]:
            row["difference"] = peer["accuracy"] - r["accuracy"]
            row["inside"] = r["ci"][0] - 1e-12 <= peer["accuracy"] <= r["ci"][1] + 1e-12
        out.append(row)
    return out


def side_by_side_chart(rows: list[dict], path: Path, precision: str = "float32") -> Path:
    """Bars per policy and ratio: kvedit's and kvpress's accuracy with 95% intervals
    (`precision`: kvpress's, as its arm reports it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("kvedit") is not None]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2), 4.4), dpi=120)
    xs = range(len(rows))
    for off, key, label in ((-0.2, "kvedit", "kvedit (vLLM, bf16)"),
                            (0.2, "kvpress", f"kvpress (transformers, {precision})")):
        ys = [r[key] for r in rows]
        ci = [r[f"{key}_ci"] or (y, y) for r, y in zip(rows, ys)]
        # Wilson bounds at 0 or 1 come back a rounding error past the point (1e-17):
        # matplotlib refuses a negative error bar, so clamp.
        err = [[max(0.0, y - c[0]) for y, c in zip(ys, ci)],
               [max(0.0, c[1] - y) for y, c in zip(ys, ci)]]
        ax.bar([x + off for x in xs], ys, 0.4, yerr=err, capsize=2, label=label, alpha=0.85)
    ax.set_xticks(list(xs), [f"{r['policy']}\n{r['ratio']:g}" for r in rows], fontsize=7)
    ax.set_ylabel("accuracy (95% Wilson intervals)")
    ax.set_ylim(0, 1.05)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def acceptance(base: dict, results: list[dict], seeds: list[dict] | None = None,
               reuse_part: dict | None = None, reference: dict | None = None) -> dict:
    """The acceptance checks, computed from the same numbers the JSON reports: the pooled
    baseline, the best policy at 0.5 against the pooled baseline and each seed's, the best
    at 0.75, and the best query-agnostic policy of the reuse suite at 0.5."""
    b = base["accuracy"]
    out = {"pooled_baseline": {"value": b, "target": ">= 0.8",
                               "ok": b is not None and b >= 0.8}}
    for ratio, target in ((0.5, 0.95), (0.75, 0.85)):
        best = _best(results, ratio)
        v = best["accuracy"] / b if best and b else None
        out[f"best_at_{ratio:g}_vs_pooled_baseline"] = {
            "policy": best and best["policy"], "value": v, "target": f">= {target}",
            "ok": v is not None and v >= target}
    best = _best(results, 0.5)
    if seeds and best:
        per = {}
        for s in seeds:
            row = next((r for r in s["results"] if r["policy"] == best["policy"]
                        and abs(r["ratio"] - 0.5) < 1e-9), None)
            sb = s["baseline"]["accuracy"]
            # a seed whose baseline ran but no cell yet (a group ending mid-seed, between
            # its baseline and its cells) has no accuracy to divide
            per[str(s["seed"])] = row["accuracy"] / sb \
                if row and row["accuracy"] is not None and sb else None
        out["best_at_0.5_vs_each_seed_baseline"] = {
            "policy": best["policy"], "values": per, "target": ">= 0.9",
            "ok": all(v is not None and v >= 0.9 for v in per.values())}
    if reuse_part:
        agnostic = [r for r in reuse_part["results"] if not r["query_aware"]]
        best = _best(agnostic, 0.5)
        rb = reuse_part["baseline"]["accuracy"]
        v = best["accuracy"] / rb if best and rb else None
        out["reuse_best_query_agnostic_at_0.5"] = {
            "policy": best and best["policy"], "value": v, "target": ">= 0.9",
            "ok": v is not None and v >= 0.9}
    if reference and reference.get("side_by_side"):
        pairs = [r for r in reference["side_by_side"] if "inside" in r]
        out["kvedit_inside_kvpress_interval"] = {
            "pairs": {f"{r['policy']} {r['ratio']:g}": r["inside"] for r in pairs},
            "target": "inside, or the difference explained (docs/eval.md)",
            "ok": all(r["inside"] for r in pairs)}
    return out


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(base: dict, results: list[dict]) -> str:
    tasks = list(base["by_task"])
    head = ["policy", "ratio", "kept", "accuracy", "95% CI", *tasks, "decode gain", "step gain",
            "bound"]
    bci = base["ci"] or (None, None)
    rows = [["baseline", "0", "1.00", _f(base["accuracy"]), f"[{_f(bci[0])}, {_f(bci[1])}]",
             *[_f(base["by_task"][t]["accuracy"]) for t in tasks], "1.00x", "1.00x", ""]]
    for r in results:
        ci = r["ci"] or (None, None)
        rows.append([r["policy"], f"{r['ratio']:g}", _f(r.get("kept_fraction")),
                     _f(r["accuracy"]), f"[{_f(ci[0])}, {_f(ci[1])}]",
                     *[_f(r["by_task"].get(t, {}).get("accuracy")) for t in tasks],
                     _f(r.get("decode_gain"), "{:.2f}x"), _f(r.get("step_gain"), "{:.2f}x"),
                     _f(r.get("decode_gain_bound"),
                                                             "{:.2f}x")])
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in [head, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def charts(base: dict, results: list[dict], out: Path, title: str) -> list[Path]:
    """accuracy_vs_ratio.png (one line per policy, kvpress's picture) and
    accuracy_vs_gain.png (the accuracy / decode-speed frontier a user chooses on)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in results))
    paths = [out / "accuracy_vs_ratio.png", out / "accuracy_vs_gain.png"]
    # The frontier's x: decode tokens per engine step vs the baseline (contention-free; the
    # wall-clock gain on a shared machine moves with other processes' load), else wall-clock.
    gain_key = "step_gain" if any(r.get("step_gain") for r in results) else "decode_gain"
    xlabels = {"ratio": "compression ratio (fraction of the context KV dropped)",
               "step_gain": "decode gain (x; decode tokens per vLLM step, KV-bound batch)",
               "decode_gain": "decode throughput gain (x, KV-bound batch)"}
    for path, xkey in zip(paths, ("ratio", gain_key)):
        fig, ax = plt.subplots(figsize=(7.2, 4.6), dpi=120)
        for p in policies:
            rows = sorted((r for r in results if r["policy"] == p and r.get(xkey) is not None),
                          key=lambda r: r["ratio"])  # lines join ratios in order
            xs = [0.0 if xkey == "ratio" else 1.0] + [r[xkey] for r in rows]
            ys = [base["accuracy"]] + [r["accuracy"] for r in rows]
            ax.plot(xs, ys, marker="o", label=p, alpha=0.85)
        ax.axhline(base["accuracy"], color="grey", ls="--", lw=1, label="no compression")
        ax.set_xlabel(xlabels[xkey])
        ax.set_ylabel("accuracy (95% Wilson intervals in results.json)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(title, fontsize=8, wrap=True)
        ax.spines[["top", "right"]].set_visible(False)
        ax.legend(fontsize=7, frameon=False, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
    return paths


def markdown(base: dict, results: list[dict]) -> str:
    """Accuracy per policy (rows) and ratio (columns), with the decode gain per ratio: the
    table the README and docs/eval.md show (written to table.md)."""
    ratios = sorted({r["ratio"] for r in results})
    policies = list(dict.fromkeys(r["policy"] for r in results))
    cell = {(r["policy"], r["ratio"]): r for r in results}
    lines = ["| policy | " + " | ".join(f"{x:g}" for x in ratios) + " |",
             "|---|" + "---|" * len(ratios),
             "| none (baseline) | " + " | ".join(
                 f"{base['accuracy']:.2f}" for _ in ratios) + " |"]
    for p in policies:
        lines.append(f"| {p} | " + " | ".join(
            f"{cell[p, x]['accuracy']:.2f}" if (p, x) in cell else "-" for x in ratios) + " |")
    gains = [next((cell[p, x] for p in policies if (p, x) in cell), {}) for x in ratios]
    lines.append("| decode gain (step gain; bound) | " + " | ".join(
        f"{g['decode_gain']:.2f}x ({g['step_gain']:.2f}x; {g['decode_gain_bound']:.1f}x)"
        if g.get("decode_gain") and g.get("step_gain") else "-" for g in gains) + " |")
    return "\n".join(lines) + "\n"
