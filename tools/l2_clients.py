"""Which Redis Cluster client for chunk-sized values: the measurement behind docs/l2.md's choice.

SET and GET of --mib MiB values (default 36: one 256-token chunk of Qwen3-8B; 7 for
Qwen2.5-1.5B) on a throwaway 3-master + 3-replica cluster (kvedit.launch.redis_cluster), each
value under its own hash tag, per client: redis-py's RedisCluster, the `valkey` fork's
ValkeyCluster, valkey-glide's sync GlideClusterClient, and kvedit's own path (redis-py's slot
map, the payload sent from the caller's buffer and received into one: l2_redis.RedisChunks,
with its meta record and checksum). Medians of --rounds rounds, clients in turn each round.

    pip install valkey valkey-glide-sync      # optional: a client that is missing is skipped
    python tools/l2_clients.py --mib 36 --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _clients(ports: list[int], url: str) -> dict:
    """name -> (set(key, value), get(key) -> bytes-like, close)."""
    out = {}
    from redis.cluster import ClusterNode, RedisCluster
    rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in ports])
    out["redis-py RedisCluster"] = (rc.set, rc.get, rc.close)
    try:
        from valkey.cluster import ClusterNode as VNode
        from valkey.cluster import ValkeyCluster
        vc = ValkeyCluster(startup_nodes=[VNode("127.0.0.1", p) for p in ports])
        out["valkey ValkeyCluster"] = (vc.set, vc.get, vc.close)
    except ImportError:
        pass
    try:
        from glide_sync import GlideClusterClient, GlideClusterClientConfiguration, NodeAddress
        gc = GlideClusterClient.create(GlideClusterClientConfiguration(
            [NodeAddress("127.0.0.1", p) for p in ports], request_timeout=30000))
        out["valkey-glide-sync GlideClusterClient"] = (gc.set, gc.get, gc.close)
    except ImportError:
        pass
    out["kvedit l2_redis.RedisChunks"] = _kvedit(url)
    return out


def _kvedit(url: str):
    from kvedit.server.l2_redis import RedisChunks
    chunks, metas = RedisChunks(url, timeout=30), {}

    def put(k: bytes, v) -> None:
        chunks.put(k, v)

    def get(k: bytes):
        if k not in metas:
            metas[k] = chunks.probe([k])[0]   # once: the tier probes before it reads
        out = bytearray(metas[k].nbytes)
        if not chunks.read_into(k, metas[k], out):
            raise RuntimeError("kvedit read_into: checksum mismatch")
        return out
    return put, get, chunks.close


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=36)
    ap.add_argument("--values", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from kvedit.launch.redis_cluster import RedisClusterProcess

    vals = [os.urandom(args.mib << 20) for _ in range(args.values)]
    keys = [f"bench:{{v{i}}}".encode() for i in range(args.values)]
    times: dict[str, dict[str, list[float]]] = {}
    with RedisClusterProcess() as c:
        clients = _clients([m.port for m in c.masters()], c.url)
        for _ in range(args.rounds):
            for name, (set_, get, _close) in clients.items():
                t = times.setdefault(name, {"set": [], "get": []})
                t0 = time.perf_counter()
                for k, v in zip(keys, vals):
                    set_(k, v)
                t["set"].append((time.perf_counter() - t0) / len(keys))
                t0 = time.perf_counter()
                for k, v in zip(keys, vals):
                    if len(get(k)) != len(v):
                        raise RuntimeError(f"{name}: a value came back short")
                t["get"].append((time.perf_counter() - t0) / len(keys))
                c.flushall()
        for _set, _get, close in clients.values():
            close()
    mb = args.mib * (1 << 20) / 1e6
    out = {"value_MiB": args.mib, "values": args.values, "rounds": args.rounds,
           "clients": {n: {"set_ms": 1e3 * statistics.median(t["set"]),
                           "get_ms": 1e3 * statistics.median(t["get"]),
                           "set_MBps": mb / statistics.median(t["set"]),
                           "get_MBps": mb / statistics.median(t["get"])}
                       for n, t in times.items()}}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
