"""`kvedit eval --reference kvpress` without kvpress: which presses pair with which policies
and how they are configured, what the worker is sent (the eval's own token ids, the question
split where the chat template's closing starts), how its JSON lines become accuracies, and
that a failing worker is reported with its stderr. The real kvpress arm is
tests/engine/test_kvpress_reference.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvedit.harness.eval import reference as R


def test_arms_pair_every_shared_policy_at_every_ratio_with_the_header_sink():
    arms = R.arms(["SnapKV", "KeyNorm", "StreamingLLM", "KVzip", "DropMiddle"], [0.5, 0.75], 49)
    assert arms[0] == {"press": None, "ratio": 0.0, "policy": None, "policies": [None],
                       "question_in_context": False}
    got = {(a["policy"], a["ratio"]): a for a in arms[1:]}
    assert set(got) == {(p, r) for p in ("SnapKV", "KeyNorm", "StreamingLLM", "KVzip", "AdaKV")
                        for r in (0.5, 0.75)}  # DropMiddle has no press; AdaKV is kvpress-only
    assert got["SnapKV", 0.5]["press"] == "SnapKVPress"
    assert got["SnapKV", 0.5]["question_in_context"] and not got["KeyNorm", 0.5][
        "question_in_context"]
    assert got["KeyNorm", 0.75]["press"] == "KnormPress"
    assert got["StreamingLLM", 0.5]["kwargs"] == {"n_sink": 49}
    assert got["KVzip", 0.5]["kwargs"] == {"n_sink": 49}
    # SnapKV (and AdaKV's inner SnapKV) observe the question text, as kvedit's SnapKV does
    assert got["SnapKV", 0.5]["kwargs"] == {"window_size": "question"}
    assert got["AdaKV", 0.5]["kwargs"] == {"inner": "SnapKVPress", "window_size": "question"}
    assert R.arms(["StreamingLLM"], [0.5], None)[1]["kwargs"] == {"n_sink": 4}


def test_options_pair_with_the_press_configured_alike_and_share_its_arm():
    sink = 49
    assert R.pairing("keydiff:per_head=on", sink) == ("KeyDiffPress", {}, False)
    assert R.pairing("keydiff:per_head=on:budget=layer", sink) == (
        "AdaKVPress", {"inner": "KeyDiffPress"}, False)
    assert R.pairing("snapkv:per_head=on:budget=layer", sink) == (
        "AdaKVPress", {"inner": "SnapKVPress", "window_size": "question"}, True)
    assert R.pairing("expected_attention:per_head=on", sink) == (
        "ExpectedAttentionPress", {"n_sink": 49}, False)
    assert R.pairing("kvzip:per_head=on:budget=global", sink) == (
        "KVzipPress", {"n_sink": 49}, False)
    assert R.pairing("kvzip:per_head=on:budget=layer", sink) == (
        "KVzipPress", {"n_sink": 49, "layerwise": True}, False)
    for none in ("kvzip:per_head=on", "keydiff:per_head=on:budget=global",
                 "snapkv:span=1", "keydiff:per_head=on:budget=layer:alpha=0.5", "drop_middle"):
        assert R.pairing(none, sink) is None, none   # configured unlike any press
    arms = R.arms(["keydiff", "keydiff:per_head=on", "keydiff:per_head=on:budget=layer"],
                  [0.5], sink)
    keydiff = [a for a in arms if a["press"] == "KeyDiffPress"]
    assert len(keydiff) == 1 and keydiff[0]["policies"] == ["KeyDiff", "KeyDiff:per_head=True"]
    ada = [a for a in arms if a["policy"] == "KeyDiff:per_head=True:budget=layer"]
    assert ada[0]["press"] == "AdaKVPress" and ada[0]["kwargs"] == {"inner": "KeyDiffPress"}


def test_job_sends_the_eval_token_ids_and_the_question_split():
    tok = SimpleNamespace(after_user="<end>", encode=lambda text: [2, 9] if text == "<end>"
                          else [])
    q = SimpleNamespace(tail=(7, 7, 7, 2, 9, 5))  # question text, closing, prime
    s = SimpleNamespace(prompt_ids=list(range(10, 20)) + [7, 7, 7, 2, 9, 5], length=10,
                        questions=(q,), max_tokens=8)
    job = R.job([s], tok, Path("/m"), [{"press": None}])
    (one,) = job["samples"]
    assert one["context"] == list(range(10, 20)) and one["split"] == 3
    assert one["questions"] == [[7, 7, 7, 2, 9, 5]] and one["max_tokens"] == 8
    assert job["model_dir"] == "/m" and json.loads(json.dumps(job)) == job  # JSON only


def test_a_failing_worker_is_reported_with_its_error(tmp_path, monkeypatch):
    bad = tmp_path / "worker.py"
    bad.write_text("import sys; sys.stdin.read(); print('boom: no kvpress', file=sys.stderr); "
                   "sys.exit(3)\n")
    monkeypatch.setattr(R, "WORKER", bad)
    with pytest.raises(RuntimeError, match=r"(?s)exit 3.*boom: no kvpress"):
        R.run_workers(Path(sys.executable), {"samples": [{"id": 0}], "arms": []}, 1)


def test_worker_lines_from_several_processes_are_collected(tmp_path, monkeypatch):
    echo = tmp_path / "worker.py"
    echo.write_text("import json, sys\njob = json.loads(sys.stdin.read())\n"
                    "for s in job['samples']:\n"
                    "    print(json.dumps({'id': s['id'], 'arm': 0, 'answers': ['x']}))\n"
                    "print('progress', file=sys.stderr)\n")
    monkeypatch.setattr(R, "WORKER", echo)
    lines = R.run_workers(Path(sys.executable),
                          {"samples": [{"id": i} for i in range(5)], "arms": []}, 2)
    assert sorted(x["id"] for x in lines) == [0, 1, 2, 3, 4]
