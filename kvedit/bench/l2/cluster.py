"""`kvedit bench l2 --cluster`: the second tier on a Redis Cluster against one Redis, same run.

One redis-server and one cluster (3 masters with --replicas each, kvedit.launch.redis_cluster)
run side by side on this machine; every figure divides the cluster's by the single Redis's,
measured in alternation (the order flips every round), medians of the rounds:
- cluster.store_vs_single: bytes/s of the write-behind (the writer's own time for one commit
  of --chunks 36 MiB chunks: live checks, hash, MULTI/EXEC on the slot's master);
- cluster.fetch_vs_single: bytes/s of promotion (a lookup on a server with an empty L1 that
  promotes every chunk from L2);
- cluster.keys_per_master: Redis keys on each master after storing 768 small chunks (payload
  and meta share a slot), and the largest deviation from their mean;
- cluster.ttft_vs_single (--vllm): the L2-hit TTFT of a 4096-token prompt prefilled on engine
  A and first seen by engine B through server B, cluster over single Redis;
- failover (failover.py): a master SIGKILLed under load, and another run with a
  master SIGSTOPped for 10 s: wrong bytes, client errors, the longest lookup, how soon L2
  serves again after the promotion.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from kvedit.bench.l2.failover import failover
from kvedit.bench.l2.paths import (ServerPair, qwen3_8b_layout, random_chunks, ttft_two_engines,
                                   wait_counter)
from kvedit.client import KVClient
from kvedit.launch.redis import RedisProcess
from kvedit.launch.redis_cluster import RedisClusterProcess
from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout


def run_cluster(args) -> dict:
    out: dict = {"chunks": args.chunks, "rounds": args.rounds, "replicas": args.replicas}
    with RedisProcess() as single, RedisClusterProcess(replicas=args.replicas,
                                                             maxmemory_mb=1024) as cluster:
        out["cluster"] = compare(single.url, cluster.url, args.chunks, args.rounds)
        out["cluster"]["keys_per_master"] = keys_per_master(cluster)
        if args.vllm:
            out["cluster"] |= ttft_vs_single(single.url, cluster.url)
        if args.replicas:
            runs = {mode: failover(cluster, mode) for mode in ("kill", "pause")}
            out["failover"] = {
                "wrong_bytes": sum(r["wrong_bytes"] for r in runs.values()),
                "client_errors": sum(r["client_errors"] for r in runs.values()),
                "longest_lookup_s": max(r["longest_lookup_s"] for r in runs.values()),
                "lookup_wait_s": runs["kill"]["lookup_wait_s"],
                "l2_serving_again_s": max(r["l2_serving_again_s"] for r in runs.values()),
                **runs}
    out["targets"] = {"cluster.store_vs_single": ">= 0.9", "cluster.fetch_vs_single": ">= 0.9",
                      "cluster.keys_per_master.max_deviation": "<= 0.25",
                      "failover.wrong_bytes": "0", "failover.client_errors": "0",
                      "failover.longest_lookup_s": "<= lookup_wait_s + 0.5",
                      "failover.l2_serving_again_s": "<= 5"}
    return out


def compare(single_url: str, cluster_url: str, n: int, rounds: int) -> dict:
    """Store and fetch on two server pairs, one per L2, alternating; medians of rounds."""
    layout = qwen3_8b_layout()
    data = random_chunks(layout, n)
    sides = {"single": single_url, "cluster": cluster_url}
    got: dict[str, dict[str, list]] = {s: {"store_s": [], "fetch_s": [], "until_in_l2_s": []}
                                       for s in sides}
    with ServerPair(single_url, layout, n) as ps, ServerPair(cluster_url, layout, n) as pc:
        pairs = {"single": ps, "cluster": pc}
        for r in range(rounds + 1):                 # round 0 warms both up and is not counted
            order = ("single", "cluster") if r % 2 else ("cluster", "single")
            for side in order:
                res = pairs[side].round(data)
                pairs[side].forget(res)
                if r:
                    for k in got[side]:
                        got[side][k].append(res[k])
    gb = n * layout.chunk_bytes / 1e9
    med = {s: {k: statistics.median(v) for k, v in d.items()} for s, d in got.items()}
    return {"chunk_bytes": layout.chunk_bytes,
            "store_vs_single": med["single"]["store_s"] / med["cluster"]["store_s"],
            "fetch_vs_single": med["single"]["fetch_s"] / med["cluster"]["fetch_s"],
            "single_write_GBps": gb / med["single"]["store_s"],
            "cluster_write_GBps": gb / med["cluster"]["store_s"],
            "single_promote_GBps": gb / med["single"]["fetch_s"],
            "cluster_promote_GBps": gb / med["cluster"]["fetch_s"],
            "single_until_in_l2_s": med["single"]["until_in_l2_s"],
            "cluster_until_in_l2_s": med["cluster"]["until_in_l2_s"],
            "seconds_by_round": got, "ratio_by_round": {
                "store": [a / b for a, b in zip(got["single"]["store_s"],
                                                got["cluster"]["store_s"])],
                "fetch": [a / b for a, b in zip(got["single"]["fetch_s"],
                                                got["cluster"]["fetch_s"])]}}


def keys_per_master(cluster, n: int = 768) -> dict:
    """Store n small chunks through a server and count each master's keys (DBSIZE)."""
    small = ModelLayout(num_layers=2, num_kv_heads=1, head_dim=32, dtype="bfloat16",
                        chunk_size=256)
    chunk = torch.zeros(small.chunk_shape, dtype=torch.bfloat16)
    cluster.flushall()
    args = ["--l2-url", cluster.url, "--l2-write-queue-mb", "128"]   # all of it queued at once
    with start_server(0.2, extra_args=args) as s, KVClient(s.url) as c:
        c.register("spread", small)
        for i in range(0, n, 64):
            c.store("spread", [os.urandom(16) for _ in range(64)], [chunk] * 64)
        wait_counter(c, "l2_writes", n)
    per = cluster.keys_per_master()
    mean = sum(per.values()) / len(per)
    cluster.flushall()
    return {"chunks": n, "keys": {f"127.0.0.1:{p}": k for p, k in per.items()},
            "mean": mean, "max_deviation": max(abs(k - mean) for k in per.values()) / mean}


def ttft_vs_single(single_url: str, cluster_url: str) -> dict:
    """The L2-hit TTFT (bench l2 --vllm's two-engine hand-off) through each L2."""
    print("kvedit bench l2 --cluster: L2-hit TTFT through one Redis", file=sys.stderr)
    t0 = time.monotonic()
    single = ttft_two_engines(single_url)
    print(f"... {time.monotonic() - t0:.0f} s; now through the cluster", file=sys.stderr)
    cluster = ttft_two_engines(cluster_url)
    return {"ttft_vs_single": cluster["l2_hit_ttft_median_s"] / single["l2_hit_ttft_median_s"],
            "single_l2_hit_ttft_median_s": single["l2_hit_ttft_median_s"],
            "cluster_l2_hit_ttft_median_s": cluster["l2_hit_ttft_median_s"],
            "cluster_l2_hit_cached_tokens": cluster["l2_hit_cached_tokens"],
            "single_recompute_ttft_median_s": single["recompute_ttft_median_s"],
            "cluster_recompute_ttft_median_s": cluster["recompute_ttft_median_s"]}
