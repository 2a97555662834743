"""`kvedit bench loop` against a real server started as every server is by default (a secret
of its own): it authenticates and reports every request kind. It hung on an unanswered
Register once servers made their own secret (no CURVE on its sockets, no deadline)."""
from __future__ import annotations

import json
import subprocess
import sys


def test_bench_loop_reports_every_kind_against_a_default_server():
    p = subprocess.run([sys.executable, "-m", "kvedit.cli", "bench", "loop", "--keys", "64",
                        "--seconds", "0.2", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["keys_per_request"] == 64
    for kind in ("idle", "lookup", "retrieve", "delete_absent"):
        assert out[kind]["hellos"] > 0 and out[kind]["hello_max_ms"] >= out[kind]["hello_p50_ms"]
    assert out["hello_after_oversized_message_ms"] > 0
