"""`kvedit server`: flags -> ServerConfig -> serve(). No heavy imports at module level."""
from __future__ import annotations

import argparse
import logging
import sys

from kvedit.server.config import EVICTION_POLICIES, ServerConfig


def register(sub) -> None:
    p = sub.add_parser("server", help="run the kvedit KV chunk server",
                       description="Host-memory KV chunk store: ZMQ control, shared-memory "
                                   "data, HTTP API.")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (ZMQ and HTTP)")
    p.add_argument("--port", type=int, default=6555, help="ZMQ port (default 6555)")
    p.add_argument("--http-port", type=int, default=8080, help="HTTP port (default 8080)")
    p.add_argument("--l1-size-gb", type=float, required=True,
                   help="pool size in GiB (host memory for KV chunks)")
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--eviction-policy", choices=EVICTION_POLICIES, default="LRU",
                   help="LRU, FIFO, or none (refuse stores when the pool is full)")
    p.add_argument("--shm-name", default="kvedit",
                   help="POSIX shared-memory segment holding the whole pool (/dev/shm/NAME); "
                        "'' = no shared memory, data travels over the socket")
    p.add_argument("--l1-use-lazy", action=argparse.BooleanOptionalAction, default=True,
                   help="lazy: memory is taken as it is used; --no-l1-use-lazy allocates and "
                        "pre-faults the whole pool at start")
    p.add_argument("--lease-ttl", type=float, default=300.0,
                   help="seconds a read lease lives if never released (default 300)")
    p.add_argument("--write-ttl", type=float, default=300.0,
                   help="seconds a prepared store lives if never committed (default 300)")


def run(args) -> int:
    from kvedit.server.main import serve

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ServerConfig(
        l1_size_gb=args.l1_size_gb, host=args.host, port=args.port, http_port=args.http_port,
        chunk_size=args.chunk_size, eviction_policy=args.eviction_policy,
        shm_name=args.shm_name, l1_use_lazy=args.l1_use_lazy, lease_ttl=args.lease_ttl,
        write_ttl=args.write_ttl)
    return serve(cfg)


if __name__ == "__main__":
    # `python -m kvedit.server.cli ...`: the launcher's entry, independent of other commands.
    parser = argparse.ArgumentParser(prog="kvedit server")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
