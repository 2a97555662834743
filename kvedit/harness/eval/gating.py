"""The gated figures: only the tasks the model answers with its full KV count.

A task the unedited model fails says nothing about what an edit costs (a policy cannot lose
an answer the model never had, and a lucky answer is noise). So each task's full-KV accuracy
is taken per context length, pooled over the seeds, and only the (task, length) pairs at or
above `THRESHOLD` enter the headline figures: per policy x ratio, the accuracy over those
pairs with its 95% Wilson interval and relative to the full KV of the same prompts. The pairs
below it are reported beside, never dropped silently.

Relative accuracy is against the baseline of the same samples (a cell that ran on fewer
samples than the baseline, a run cut by its deadline, is compared with those samples only);
its interval is the cell's interval over that baseline.

`acceptance` states the quality targets on these figures (the no-op edit, question-aware
and query-agnostic policies at 0.5 and 0.75 per length, per head against per token, the
reuse suite, every seed, kvpress side by side).
"""
from __future__ import annotations

from kvedit.harness.eval.stats import accuracy

THRESHOLD = 0.8


def key(r: dict) -> tuple:
    """One answer's identity: which sample and which of its questions."""
    return (r.get("seed", 0), r["task"], r["length"], r["index"], r.get("question", 0))


def task_baselines(base_records) -> list[dict]:
    """Full-KV accuracy of each task at each length, main questions, pooled over seeds."""
    groups: dict[tuple, list] = {}
    for r in base_records:
        if r.get("question", 0) == 0:
            groups.setdefault((r["task"], r["length"]), []).append(r["ok"])
    return [{"task": t, "length": n, **accuracy(oks).to_dict()}
            for (t, n), oks in sorted(groups.items())]


def gated_pairs(base_records, threshold: float = THRESHOLD) -> set[tuple[str, int]]:
    return {(t["task"], t["length"]) for t in task_baselines(base_records)
            if t["accuracy"] is not None and t["accuracy"] >= threshold}


def _relative(records, base_by_key: dict) -> dict:
    """Accuracy of `records` with its interval, and relative to the baseline of the same
    answers."""
    acc = accuracy(r["ok"] for r in records).to_dict()
    base = accuracy(base_by_key[key(r)] for r in records if key(r) in base_by_key)
    b = base.value
    acc["baseline"] = b
    acc["relative_accuracy"] = acc["accuracy"] / b if b and acc["accuracy"] is not None \
        else None
    acc["relative_ci"] = [x / b for x in acc["ci"]] if b and acc["ci"] else None
    return acc


def _block(base_records, cells: list[dict], keep) -> dict:
    """baseline and per-cell figures over the records `keep` accepts, with per-length rows."""
    base = [r for r in base_records if keep(r)]
    ok = {key(r): r["ok"] for r in base}
    lengths = sorted({r["length"] for r in base})
    out = {"baseline": {**accuracy(r["ok"] for r in base).to_dict(), "by_length": {
        str(n): accuracy(r["ok"] for r in base if r["length"] == n).to_dict()
        for n in lengths}}, "results": []}
    for c in cells:
        recs = [r for r in c["records"] if keep(r)]
        row = {"policy": c["policy"], "ratio": c["ratio"], **_relative(recs, ok),
               "kept_fraction": _kept(recs)}
        row["by_length"] = {str(n): _relative([r for r in recs if r["length"] == n], ok)
                            for n in lengths}
        out["results"].append(row)
    return out


def _kept(records) -> float | None:
    """The context's share the edits kept (slots), over `records` weighted by length."""
    tokens = sum(r["length"] for r in records if "kept_fraction" in r)
    return sum(r["kept_fraction"] * r["length"] for r in records if "kept_fraction" in r) \
        / tokens if tokens else None


def gated(base_records, cells: list[dict], seeds: list[int], *, aware=None,
          threshold: float = THRESHOLD) -> dict:
    """The `gated` block of results.json: which (task, length) pairs count, and the figures
    over them, pooled and per seed; the reuse suite over them; the pairs left out beside.
    `cells`: dicts with policy, ratio and records (every question's); `aware(policy label)`:
    whether the policy scores with the question's queries."""
    pairs = gated_pairs(base_records, threshold)

    def main(r):
        return r.get("question", 0) == 0

    def counted(r):
        return main(r) and (r["task"], r["length"]) in pairs

    out = {"threshold": threshold,
           "tasks": [{**t, "gated": (t["task"], t["length"]) in pairs}
                     for t in task_baselines(base_records)],
           **_block(base_records, cells, counted)}
    out["not_gated"] = _block(base_records, cells, lambda r: main(r) and not counted(r))
    out["seeds"] = [{"seed": k, **_block(base_records, cells,
                                         lambda r, k=k: counted(r) and r.get("seed", 0) == k)}
                    for k in seeds]
    reuse = [r for r in base_records if r.get("questions", 1) > 1
             and (r["task"], r["length"]) in pairs]
    if reuse:
        block = _block(base_records, cells, lambda r: r.get("questions", 1) > 1
                       and (r["task"], r["length"]) in pairs)
        for row in block["results"]:
            row["query_aware"] = aware(row["policy"]) if aware else None
        out["reuse"] = block
    else:
        out["reuse"] = None
    return out


def reference_gated(records, pairs: set) -> list[dict]:
    """The kvpress arm's accuracy per press and ratio over the gated (task, length) pairs
    (the pairs kvedit's own baseline gates: the same prompts count on both sides)."""
    groups: dict[tuple, list] = {}
    for r in records or []:
        if r.get("press") and (r["task"], r["length"]) in pairs:
            groups.setdefault((r["policy"], r["press"], r["ratio"]), []).append(r["ok"])
    return [{"policy": p, "press": press, "ratio": x, **accuracy(oks).to_dict()}
            for (p, press, x), oks in groups.items()]


def _at(results, ratio, pick=lambda r: True):
    return [r for r in results if abs(r["ratio"] - ratio) < 1e-9 and pick(r)
            and r.get("relative_accuracy") is not None]


def _best(results, ratio, pick=lambda r: True):
    return max(_at(results, ratio, pick), key=lambda r: r["accuracy"], default=None)


def _check(row, target: float, what: str) -> dict:
    v = row and row["relative_accuracy"]
    return {"policy": row and row["policy"], "value": v, "target": f">= {target} x full KV",
            "ok": v is not None and v >= target, "what": what}


def per_head_pairs(results) -> list[tuple[dict, dict]]:
    """(per token, per head) rows of the same policy, options and ratio."""
    def split(label: str):
        name, *opts = label.split(":")
        head = "per_head=True" in opts
        return (name, tuple(o for o in opts if not o.startswith("per_head="))), head

    rows = {}
    for r in results:
        (base, head) = split(r["policy"])
        rows[(base, r["ratio"], head)] = r
    return [(rows[(b, x, False)], rows[(b, x, True)]) for (b, x, h) in rows
            if h and (b, x, False) in rows]


def acceptance(g: dict, aware, noop: dict | None = None, reference: dict | None = None) -> dict:
    """The quality targets on the gated figures (pooled over seeds; per length where the
    target says so). `aware(label)`: query-aware policy; `noop`: the no-op edit's agreement
    with the baseline; `reference`: the kvpress arm (side by side)."""
    out: dict = {}
    if noop is not None:
        f = noop.get("same_fraction")
        out["noop_same_answer"] = {"value": f, "target": ">= 0.99 of prompts",
                                   "ok": f is not None and f >= 0.99}
        if noop.get("control"):   # the same prompts decoded again with no edit: the floor
            out["noop_same_answer"]["control"] = noop["control"].get("same_fraction")
    results = g["results"]
    lengths = list(g["baseline"]["by_length"])
    for ratio, target in ((0.5, 0.98), (0.75, 0.95)):
        for n in lengths:
            rows = [{**r["by_length"][n], "policy": r["policy"], "ratio": r["ratio"]}
                    for r in results if n in r["by_length"]]
            out[f"question_aware_at_{ratio:g}_len{n}"] = _check(
                _best(rows, ratio, lambda r: aware(r["policy"])), target,
                f"best question-aware policy at {ratio:g}, {n} tokens")
    for ratio, target in ((0.5, 0.95), (0.75, 0.90)):
        out[f"query_agnostic_at_{ratio:g}"] = _check(
            _best(results, ratio, lambda r: not aware(r["policy"])), target,
            f"best query-agnostic policy at {ratio:g}")
    if g.get("reuse"):
        out["reuse_query_agnostic_at_0.5"] = _check(
            _best(g["reuse"]["results"], 0.5, lambda r: not r["query_aware"]), 0.95,
            "best query-agnostic policy at 0.5, every question of one edited cache")
    pairs = per_head_pairs(results)
    if pairs:
        rows = {f"{t['policy']} {t['ratio']:g}": h["accuracy"] - t["accuracy"]
                for t, h in pairs if t["accuracy"] is not None and h["accuracy"] is not None}
        ok = all(h["accuracy"] - t["accuracy"] >= (0.02 if t["ratio"] >= 0.75 else 0.0)
                 for t, h in pairs if t["accuracy"] is not None and h["accuracy"] is not None
                 ) if rows else None
        out["per_head_vs_per_token"] = {"differences": rows, "ok": ok, "target":
                                        ">= 0 at 0.5, >= +0.02 at 0.75 (per head - per token)"}
    best = _best(results, 0.5)
    if best and g.get("seeds"):
        per = {}
        for s in g["seeds"]:
            row = next((r for r in s["results"] if r["policy"] == best["policy"]
                        and abs(r["ratio"] - 0.5) < 1e-9), None)
            per[str(s["seed"])] = row and row["relative_accuracy"]
        out["best_at_0.5_every_seed"] = {"policy": best["policy"], "values": per,
                                         "target": ">= 0.9 x the seed's full KV",
                                         "ok": all(v is not None and v >= 0.9
                                                   for v in per.values())}
    adaptive = budget_pairs(results)
    if adaptive:
        rows = {f"{a['policy']} {a['ratio']:g}": {
            "difference": a["accuracy"] - u["accuracy"],
            "slots": [a.get("kept_fraction"), u.get("kept_fraction")]}
            for u, a in adaptive if a["accuracy"] is not None and u["accuracy"] is not None}
        at = [v["difference"] for k, v in rows.items() if k.endswith(" 0.75")]
        out["head_adaptive_vs_uniform_at_0.75"] = {
            "rows": rows, "ok": all(d >= 0 for d in at) if at else None,
            "target": ">= the same scorer with equal counts per head, at 0.75 (slots: the "
                      "kept fraction of each, adaptive first: it keeps its largest head's)"}
    if reference and reference.get("results"):
        out["kvedit_vs_kvpress_best"] = _versus_kvpress(results, reference)
        out["kvedit_inside_kvpress"] = _inside_kvpress(reference)
    return out


def budget_pairs(results) -> list[tuple[dict, dict]]:
    """(uniform per head, head-adaptive) rows of the same policy, options and ratio."""
    def split(label: str):
        name, *opts = label.split(":")
        budget = next((o for o in opts if o.startswith("budget=")), "budget=uniform")
        return (name, tuple(o for o in opts if not o.startswith("budget="))), budget

    rows = {}
    for r in results:
        base, budget = split(r["policy"])
        rows[(base, r["ratio"], budget)] = r
    return [(rows[(b, x, "budget=uniform")], r) for (b, x, k), r in rows.items()
            if k != "budget=uniform" and (b, x, "budget=uniform") in rows]


def _inside_kvpress(reference) -> dict:
    """Every policy kvpress also has against its press, on the gated pairs of the samples
    kvpress answered: kvedit's accuracy inside the press's 95% interval."""
    mine = {(r["policy"], r["ratio"]): r for r in reference.get("kvedit_gated", [])}
    rows = {}
    for t in reference.get("gated_results", []):
        m = mine.get((t["policy"], t["ratio"]))
        if m is None or m["accuracy"] is None or not t["ci"]:
            continue
        rows[f"{t['policy']} {t['ratio']:g}"] = {
            "kvedit": m["accuracy"], "kvpress": [t["press"], t["accuracy"], t["ci"]],
            "inside": t["ci"][0] - 1e-12 <= m["accuracy"] <= t["ci"][1] + 1e-12}
    return {"rows": rows, "ok": all(v["inside"] for v in rows.values()) if rows else None,
            "target": "kvedit inside kvpress's 95% interval on the same prompts, per policy"}


def _versus_kvpress(results, reference) -> dict:
    """At each ratio kvedit's best policy against kvpress's best press, both on the gated
    pairs of the samples the kvpress arm answered: at least as good, or inside its 95%
    interval."""
    out = {}
    for ratio in sorted({r["ratio"] for r in reference["results"]}):
        mine = _best(reference.get("kvedit_gated", results), ratio)
        theirs = max((r for r in reference.get("gated_results", reference["results"])
                      if abs(r["ratio"] - ratio) < 1e-9 and r["accuracy"] is not None),
                     key=lambda r: r["accuracy"], default=None)
        if not mine or not theirs:
            continue
        ok = mine["accuracy"] >= theirs["accuracy"] or (
            theirs["ci"] and theirs["ci"][0] <= mine["accuracy"])
        out[f"{ratio:g}"] = {"kvedit": [mine["policy"], mine["accuracy"]],
                             "kvpress": [theirs["press"], theirs["accuracy"], theirs["ci"]],
                             "ok": bool(ok)}
    return {"ratios": out, "ok": all(v["ok"] for v in out.values()) if out else None,
            "target": "kvedit's best >= kvpress's best, or inside its 95% interval"}


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(g: dict) -> str:
    """The printed gated table: policy x ratio over the gated tasks, relative to full KV with
    intervals, per length, and the tasks left out beside."""
    lengths = list(g["baseline"]["by_length"])
    lines = ["gated tasks (full-KV accuracy >= %g): " % g["threshold"] + (", ".join(
        f"{t['task']}@{t['length']} {t['accuracy']:.2f}" for t in g["tasks"] if t["gated"])
        or "none")]
    left = [f"{t['task']}@{t['length']} {_f(t['accuracy'])}" for t in g["tasks"]
            if not t["gated"]]
    lines.append("not gated (reported beside): " + (", ".join(left) or "none"))
    head = ["policy", "ratio", "accuracy", "95% CI", "x full KV", "95% CI (x)",
            *[f"x@{n}" for n in lengths], "not gated"]
    b = g["baseline"]
    rows = [["full KV", "0", _f(b["accuracy"]), f"[{_f((b['ci'] or [None])[0])}, "
             f"{_f((b['ci'] or [None, None])[1])}]", "1.00", "",
             *[_f(b["by_length"][n]["accuracy"]) for n in lengths],
             _f(g["not_gated"]["baseline"]["accuracy"])]]
    other = {(r["policy"], r["ratio"]): r for r in g["not_gated"]["results"]}
    for r in g["results"]:
        ci, rci = r["ci"] or (None, None), r["relative_ci"] or (None, None)
        rows.append([r["policy"], f"{r['ratio']:g}", _f(r["accuracy"]),
                     f"[{_f(ci[0])}, {_f(ci[1])}]", _f(r["relative_accuracy"]),
                     f"[{_f(rci[0])}, {_f(rci[1])}]",
                     *[_f(r["by_length"][n]["relative_accuracy"]) for n in lengths],
                     _f(other.get((r["policy"], r["ratio"]), {}).get("accuracy"))])
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(len(head))]
    body = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(row, widths))) for row in [head, *rows]]
    body.insert(1, "-" * len(body[0]))
    return "\n".join(lines + [""] + body)
