"""Run a kvedit server: pool, ZMQ service, HTTP API; stop cleanly on SIGINT/SIGTERM."""
from __future__ import annotations

import logging
import secrets
import signal
import socket

import zmq

from kvedit.server.config import ServerConfig, is_loopback, redacted
from kvedit.server.pool import Arena, PoolError

log = logging.getLogger("kvedit.server")


def serve(cfg: ServerConfig, secret: bytes | None = None) -> int:
    """Blocks until SIGINT/SIGTERM. Returns the process exit code.

    `secret` (kvedit.auth.load_secret) turns on CurveZMQ, the data-link handshake check and
    HTTP bearer tokens; cfg.authenticated must say whether it is set."""
    from kvedit.server.http import HttpApi
    from kvedit.server.service import Service

    try:
        cfg.validate()
    except ValueError as e:
        log.error("%s", e)
        return 2
    instance = secrets.randbits(63)
    try:
        arena = Arena(cfg.pool_bytes, cfg.shm_name, cfg.l1_use_lazy, instance)
    except PoolError as e:
        log.error("cannot start: %s", e)
        return 1
    service = http = None
    try:
        service = Service(cfg, arena, instance, secret)
        http = HttpApi(service, cfg.host, cfg.http_port, secret=secret)
    except (zmq.ZMQError, OSError) as e:
        log.error("cannot start: %s (ZMQ port %d, HTTP port %d, data port %d)", e, cfg.port,
                  cfg.http_port, cfg.data_port)
        if service is not None:
            service.close()
        arena.close()
        return 1

    # A signal only sets a flag; the wakeup fd makes the ZMQ poll return immediately.
    rsock, wsock = socket.socketpair()
    wsock.setblocking(False)
    signal.set_wakeup_fd(wsock.fileno())

    def stop(signum, _frame):
        log.info("received %s: shutting down", signal.Signals(signum).name)
        service.stop_requested = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    http.start()
    service.data.start()
    mode = (f"shm (segment /dev/shm/{cfg.shm_name}; data link for clients that cannot map it)"
            if cfg.shm_name else "socket only (no shared memory: --shm-name ''), data link")
    log.info("kvedit server %s: ZMQ tcp://%s:%d, HTTP http://%s:%d, data link port %d, "
             "pool %.2f GiB (%s), eviction %s, chunk %d tokens, transfer mode: %s, auth: %s",
             hex(instance), cfg.host, cfg.port,
             cfg.host, cfg.http_port, service.data.port, cfg.pool_bytes / 2**30,
             "lazy" if cfg.l1_use_lazy else "pre-faulted", cfg.eviction_policy,
             cfg.chunk_size, mode,
             f"shared secret ({cfg.secret_file or 'environment'}): CurveZMQ, data-link HMAC, "
             f"HTTP bearer" if secret else "none (loopback only unless --insecure)")
    if secret is None and not is_loopback(cfg.host):
        log.warning("--insecure: listening on %s without a secret; anyone who reaches ports "
                    "%d, %d and %d can read, change and delete every tenant's KV", cfg.host,
                    cfg.port, service.data.port, cfg.http_port)
    if cfg.l2_url:
        log.info("second tier: %s, write-behind on %s (queue bound %g MiB), TTL %s, lookups "
                 "wait up to %g s for promotion", redacted(cfg.l2_url), cfg.l2_write_on,
                 cfg.l2_write_queue_mb, f"{cfg.l2_ttl:g} s" if cfg.l2_ttl else "none",
                 cfg.l2_lookup_wait)
    for note in arena.notes:
        log.info("note: %s", note)
    try:
        service.run(wakeup_fd=rsock.fileno())
    finally:
        signal.set_wakeup_fd(-1)
        http.close()
        service.close()
        arena.close()
        rsock.close()
        wsock.close()
        log.info("stopped; shared-memory segment %s", "unlinked" if cfg.shm_name else "n/a")
    return 0
