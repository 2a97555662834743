"""`kvedit bench soak`'s options (the package docstring says what it does).

Light on purpose: the bench's modules (the KVClient and so torch, the server launcher) load
only when the command runs.
"""
from __future__ import annotations

DESCRIPTION = "`kvedit bench soak`: minutes or hours of mixed, hostile and unlucky load on a " \
              "loopback server."


def register(bsub) -> None:
    p = bsub.add_parser("soak", help="minutes or hours of mixed, hostile load; leaks, torn "
                                     "reads, latency, memory", description=DESCRIPTION)
    p.add_argument("--minutes", type=float, default=3.0,
                   help="length of the mixed phase (default 3; fractions are fine)")
    p.add_argument("--hours", type=float, default=None,
                   help="length of the mixed phase in hours (instead of --minutes)")
    p.add_argument("--shm-clients", type=int, default=2)
    p.add_argument("--socket-clients", type=int, default=2)
    p.add_argument("--pool-mb", type=int, default=32,
                   help="pool size (default 32 MiB: half the working set)")
    p.add_argument("--keys", type=int, default=1024,
                   help="working set in 64 KiB chunks (default 1024 = 64 MiB)")
    p.add_argument("--ttl", type=float, default=2.0, help="lease and write TTL of the server")
    p.add_argument("--no-l2", action="store_true",
                   help="no L2 Redis (default: one, with --l2-mac, when redis-server exists)")
    p.add_argument("--scale-objects", type=int, default=1_000_000,
                   help="objects in the index for the scaling phase (0: skip it)")
    p.add_argument("--scale-seconds", type=float, default=180.0,
                   help="time budget to fill the index for the scaling phase")
    p.add_argument("--no-watch-phase", dest="watch_phase", action="store_false",
                   help="skip the key-watch phase on the scaling phase's server")
    p.add_argument("--watch-objects", type=int, default=262_144,
                   help="objects of the model 64 watches follow and DELETE /cache removes in "
                        "the key-watch phase (default 262144)")
    p.add_argument("--restart-vllm", action="store_true",
                   help="instead: restart the server (default secret) under a running vLLM "
                        "with the connector and an SDK client, and time their return "
                        "(kvedit/bench/soak/restart.py; starts vLLM: a minute or two)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from kvedit.bench.soak import run
    return run.run(args)
