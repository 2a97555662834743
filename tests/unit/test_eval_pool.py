"""Pooling split `kvedit eval` runs (kvedit.harness.eval.pool): the gated figures of runs split
by seed equal those of one run over every seed (gating.gated over all the records, the
reference), whatever the split; runs that answered the same question are refused."""
from __future__ import annotations

import json
import random

import pytest

from kvedit.harness.eval import gating
from kvedit.harness.eval.pool import load, main, pooled
from kvedit.harness.eval.policyspec import query_aware


def records(seed: int) -> list[dict]:
    """A run's samples.jsonl: baseline and two cells, two tasks, every question."""
    rng = random.Random(seed)
    out = []
    for policy in (None, "keydiff", "repair:base=keydiff"):
        for task, questions in (("multikey", 3), ("passkey", 1)):
            for index in range(3):
                for q in range(questions):
                    out.append({"seed": seed, "task": task, "length": 2048, "index": index,
                                "question": q, "questions": questions, "policy": policy,
                                "ratio": 0.0 if policy is None else 0.5,
                                "ok": rng.random() < (0.9 if policy != "keydiff" else 0.6)})
    return out


def write(tmp_path, name: str, recs: list[dict]):
    d = tmp_path / name
    d.mkdir()
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def test_runs_split_by_seed_pool_to_the_figures_of_one_run(tmp_path):
    runs = [write(tmp_path, f"s{k}", records(k)) for k in range(3)]
    every = [r for k in range(3) for r in records(k)]
    base = [r for r in every if r["policy"] is None]
    cells = [{"policy": lab, "ratio": 0.5, "records": [r for r in every if r["policy"] == p]}
             for p, lab in (("keydiff", "KeyDiff"), ("repair:base=keydiff",
                                                     "Repair:base=keydiff"))]
    want = gating.gated(base, cells, [0, 1, 2], aware=query_aware)
    got = pooled(runs)
    assert got["seeds"] == [0, 1, 2] and got["samples"] == 18
    for k in ("tasks", "baseline", "results", "reuse", "not_gated", "seeds"):
        assert got["gated"][k] == want[k]
    assert {r["policy"]: r["query_aware"] for r in got["gated"]["reuse"]["results"]} == {
        "KeyDiff": False, "Repair:base=keydiff": True}
    assert pooled(list(reversed(runs)))["gated"]["results"] == got["gated"]["results"]


def test_runs_that_answered_the_same_question_are_refused(tmp_path):
    a, b = write(tmp_path, "a", records(0)), write(tmp_path, "b", records(0))
    with pytest.raises(ValueError, match="both answered"):
        load([a, b])
    with pytest.raises(SystemExit, match="no samples.jsonl"):
        main([str(tmp_path / "nowhere")])
