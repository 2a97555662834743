"""`kvedit bench modify` drives the real modify path and its arms do what they are named for.

A small run (2 streams x 4 chunks, a 4-layer layout, one repeat) in a fresh process, against
the server the bench starts: every default arm is reported with a modify_vs_memcpy ratio, and
the chunk counts of each arm are the ones its edit implies (exact, from the SDK's Metrics):
identity reuses every chunk and compares none (write tracking), drop_half and new_tensor
keep chunk 0 (same key) and store the moved last chunk under its new key, new_tensor's output
lies elsewhere so its kept chunk is byte-compared, and the replaced chunks are deleted. The
ratios themselves are not asserted (this host's load decides them; docs/sdk.md has figures).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # the whole command in a fresh interpreter (torch, a server, four arms)
def test_bench_modify_reports_every_arm_with_the_counts_its_edit_implies():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-m", "kvedit.cli", "bench", "modify", "--json",
                          "--streams", "2", "--tokens", "1024", "--layers", "4",
                          "--repeats", "1"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["config"]["tune_glibc_heap"] is False and r["config"]["fn_pool"] is None
    arms = ("identity", "drop_half", "new_tensor", "new_tensor_malloc")
    for arm in arms:
        assert r[arm]["modify_vs_memcpy"] > 0 and len(r[arm]["modify_vs_memcpy_all"]) == 1
        assert len(r[arm]["warmup_vs_memcpy"]) == 1   # the default warm-up, not in the median
    counts = {arm: (r[arm]["chunks_stored"], r[arm]["chunks_reused"],
                    r[arm]["chunks_deleted"], r[arm]["salt_changes"]) for arm in arms}
    assert counts == {"identity": (0, 8, 0, 0), "drop_half": (2, 2, 6, 0),
                      "new_tensor": (2, 2, 6, 0), "new_tensor_malloc": (2, 2, 6, 0)}
    if r["config"]["track_writes"]:
        assert r["identity"]["chunks_compared"] == 0 and r["drop_half"]["chunks_compared"] == 0
    assert r["new_tensor"]["chunks_compared"] == 2   # chunk 0 of each output, elsewhere
