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
    }


def summarize(base_records, cells: list[dict]) -> tuple[dict, list[dict]]:
    """(baseline, results) as the JSON has them. `cells`: dicts with policy, ratio, records,
    kept/stored fractions, timings and the gain fields."""
    base = {**accuracy(r["ok"] for r in base_records).to_dict(), **_groups(base_records)}
    results = []
    for c in cells:
        recs = c.pop("records")
        acc = accuracy(r["ok"] for r in recs)
        row = {"policy": c.pop("policy"), "ratio": c.pop("ratio"), **acc.to_dict()}
        row["relative_accuracy"] = (acc.value / base["accuracy"]
                                    if acc.value is not None and base["accuracy"] else None)
        row.update({"decode_gain": None, "step_gain": None, "decode_gain_bound": None})
        row.update(c)  # the gain fields when the gain arms ran
        row.update(_groups(recs))
        results.append(row)
    return base, results


def acceptance(base: dict, results: list[dict]) -> dict:
    """The eval's three checks (baseline accuracy, best policy at 0.5, spread at 0.75),
    computed from the same numbers the JSON reports."""
    def at(r):
        return [x for x in results if abs(x["ratio"] - r) < 1e-9 and x["accuracy"] is not None]

    half, most = at(0.5), at(0.75)
    best_half = max(half, key=lambda x: x["accuracy"], default=None)
    spread = (max(x["accuracy"] for x in most) - min(x["accuracy"] for x in most)
              if most else None)
    b = base["accuracy"]
    return {
        "baseline_accuracy": {"value": b, "target": ">= 0.8", "ok": b is not None and b >= 0.8},
        "best_at_0.5_vs_baseline": {
            "policy": best_half and best_half["policy"],
            "value": best_half["accuracy"] / b if best_half and b else None,
            "target": ">= 0.9", "ok": bool(best_half and b and best_half["accuracy"] >= 0.9 * b)},
        "spread_at_0.75": {"value": spread, "target": ">= 0.15",
                           "ok": spread is not None and spread >= 0.15},
    }


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(base: dict, results: list[dict]) -> str:
    tasks = list(base["by_task"])
    head = ["policy", "ratio", "kept", "accuracy", "95% CI", *tasks, "decode gain", "step gain",
            "bound"]
    rows = [["baseline", "0", "1.00", _f(base["accuracy"]),
             f"[{_f(base['ci'][0])}, {_f(base['ci'][1])}]",
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
