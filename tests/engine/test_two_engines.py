"""Two kvedit servers sharing one Redis, or one Redis Cluster: prefill on vLLM A, edit, decode
on vLLM B.

Runs examples/two_engines/prefill_edit_decode.py (real redis-server or a real 3+3 cluster, two
real servers, two real tiny-model vLLMs, one at a time so the 2-core machine holds them) and
checks: B's cached_tokens shows the edited prefix was loaded (through server B, from L2, with
B's connector watching B's keys: a chunk its copy lacks is still looked up), and B's output
equals a single-engine decode of the same edit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import shutil

import pytest

from kvedit.launch.redis import INSTALL_HINT, redis_server_path

pytest.importorskip("redis", reason="the `redis` client is missing: pip install -e '.[l2]'")
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(redis_server_path() is None, reason=INSTALL_HINT)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "two_engines" / "prefill_edit_decode.py"
CHUNK = 256


@pytest.mark.parametrize("tier", ["redis", "cluster"])
def test_prefill_on_a_edit_decode_on_b_through_l2(tiny_model, tier):
    if tier == "cluster" and shutil.which("redis-cli") is None:
        pytest.skip(INSTALL_HINT + " (a cluster needs redis-cli too)")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, str(EXAMPLE), "--reference", "--json",
                        "--model-dir", str(tiny_model), "--num-prompts", "2",
                        "--prompt-len", "1100", "--max-tokens", "12",
                        *(["--cluster"] if tier == "cluster" else [])],
                       capture_output=True, text=True, timeout=840, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["l2_scheme"] == ("redis+cluster" if tier == "cluster" else "redis")
    assert res["server_b_key_watches"] >= 1   # B's connector follows B's keys all along
    # DropMiddle(0.5) of 4 full chunks keeps 2: 512 edited tokens (+ the 76-token tail aside)
    assert res["edited_tokens"] == [2 * CHUNK, 2 * CHUNK]
    # B computed none of the edited prefix: every edited chunk came through server B
    assert res["decode_cached_tokens"] == [2 * CHUNK, 2 * CHUNK]
    b = res["server_b_l2"]
    assert b["hits"] == 4 and b["corrupt"] == 0 and b["errors"] == 0 and b["writes"] == 0
    a = res["server_a_l2"]
    assert a["write_dropped"] == 0 and a["errors"] == 0
    assert all(len(o) == 1 + 12 for o in res["two_engine_outputs"])   # prefill token + 12
    assert res["outputs_equal_single_engine"] is True
    assert res["two_engine_outputs"] == res["single_engine_outputs"]
