"""`kvedit eval --reference kvpress --reference-site DIR` without kvpress: a site directory is
checked before use (a missing one, or one where kvpress does not import, is refused naming the
wheels it needs), its path reaches the worker first on PYTHONPATH of this interpreter, and
the worker (the real kvpress_worker.py, with a stand-in kvpress package in the site whose
pipeline only waits) stops starting samples at its deadline, every sample it started whole.
The real kvpress arm: tests/engine/test_kvpress_reference.py."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvedit.harness.eval import reference as R

pytestmark = pytest.mark.slow  # fresh interpreters


def fake_site(root, version="0.5.5", pipeline="") -> str:
    pkg = root / "kvpress"
    pkg.mkdir(parents=True)
    # the names the worker's shared path imports (kvpress_shared.py), as empty classes
    (pkg / "__init__.py").write_text("MARK = 'site'\nclass AdaKVPress: pass\n"
                                     "class KVzipPress: pass\n")
    (pkg / "presses").mkdir()
    (pkg / "presses" / "__init__.py").write_text("")
    (pkg / "presses" / "scorer_press.py").write_text("class ScorerPress: pass\n")
    (pkg / "pipeline.py").write_text(pipeline or "class KVPressTextGenerationPipeline: pass\n")
    info = root / f"kvpress-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvpress\nVersion: {version}\n")
    return str(root)


def test_a_missing_or_wrong_site_is_refused_with_the_wheels_it_needs(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist.*kvpress==0\.5\.5 transformers=="):
        R.runtime(str(tmp_path / "nope"))
    wrong = fake_site(tmp_path / "old", version="0.4.0")
    with pytest.raises(ValueError, match=r"(?s)does not import from .*0\.4\.0.*tokenizers=="):
        R.runtime(wrong)


def test_the_site_goes_first_on_the_workers_path(tmp_path, monkeypatch):
    site = fake_site(tmp_path / "site")
    monkeypatch.delenv(R.SITE_ENV, raising=False)
    rt = R.runtime(site)
    assert rt.python == R.Path(sys.executable) and rt.env == {"PYTHONPATH": site}
    monkeypatch.setenv(R.SITE_ENV, site)
    assert R.runtime(None).env == {"PYTHONPATH": site}   # the environment variable's
    echo = tmp_path / "worker.py"
    echo.write_text("import json, sys, kvpress\njob = json.loads(sys.stdin.read())\n"
                    "for s in job['samples']:\n"
                    "    print(json.dumps({'id': s['id'], 'arm': 0, 'answers': "
                    "[kvpress.__file__]}))\n")
    monkeypatch.setattr(R, "WORKER", echo)
    lines = R.run_workers(rt.python, {"samples": [{"id": 0}], "arms": []}, 1,
                          env_extra=rt.env)
    assert lines[0]["answers"][0].startswith(site)


SLOW_PIPELINE = """
import time
class KVPressTextGenerationPipeline:
    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
    def _forward(self, inputs, max_new_tokens, press, cache):
        time.sleep(0.3)
        return ["answer"]
"""


def test_the_worker_starts_no_sample_past_its_deadline(tmp_path, tiny_model):
    site = fake_site(tmp_path / "site", pipeline=SLOW_PIPELINE)
    arms = [{"press": None, "ratio": 0.0}, {"press": None, "ratio": 0.0}]
    samples = [{"id": i, "context": [5, 6, 7], "split": 0, "questions": [[8, 9]],
                "max_tokens": 2} for i in range(200)]
    deadline = time.time() + 40.0   # the imports and the model load come out of it
    # "alone": every arm through the pipeline's step (the stand-in's waits), not the shared
    # prefill
    run = subprocess.run([sys.executable, str(R.WORKER)], input=json.dumps(
        {"model_dir": str(tiny_model), "threads": 1, "deadline": deadline, "arms": arms,
         "samples": samples, "alone": True}), capture_output=True, text=True, timeout=300,
        env={**R.os.environ, "PYTHONPATH": site})
    assert run.returncode == 0, run.stderr[-2000:]
    assert time.time() < deadline + 5   # 200 samples x 2 arms x 0.3 s would take 120 s
    lines = [json.loads(x) for x in run.stdout.splitlines()]
    done = {x["id"] for x in lines}
    assert 0 < len(done) < 200 and "deadline" in run.stderr
    assert sorted(x["id"] for x in lines) == sorted(list(done) * 2)  # every arm of each
