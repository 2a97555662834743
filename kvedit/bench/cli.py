"""`kvedit bench ...`: benchmarks that print one JSON object of ratios against a same-run baseline."""
from __future__ import annotations

from kvedit.bench import (connector, dropping, index_costs, l2, long, loop, modify, repair, serve,
                          soak, transfer)

# Each bench's register(bsub), in the order `kvedit bench --help` lists them.
BENCHES = [
    transfer.register,            # server: shm / socket vs memcpy / raw TCP
    connector.register,           # connector: hit TTFT vs recompute, prefill with/without store
    serve.register,               # serving: vs vLLM alone, vLLM's CPU offload, LMCache
    modify.register,              # SDK: modify vs memcpy
    dropping.register,            # headline: decode gain of DropMiddle vs its bound
    long.register,                # long generations: decode gain of a per-stream KV budget
    soak.register,                # hardening: minutes of mixed, hostile load; leaks, latency
    index_costs.register,         # server: index/allocator costs vs leased, holes, objects
    loop.register,                # server: Hello latency while max-size requests run vs idle
    l2.register,                  # server: Redis second tier vs redis-py, write modes, L2-hit TTFT
    repair.register,              # SDK: a question's TTFT with repair of its cache vs without
    connector.register_route,     # routing by KV events (vllm-router): cached share, TTFT per policy
]


def register(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print JSON")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for add in BENCHES:
        add(bsub)
