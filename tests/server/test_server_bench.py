"""`kvedit bench transfer --json` runs end to end and prints the documented fields.

Speed is judged from the printed ratios by a person or CI job, never asserted here."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # the whole command in a subprocess: a server, both transfer modes
def test_bench_transfer_json():
    p = subprocess.run([sys.executable, "-m", "kvedit.cli", "bench", "transfer", "--json",
                        "--total-gb", "0.07", "--rounds", "1", "--batch", "1"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["chunk_mib"] == 36.0 and res["chunks"] == 1
    for k in ("memcpy_gbps", "tcp_gbps", "shm_store_gbps", "shm_retrieve_gbps",
              "socket_store_gbps", "socket_retrieve_gbps", "shm_store_vs_memcpy",
              "shm_retrieve_vs_memcpy", "socket_vs_tcp"):
        assert res[k] > 0, k
    assert isinstance(res["targets_met"], bool)
