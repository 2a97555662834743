"""`kvedit bench serve`: kvedit against what a user would run instead, same engine, same bytes.

Arms, one after another on the same model and vLLM, each with the same vLLM KV cache (a
fraction of the live working set, so vLLM must evict) and the same CPU-tier bytes (the rest
of the working set times --tier-fraction):
- vllm: vLLM alone (its prefix cache only);
- native: vLLM's own CPU offload (`--kv-offloading-backend native --kv-offloading-size`,
  the OffloadingConnector), and native_simple (the same with VLLM_USE_SIMPLE_KV_OFFLOAD=1,
  the SimpleCPUOffloadConnector);
- lmcache: vLLM + LMCache's connector (LMCacheConnectorV1, local CPU backend of that size),
  run with --lmcache-python (an interpreter where lmcache imports beside this vLLM);
- kvedit_eager, kvedit_evict, kvedit_reuse: vLLM + the kvedit connector in each store mode
  and a kvedit server whose pool is the tier.
An arm that cannot start says why (the root-cause line of vLLM's log) in the JSON instead of
figures; one that serves without its cache (LMCache's "degraded mode") keeps its figures,
says why, and is not counted as a peer. Every arm is up at once and the workloads alternate
between them, so load from other work hits all arms alike. Workloads (workloads.py):
long-document QA, multi-round QA, no-reuse random prompts; vLLM's prefix cache is reset
between them. The JSON gives each arm's figures, the ratios against vLLM alone and against
the best peer arm (native, native_simple, lmcache: whichever ran best), and the acceptance
fields (`half_tier`, `no_reuse`, `multi_round`), where "kvedit" is the connector's default
store mode. Each kvedit arm's workload figures also hold "server": what its kvedit server
stored, loaded, hit, missed and evicted during that workload (its /metrics counters before
and after), and "connector": what the connector's stats lines in its vLLM log moved by
(time in kvedit's scheduler hooks, store and load time in vLLM's thread). --repeats
measures again with new prompts and reports medians; the machine's load average is recorded
beside each run.

The modules: cli (options; light, the rest loads when the command runs), run (start to
end: sizes, the arms up, the workloads measured in alternation, --deadline-s, --out), arms
(how each arm starts, why one could not), workloads (what is sent, and the sizes it implies),
counters (what a workload made a kvedit arm's server and connector do), figures (medians,
ratios, acceptance, the JSON). HTTP goes through kvedit.bench.http.
"""
from __future__ import annotations

import importlib

from kvedit.bench.serve.cli import register

# Names the bench had when it was one module, still used from outside this package
# (tests/server/test_bench_serve_counters.py): loaded on first use, so `kvedit bench` stays
# light. Import them from the module named here instead; the table shrinks as they move.
_MOVED = {"SERVER_COUNTERS": "kvedit.bench.serve.counters",
          "server_counters": "kvedit.bench.serve.counters"}

__all__ = ["register"]


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MOVED[name]), name)
