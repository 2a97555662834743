"""What a workload made a kvedit arm do: its server's counters (from /metrics) and its
connector's stats lines (from its vLLM's log), read before and after each workload.

A module of its own because both are read the same way (cumulative figures, a difference
around a workload) and neither needs an engine: tests read a real server and a log written
by the connector's own stats classes.
"""
from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvedit.bench.http import get_text
from kvedit.vllm.scheduler_stats import scheduler_counters
from kvedit.vllm.transfer.copier_stats import load_counters, store_counters

# The kvedit server's cumulative counters (its /metrics) that `measure` records per workload,
# so a run says what each workload made a kvedit arm store, load and evict (a store mode
# that defers its stores moves them into whichever workload comes next)
SERVER_COUNTERS = {"kvedit_store_bytes_total": "stored_bytes",
                   "kvedit_store_seconds_count": "stores",
                   "kvedit_retrieve_bytes_total": "retrieved_bytes",
                   "kvedit_hits_total": "hits", "kvedit_misses_total": "misses",
                   "kvedit_evictions_total": "evictions"}


def server_counters(http_url: str) -> dict[str, float]:
    """A kvedit server's SERVER_COUNTERS now (short names), from its /metrics."""
    text = get_text(http_url + "/metrics", timeout=10.0)
    return {SERVER_COUNTERS[s.name]: s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name in SERVER_COUNTERS}


def connector_counters(log_path) -> dict[str, dict[str, float]]:
    """A kvedit arm's connector stats now, from its vLLM log: the last scheduler, store and
    load stats lines (cumulative; the connector logs them every stats_interval_s)."""
    text = Path(log_path).read_text(errors="replace")
    return {"scheduler": scheduler_counters(text), "store": store_counters(text),
            "load": load_counters(text)}


def moved(now: dict[str, dict], before: dict[str, dict]) -> dict[str, dict]:
    """What the connector's stats moved by between two `connector_counters` readings, and
    the time in kvedit's scheduler hooks per engine step."""
    out = {}
    for part, values in now.items():
        old = before.get(part, {})
        out[part] = {k: round(v - old.get(k, 0.0), 3) for k, v in values.items()}
    sched = out.get("scheduler", {})
    if sched.get("steps"):
        sched["hooks_ms_per_step"] = round(sched["hooks_ms"] / sched["steps"], 4)
    return out
