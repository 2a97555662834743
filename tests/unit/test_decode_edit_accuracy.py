"""`kvedit bench long`'s accuracy part without an engine: when it runs, when it says why it
did not, how it refuses bad arms, and what it reports from the records (the arms themselves
need SmolLM2 on vLLM: `kvedit bench long --json --accuracy-only`)."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kvedit.bench.long import accuracy as A
from kvedit.bench.long.cli import parse


def _args(**kw) -> argparse.Namespace:
    base = parse([])
    for k, v in kw.items():
        setattr(base, k, v)
    return base


def test_missing_model_is_skipped_with_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEDIT_CACHE_DIR", str(tmp_path))
    path, why = A.cached_model()
    assert path is None and "kvedit model smollm2" in why and str(tmp_path) in why
    assert A.from_args(_args(), lambda *a: None) == {"skipped": why}


def test_accuracy_model_none_skips():
    assert A.from_args(_args(accuracy_model="none"), print) == {
        "skipped": "--accuracy-model none"}


def test_unknown_arm_is_refused_with_the_choices(tmp_path, monkeypatch):
    monkeypatch.setattr(A, "cached_model", lambda name: (tmp_path, ""))  # refused before use
    with pytest.raises(SystemExit, match=r"unknown \['snapkv'\].*'none', 'rounds'"):
        A.from_args(_args(accuracy_arms="none,snapkv"), print)


def test_summary_counts_each_task_with_wilson_intervals():
    recs = [{"task": "count", "ok": True, "count_fraction": 1.0},
            {"task": "count", "ok": False, "count_fraction": 0.25},
            {"task": "recall", "ok": False, "count_fraction": 1.0}]
    s = A._summary(recs, "streaming")
    assert (s["count"]["correct"], s["count"]["n"]) == (1, 2)
    assert s["count"]["mean_count_fraction"] == pytest.approx(0.625)
    lo, hi = s["count"]["ci"]
    assert 0.0 < lo < 0.5 < hi < 1.0
    assert s["recall"]["accuracy"] == 0.0 and s["recall"]["ci"][0] == 0.0


def test_slip_context_shows_the_first_wrong_number():
    text = " 101, 102, 103, 105, 106"
    assert "105" in A._around_slip(text, 3) and A._around_slip(text, 3).startswith(" 101")
    assert A._around_slip(text, 9) == text[-40:]  # ran out of numbers: the end


def test_help_lists_the_accuracy_flags():
    out = subprocess.run([sys.executable, "-m", "kvedit.cli", "bench", "long", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--accuracy-model", "--accuracy-only", "--accuracy-arms", "--accuracy-budget"):
        assert flag in out.stdout
