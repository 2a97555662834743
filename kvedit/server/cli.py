"""`kvedit server`: flags -> ServerConfig -> serve(). No heavy imports at module level."""
from __future__ import annotations

import argparse
import logging
import sys

from kvedit.server.config import EVICTION_POLICIES, L2_WRITE_ON, ServerConfig, eviction_name

_D = ServerConfig(l1_size_gb=1.0)  # the defaults, shown in --help


def register(sub) -> None:
    p = sub.add_parser("server", help="run the kvedit KV chunk server",
                       description="Host-memory KV chunk store: ZMQ control, shared-memory "
                                   "data, HTTP API.")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=_D.host,
                   help="address every listener binds: the ZMQ control socket (--port), the "
                        "data link (--data-port) and the HTTP API (--http-port). A non-loopback "
                        "address needs a secret (--secret-file/--gen-secret) or --insecure")
    p.add_argument("--port", type=int, default=_D.port, help="ZMQ port (default 6555)")
    p.add_argument("--http-port", type=int, default=_D.http_port, help="HTTP port (default 8080)")
    p.add_argument("--data-port", type=int, default=_D.data_port,
                   help="data-link TCP port for socket-mode transfers (default 0: a free port, "
                        "announced to clients in ServerInfo)")
    p.add_argument("--l1-size-gb", type=float, required=True,
                   help="pool size in GiB (host memory for KV chunks)")
    p.add_argument("--chunk-size", type=int, default=_D.chunk_size,
                   help="tokens per chunk (default 256)")
    p.add_argument("--eviction", "--eviction-policy", dest="eviction_policy",
                   type=_eviction, default=_D.eviction_policy,
                   metavar="{" + ",".join(n.lower() for n in EVICTION_POLICIES) + "}",
                   help="which ready chunk a full pool evicts: lru (least recently used, the "
                        "default), fifo (oldest stored), arc (adaptive: recency vs reuse, a scan "
                        "of new prefixes does not flush the hot ones), or none (refuse stores "
                        "when the pool is full); any case; --eviction-policy is the old name")
    p.add_argument("--shm-name", default=_D.shm_name,
                   help="POSIX shared-memory segment holding the whole pool (/dev/shm/NAME); "
                        "'' = no shared memory, data travels over the socket")
    p.add_argument("--l1-use-lazy", action=argparse.BooleanOptionalAction, default=True,
                   help="lazy: memory is taken as it is used; --no-l1-use-lazy allocates and "
                        "pre-faults the whole pool at start")
    p.add_argument("--lease-ttl", type=float, default=_D.lease_ttl,
                   help="seconds a read lease lives if never released (default 300)")
    p.add_argument("--write-ttl", type=float, default=_D.write_ttl,
                   help="seconds a prepared store lives if never committed (default 300)")
    p.add_argument("--quarantine-ttl", type=float, default=_D.quarantine_ttl,
                   help="seconds the slots of an expired lease/store stay unused while their "
                        "late holder may still touch them (default 0 = 4 x the longer TTL)")
    g = p.add_argument_group("limits (every resource a client can make the server hold)")
    _add_limits(g)
    _add_deadlines(g)
    add_l2_arguments(p)
    p.add_argument("--exit-with-fd", type=int, default=None, metavar="FD",
                   help="stop when this inherited file descriptor (the read end of a pipe whose "
                        "write end only the launcher holds) reaches its end: the server dies "
                        "with its launcher, whichever thread started it (kvedit.launch)")
    a = p.add_argument_group("authentication (one shared secret for ZMQ, data link and HTTP)")
    a.add_argument("--secret-file", default=None,
                   help="file holding the shared secret (else $KVEDIT_SECRET, then "
                        "$KVEDIT_SECRET_FILE, else one made at start, see --insecure); with a "
                        "secret ZMQ uses CurveZMQ, the data link an HMAC handshake and HTTP a "
                        "bearer token")
    a.add_argument("--gen-secret", metavar="PATH", default=None,
                   help="write a new random secret to PATH (mode 0600, must not exist), print "
                        "the path and use it")
    a.add_argument("--insecure", action="store_true",
                   help="run without a secret: anyone who reaches the ports (any local user, "
                        "or anyone on the network with a non-loopback --host) can read, "
                        "change and delete every tenant's KV. Without --insecure and without "
                        "a secret the server makes one at start and writes it (mode 0600) to "
                        "$XDG_RUNTIME_DIR/kvedit/PORT.secret or /tmp/kvedit-UID/PORT.secret, "
                        "where clients of the same user find it")


def _add_limits(g) -> None:
    """The bounds of what a client can make the server hold (counts, bytes, shares)."""
    for name, hlp in (
            ("max_models", "registered (model, tp_rank) layouts"),
            ("max_model_name", "bytes of a model name"),
            ("max_keys_per_request", "keys in one lookup/store/retrieve/delete"),
            ("max_message_bytes", "bytes of one ZMQ message (libzmq drops the connection of "
                                  "a peer that sends more; 0: what --max-keys-per-request "
                                  "needs)"),
            ("max_waits_per_client", "parked lookups (wait_timeout > 0) of one client"),
            ("max_waits_total", "parked lookups of all clients"),
            ("max_parked_keys", "keys of all parked lookups together"),
            ("max_data_conns", "open data-link connections"),
            ("max_handshakes", "data-link connections that have not authenticated yet (at "
                               "most half of --max-data-conns; beyond, the oldest "
                               "unfinished handshake is closed)"),
            ("max_handshakes_per_peer", "data-link connections in handshake of one peer (a "
                                        "local user by uid, a remote address; not the "
                                        "server's own user)"),
            ("max_zmq_conns_per_peer", "ZMQ connections of one peer (a local user by uid, a "
                                       "remote address); beyond, a new one is shut at once"),
            ("max_watches", "key watches of all clients"),
            ("max_watches_per_client", "key watches of one client session"),
            ("max_query_bytes", "bytes of the largest captured-queries object (a store of a "
                                "bigger one is refused with too_large; 0: the largest the "
                                "query contract allows, 4096 rows of the model's queries)"),
            ("max_leases_per_client", "open (or quarantined) read leases of one client "
                                      "session (beyond: over_quota)"),
            ("max_leases_total", "read leases of all sessions"),
            ("max_stores_per_client", "pending (or quarantined) stores of one session"),
            ("max_stores_total", "pending stores of all sessions"),
            ("max_leased_keys_per_client", "objects kept by one session's leases (a key "
                                           "repeated in one retrieve counts once)"),
            ("max_leased_keys_total", "objects kept by all leases"),
            ("http_max_conns", "open HTTP connections (beyond: the oldest idle one is "
                               "closed, or the new one refused)"),
            ("http_max_conns_per_peer", "open HTTP connections of one peer (a local user, by "
                                        "uid; a remote address)"),
            ("http_max_requests", "HTTP requests in flight (beyond: 503; /health and "
                                  "requests with the bearer token are always served)")):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(_D, name),
                       help=f"{hlp} (default {getattr(_D, name)})")
    g.add_argument("--max-client-pool-fraction", type=float,
                   default=_D.max_client_pool_fraction,
                   help=f"fraction of the pool whose slots one client session's leases and "
                        f"pending stores may pin together (default "
                        f"{_D.max_client_pool_fraction})")
    g.add_argument("--max-client-total-share", type=float, default=_D.max_client_total_share,
                   help=f"fraction of each total cap (--max-leases-total, --max-stores-total, "
                        f"--max-leased-keys-total, --watch-queue-total-mb) one client session "
                        f"may hold, whatever its per-client cap says (default "
                        f"{_D.max_client_total_share})")
    g.add_argument("--quota-reserve", type=float, default=_D.quota_reserve,
                   help=f"fraction of each total cap and of the pool kept for client sessions "
                        f"that hold little: past it a session is admitted only while it holds "
                        f"at most --max-client-total-share of the reserve, so a few sessions "
                        f"cannot take a total from the rest (default {_D.quota_reserve}; 0: "
                        f"none)")
    g.add_argument("--fence-gone-sessions", action="store_true",
                   help="quarantine the slots of an expired store/lease even when its client "
                        "session had already disconnected (default: freed at expiry; see "
                        "docs/protocol.md, the fence)")


def _add_deadlines(g) -> None:
    """Deadlines (seconds) and the byte and rate bounds of the key watches and replies."""
    for name, hlp in (
            ("max_wait_seconds", "longest Lookup wait_timeout"),
            ("data_idle_timeout", "data link: close a connection idle this long between "
                                  "requests"),
            ("handshake_timeout", "data link: time for a new connection's handshake"),
            ("transfer_idle_timeout", "data link: cut a transfer that makes no progress "
                                      "this long"),
            ("transfer_timeout", "data link: cut a single PUT/GET that takes longer"),
            ("http_head_timeout", "HTTP: close a connection that has not sent a whole request "
                                  "head this long after it opened or after its last answer"),
            ("watch_ttl", "key watch: end one not renewed this long, or whose client left "
                          "what it was sent unacknowledged this long (then its connection "
                          "is cut)"),
            ):
        g.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(_D, name),
                       help=f"seconds: {hlp} (default {getattr(_D, name)})")
    for name, hlp in (
            ("watch_queue_mb", "MiB: key watch: sent to one watch and not acknowledged by its "
                               "client, at most (a snapshot waits; a push past it drops the "
                               "watch, whose client subscribes again)"),
            ("watch_queue_total_mb", "MiB: key watch: sent to all watches and not "
                                     "acknowledged, at most; one session holds at most "
                                     "--max-client-total-share of it, and over it the watch "
                                     "waiting longest is cut first"),
            ("http_new_conns_per_peer", "a rate: HTTP: new connections one peer may open a "
                                        "second (a burst of one second's worth); beyond, "
                                        "503 at accept. Never the server's own user; 0: no "
                                        "cap"),
            ("watch_subscribes_per_min", "a rate: key watch subscriptions one session may make "
                                         "a minute (a burst of 8)"),
            ("watch_slice_ms", "milliseconds: key watch: loop time a pass spends building "
                               "snapshots (they are sent in parts)"),
            ("reply_queue_mb", "MiB: replies queued for one client socket that the kernel "
                               "has not delivered (a client that does not read), at most; "
                               "beyond, its connection is cut"),
            ("reply_queue_total_mb", "MiB: ... for all client sockets together; beyond, the "
                                     "sockets holding the most are cut first")):
        g.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(_D, name),
                       help=f"{hlp} (default {getattr(_D, name):g})")


def _eviction(name: str) -> str:
    try:
        return eviction_name(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_l2_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("second tier on Redis or a Redis Cluster (docs/l2.md)")
    g.add_argument("--l2-url", default=_D.l2_url,
                   help="Redis/Valkey holding chunks under the pool: redis://[user:pass@]host:"
                        "port/db, rediss:// (TLS), unix://path, or a cluster: "
                        "redis+cluster://[user:pass@]h1:p1,h2:p2,... (rediss+cluster:// TLS; "
                        "valkey[s]:// spellings too) (default: off)")
    g.add_argument("--l2-prefix", default=_D.l2_prefix,
                   help=f"first part of every Redis key (default {_D.l2_prefix!r})")
    g.add_argument("--l2-ttl", type=float, default=_D.l2_ttl,
                   help="seconds a chunk lives in Redis (whole seconds; 0 = no expiry, let "
                        "Redis's maxmemory policy bound it)")
    g.add_argument("--l2-write-on", choices=L2_WRITE_ON, default=_D.l2_write_on,
                   help="write chunks behind when committed (default; other servers see them "
                        "at once) or only when L1 evicts them")
    g.add_argument("--l2-write-queue-mb", type=float, default=_D.l2_write_queue_mb,
                   help="bound of the write-behind backlog in MiB; beyond it the oldest writes "
                        "are dropped and counted (default 0: an eighth of the pool, at least "
                        "16 MiB and at most 1 GiB)")
    g.add_argument("--l2-lookup-wait", type=float, default=_D.l2_lookup_wait,
                   help=f"seconds a lookup without wait_timeout waits for chunks promoted from "
                        f"Redis (0: answer from L1 and promote in the background; default "
                        f"{_D.l2_lookup_wait:g}; keep it under the connector's timeout)")
    g.add_argument("--l2-timeout", type=float, default=_D.l2_timeout,
                   help=f"Redis socket timeout in seconds; past it Redis counts as down "
                        f"(default {_D.l2_timeout:g})")
    g.add_argument("--l2-mac", action="store_true",
                   help="write each record with an HMAC of the shared secret and promote only "
                        "records whose HMAC holds, so whoever can write to the Redis but lacks "
                        "the secret cannot plant a chunk (hashing costs ~0.5 GB/s per thread; "
                        "every server sharing the Redis needs the same secret)")


def config_from_args(args) -> ServerConfig:
    names = ("host", "port", "http_port", "data_port", "chunk_size", "eviction_policy",
             "shm_name", "l1_use_lazy", "lease_ttl", "write_ttl", "quarantine_ttl",
             "max_models", "max_model_name", "max_keys_per_request", "max_message_bytes",
             "max_waits_per_client", "max_waits_total", "max_parked_keys", "max_wait_seconds",
             "max_data_conns", "max_query_bytes", "data_idle_timeout", "handshake_timeout",
             "max_handshakes", "max_handshakes_per_peer", "max_client_total_share",
             "max_zmq_conns_per_peer", "reply_queue_mb", "reply_queue_total_mb",
             "max_watches", "max_watches_per_client", "watch_ttl", "watch_queue_mb",
             "watch_queue_total_mb", "watch_subscribes_per_min", "watch_slice_ms",
             "transfer_idle_timeout", "transfer_timeout", "insecure",
             "max_leases_per_client", "max_leases_total", "max_stores_per_client",
             "max_stores_total", "max_leased_keys_per_client", "max_leased_keys_total",
             "max_client_pool_fraction", "fence_gone_sessions", "quota_reserve",
             "http_max_conns", "http_max_conns_per_peer", "http_max_requests",
             "http_head_timeout", "http_new_conns_per_peer",
             "l2_url", "l2_prefix", "l2_ttl", "l2_write_on", "l2_write_queue_mb",
             "l2_lookup_wait", "l2_timeout", "l2_mac")
    return ServerConfig(l1_size_gb=args.l1_size_gb, **{n: getattr(args, n) for n in names})


def run(args) -> int:
    from kvedit import auth, rundir
    from kvedit.server.main import serve

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kvedit.server")
    cfg = config_from_args(args)
    try:
        if args.gen_secret:
            if args.secret_file:
                raise auth.AuthError("give --gen-secret or --secret-file, not both")
            secret = auth.generate_secret(args.gen_secret)
            cfg.secret_file = args.gen_secret
            print(f"kvedit: wrote a new secret to {args.gen_secret} (mode 0600); clients use it "
                  f"with --secret-file/KVEDIT_SECRET_FILE={args.gen_secret}", flush=True)
        else:
            secret = auth.load_secret(secret_file=args.secret_file)
            cfg.secret_file = args.secret_file or ""
        if secret is None and not args.insecure:   # secure by default (rundir.py)
            secret = _made_secret(cfg, log)
    except (auth.AuthError, rundir.RundirError) as e:
        log.error("cannot start: %s", e)
        return 2
    cfg.authenticated = secret is not None
    return serve(cfg, secret, exit_fd=args.exit_with_fd)


def _made_secret(cfg: ServerConfig, log) -> bytes:
    """The secret of a server started without one: the one an earlier server on this port
    left in the runtime directory (its clients, and L2 records it signed, keep working), or
    a new one. cfg says where it is and whether it was reused."""
    from kvedit import auth, rundir

    cfg.secret_path = str(rundir.ensure() / rundir.secret_path(cfg.port).name)
    path, why = rundir.reusable(cfg.port)
    if path is not None:
        try:
            secret = auth.load_secret(secret_file=path)
            cfg.secret_reused = True
            return secret
        except auth.AuthError as e:
            why = str(e)
    log.info("a new secret for this server: %s", why)
    return auth.make_secret()


if __name__ == "__main__":
    # `python -m kvedit.server.cli ...`: the launcher's entry, independent of other commands.
    parser = argparse.ArgumentParser(prog="kvedit server")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
