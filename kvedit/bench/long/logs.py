"""The connector's stats lines in vLLM's log, as `kvedit bench long` uses them: how often
it has them written (STATS_INTERVAL_S), how it makes the engine write its last counts
(`flush`), and the in-engine lines' last values (`stats`). The SDK arms read the store, load
and scheduler lines through kvedit.bench.serve.counters.
"""
from __future__ import annotations

import json
import re
import urllib.request

STATS = re.compile(r"kvedit: in-engine (worker )?stats (\{.*\})")


def stats(log_path) -> dict[str, dict]:
    """The last scheduler ("scheduler") and worker ("worker") stats lines in vLLM's log."""
    out: dict[str, dict] = {}
    if log_path is None:
        return out
    with open(log_path, errors="replace") as f:
        for line in f:
            m = STATS.search(line)
            if m:
                out["worker" if m[1] else "scheduler"] = json.loads(m[2])
    return out


# The connector's stats lines while the bench runs (its setting stats_interval_s): a line
# at every step (0) cost each step its log lines, part of what the arms measure. The final
# counts need no interval: the scheduler side and the workers log once their last budgeted
# request is gone (`flush` makes the engine take that step).
STATS_INTERVAL_S = 1.0


def flush(vllm_url: str, model: str) -> None:
    """One 1-token request, so the engine takes a step: the scheduler side and the workers
    log their counts once the last budgeted request's blocks were freed."""
    body = json.dumps({"model": model, "prompt": [101, 102, 103], "max_tokens": 1}).encode()
    req = urllib.request.Request(f"{vllm_url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()
