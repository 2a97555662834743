"""Run a kvedit server: pool, ZMQ service, HTTP API; stop cleanly on SIGINT/SIGTERM."""
from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading

import zmq

from kvedit import rundir
from kvedit.server import l2_url
from kvedit.server.config import ServerConfig, is_loopback, redacted
from kvedit.server.pool import Arena, PoolError

log = logging.getLogger("kvedit.server")


def serve(cfg: ServerConfig, secret: bytes | None = None, exit_fd: int | None = None) -> int:
    """Blocks until SIGINT/SIGTERM (or `exit_fd` reaching its end). Returns the exit code.

    `secret` (kvedit.auth.load_secret) turns on CurveZMQ, the data-link handshake check and
    HTTP bearer tokens; cfg.authenticated must say whether it is set. `exit_fd`: the read
    end of a pipe only the launcher can write to; its end means the launcher is gone."""
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
        _hand_over_secret(cfg, secret)   # every port is bound: this server owns cfg.port
    except (zmq.ZMQError, OSError) as e:
        log.error("cannot start: %s (ZMQ port %d, HTTP port %d, data port %d)", e, cfg.port,
                  cfg.http_port, cfg.data_port)
        if http is not None:
            http.close()
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
    if exit_fd is not None:
        threading.Thread(target=_stop_when_closed, args=(exit_fd,), name="kvedit-launcher",
                         daemon=True).start()
    http.start()
    service.data.start()
    _log_start(cfg, instance, service.data.port, secret)
    if secret is None:
        who = "any local user" if is_loopback(cfg.host) else "anyone who reaches them"
        log.warning("--insecure: no secret; %s can read, change and delete every tenant's KV "
                    "through ports %d, %d and %d", who, cfg.port, service.data.port,
                    cfg.http_port)
    _warn_open_l2(cfg)
    if cfg.l2_url:
        log.info("second tier: %s, write-behind on %s (queue bound %g MiB), TTL %s, lookups "
                 "wait up to %g s for promotion", redacted(cfg.l2_url), cfg.l2_write_on,
                 cfg.l2_queue_bytes / 2**20, f"{cfg.l2_ttl:g} s" if cfg.l2_ttl else "none",
                 cfg.l2_lookup_wait)
    for note in arena.notes:
        log.info("note: %s", note)
    try:
        service.run(wakeup_fd=rsock.fileno())
    finally:
        # a secret made at start stays in the runtime directory: the next server on this
        # port reuses it, so clients (and --l2-mac records) survive a restart (rundir.py)
        signal.set_wakeup_fd(-1)
        http.close()
        service.close()
        arena.close()
        rsock.close()
        wsock.close()
        log.info("stopped; shared-memory segment %s", "unlinked" if cfg.shm_name else "n/a")
    return 0


def _log_start(cfg: ServerConfig, instance: int, data_port: int, secret: bytes | None) -> None:
    mode = (f"shm (segment /dev/shm/{cfg.shm_name}; data link for clients that cannot map it)"
            if cfg.shm_name else "socket only (no shared memory: --shm-name ''), data link")
    log.info("kvedit server %s: ZMQ tcp://%s:%d, HTTP http://%s:%d, data link port %d, "
             "pool %.2f GiB (%s), eviction %s, chunk %d tokens, transfer mode: %s, auth: %s",
             hex(instance), cfg.host, cfg.port, cfg.host, cfg.http_port, data_port,
             cfg.pool_bytes / 2**30, "lazy" if cfg.l1_use_lazy else "pre-faulted",
             cfg.eviction_policy, cfg.chunk_size, mode,
             f"shared secret ({cfg.secret_path or cfg.secret_file or 'environment'}): "
             f"CurveZMQ, data-link HMAC, HTTP token" if secret else "none (--insecure)")


def _stop_when_closed(fd: int) -> None:
    """Nothing is ever written to the pipe: a read returns only when the launcher's end is
    closed, i.e. the launcher is gone (however it ended). Then stop as on SIGTERM."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    log.info("the launcher is gone (its end of the pipe closed): shutting down")
    os.kill(os.getpid(), signal.SIGTERM)


def _hand_over_secret(cfg: ServerConfig, secret: bytes | None) -> None:
    """A secret made at start goes to the runtime directory for same-user clients; any other
    set-up removes a file an earlier server on this port left there (its clients would
    otherwise use a stale secret)."""
    if not cfg.secret_path:
        rundir.withdraw(cfg.port)
        return
    path = rundir.publish(cfg.port, secret)
    how = ("reused the secret an earlier server on this port left in" if cfg.secret_reused
           else "made a secret for this server and wrote it to")
    print(f"kvedit: no --secret-file given: {how} {path} (mode 0600; kept after a stop, so a "
          f"restart on this port keeps it; remove it to draw a new one); KVClient, the SDK "
          f"and the vLLM connector of this user find it there; give other clients "
          f"--secret-file {path} (or KVEDIT_SECRET_FILE); HTTP: 'Authorization: Bearer "
          f"$(cat {path})'", flush=True)
    if cfg.l2_mac and not cfg.secret_reused:
        log.warning("--l2-mac with a secret made at start (%s): L2 records signed by earlier "
                    "servers with another secret are misses now. The secret is kept in %s and "
                    "reused by the next server on port %d, so records stay valid from now on "
                    "(give --secret-file to share them with servers on other ports)",
                    "no earlier one to reuse", path, cfg.port)


def _warn_open_l2(cfg: ServerConfig) -> None:
    """A secret guards the doors of this server, but an L2 Redis that anyone can write lets
    them plant records that this server promotes (unless they are MAC'd, --l2-mac)."""
    if not (cfg.l2_url and cfg.authenticated) or cfg.l2_mac:
        return
    t = l2_url.parse(cfg.l2_url)
    if t.tls or t.password or not t.nodes:   # TLS, AUTH, or a Unix socket
        return
    log.warning("the L2 Redis %s has no password and no TLS: any local user who reaches it can "
                "write records this server promotes into L1 as they are, past the shared "
                "secret. Give Redis a password (requirepass; redis://:PASS@host) or TLS "
                "(rediss://), or pass --l2-mac so records carry an HMAC of the secret",
                redacted(cfg.l2_url))
