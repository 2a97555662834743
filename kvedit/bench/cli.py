"""`kvedit bench ...`: benchmarks that print one JSON object of ratios against a same-run baseline."""
from __future__ import annotations

import importlib

BENCH_MODULES = [
    "kvedit.bench.transfer",    # server: shm / socket vs memcpy / raw TCP
    "kvedit.bench.connector",   # connector: hit TTFT vs recompute, prefill with/without store
    "kvedit.bench.serve",       # serving: vs vLLM alone, vLLM's CPU offload, LMCache
    "kvedit.bench.modify",      # SDK: modify vs memcpy
    "kvedit.bench.dropping",    # headline: decode gain of DropMiddle vs its bound
    "kvedit.bench.long",        # long generations: decode gain of a per-stream KV budget
    "kvedit.bench.soak",        # hardening: minutes of mixed, hostile load; leaks, latency
    "kvedit.bench.index_costs", # server: index/allocator costs vs leased, holes, objects
    "kvedit.bench.loop",        # server: Hello latency while max-size requests run vs idle
    "kvedit.bench.l2",          # server: Redis second tier vs redis-py, write modes, L2-hit TTFT
    "kvedit.bench.repair",      # SDK: a question's TTFT with repair of its cache vs without
    "kvedit.bench.route",       # routing by KV events (vllm-router): cached share, TTFT per policy
]


def register(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print JSON")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name in BENCH_MODULES:
        importlib.import_module(name).register(bsub)
