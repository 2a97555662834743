"""`kvedit bench soak`'s phases in order and its targets: the mixed phase (mixed.py), then
the scaling phase (scale.py) on a server of its own, or instead the restart under vLLM
(restart.py); one JSON object, with the targets missed and those not measured.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from kvedit import auth
from kvedit.bench.soak.mixed import mixed_phase
from kvedit.bench.soak.restart import restart_under_vllm
from kvedit.bench.soak.scale import scaling_phase

TARGETS = {"torn_reads": 0, "leaked_slots": 0, "leaked_leases": 0, "unexpected_errors": 0,
           "hello_p99_ms": 50.0, "rss_growth_mb": 50.0, "scale_lookup_p99_ms": 50.0,
           "watch_attack_rss_growth_mb": 64.0, "watch_attack_hello_p99_ms": 50.0,
           "watched_delete_hello_max_ms": 50.0, "watch_loop_cpu_max_ms": 50.0,
           "evicting_store_hello_max_ms": 50.0, "unregister_hello_max_ms": 50.0}


def measure(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvedit-soak-") as tmp:
        secret_file = str(Path(tmp) / "secret")   # the scaling phase's server
        auth.generate_secret(secret_file)
        rundir = Path(tmp) / "run"                # the mixed phase's server makes its own
        rundir.mkdir(mode=0o700)
        logdir = Path(tmp) / "logs"
        logdir.mkdir()
        t0 = time.time()
        minutes = args.hours * 60 if args.hours is not None else args.minutes
        res = {"minutes": minutes, "shm_clients": args.shm_clients,
               "socket_clients": args.socket_clients, "pool_mb": args.pool_mb,
               "working_set_mb": args.keys * 64 // 1024, "ttl_s": args.ttl}
        res |= mixed_phase(args, rundir, logdir)
        if args.scale_objects:
            res["scaling"] = scaling_phase(args, secret_file)
        res["wall_s"] = round(time.time() - t0, 1)
    scale = res.get("scaling", {})
    watch = scale.get("watch", {})
    got = res | {"scale_lookup_p99_ms": res.get("scaling", {}).get("scale_lookup_p99_ms"),
                 "watch_attack_rss_growth_mb": watch.get("attacker", {}).get(
                     "rss_peak_growth_mb"),
                 "watch_attack_hello_p99_ms": watch.get("attacker", {}).get(
                     "hello_beside_attacker", {}).get("p99_ms"),
                 "watched_delete_hello_max_ms": watch.get("delete", {}).get(
                     "hello_during_delete", {}).get("max_ms"),
                 "watch_loop_cpu_max_ms": max((v for k, v in watch.get("loop_cpu", {}).items()
                                               if k.endswith("_ms")), default=None),
                 "evicting_store_hello_max_ms": scale.get("evicting_stores", {}).get(
                     "hello_during", {}).get("max_ms"),
                 "unregister_hello_max_ms": scale.get("unregister", {}).get(
                     "hello_during", {}).get("max_ms")}
    res["targets"] = TARGETS
    res["targets_not_measured"] = [k for k in TARGETS if got.get(k) is None]
    res["targets_missed"] = [k for k, v in TARGETS.items()
                             if got.get(k) is not None and got[k] > v]
    return res


def run(args) -> int:
    if args.restart_vllm:
        res = restart_under_vllm()
    else:
        res = measure(args)
    print(json.dumps(res) if args.json else json.dumps(res, indent=2))
    return 0
