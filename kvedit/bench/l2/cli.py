"""`kvedit bench l2`'s options (the package docstring says what it measures).

Light on purpose: the bench's modules (the KVClient and so torch, redis-py, the server and
Redis launchers) load only when the command runs.
"""
from __future__ import annotations

DESCRIPTION = "`kvedit bench l2`: the Redis second tier against plain redis-py on the same " \
              "bytes, same run."


def register(bsub) -> None:
    p = bsub.add_parser("l2", help="Redis second tier: write-behind / promotion vs redis-py, "
                        "write on commit vs evict, L2-hit TTFT", description=DESCRIPTION)
    p.add_argument("--chunks", type=int, default=16,
                   help="36 MiB chunks per round (default 16 = one 4096-token prompt)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per path; the best counts")
    p.add_argument("--vllm", action="store_true",
                   help="also l2_hit_ttft_vs_recompute with two tiny-model vLLMs (minutes)")
    p.add_argument("--cluster", action="store_true",
                   help="instead: a Redis Cluster (3 masters + --replicas each) against one "
                        "Redis in the same run: store/fetch ratios, keys per master, a "
                        "failover phase (a master SIGKILLed, one SIGSTOPped for 10 s, under "
                        "load); with --vllm also the L2-hit TTFT ratio "
                        "(kvedit/bench/l2/cluster.py)")
    p.add_argument("--replicas", type=int, default=1,
                   help="--cluster: replicas per master (default 1; 0: no failover phase)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from kvedit.bench.l2 import run

    return run.run(args)
