"""More child roles of `kvedit bench soak`, run as `python -m kvedit.bench.soak_attacks ROLE
'<json config>'` with kvedit.bench.soak_procs's contract (ready line, go line, one JSON line
at the end): the HTTP, L2, key-watch and pre-authentication attackers, and a watcher that
checks its copy of the keys against the server.

  httpflood   unfinished HTTP request heads topped up, connections churned (a whole request,
              closed at once), /health probed (every probe answered), half-closed /status
              requests (answered)
  l2poison    plants chunk records without the secret in the L2 Redis (never promoted)

  watchflood  re-subscribes a key watch twice a second and never reads (its queue holds one
              message, its kernel buffer 4 KiB), with renewals claiming it read everything:
              the server must keep what it queues for it bounded (RSS) and the loop quick
              (the pinger's Hello)
  handshakes  keeps 48 data-link connections in their handshake, never answering, topped up
              every second (a stranger without the secret, more than the server lets wait):
              no socket-mode client may get `busy`
  watcher     a connector's key watch: every miss its copy answers is checked against the
              server; a key the server held ready while the copy, caught up past that lookup
              (KeyWatch.catch_up), still said "not there" is a wrong answer (the copy may only
              err towards "there")
"""
from __future__ import annotations

import json
import os
import random
import socket
import sys
import time

import zmq

from kvedit import auth
from kvedit import protocol as P
from kvedit.bench.soak_procs import LAYOUT, MODEL, Codes, _client, _paced, key, main


def _secret(cfg: dict) -> bytes | None:
    return auth.SecretSource(None, cfg.get("secret_file"), url=cfg["url"]).read()


def _deaf(cfg: dict) -> zmq.Socket:
    s = zmq.Context().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.setsockopt(zmq.ROUTING_ID, os.urandom(16) + bytes(4))
    secret = _secret(cfg)
    if secret is not None:
        auth.curve_client(s, secret)
    s.connect(cfg["url"])
    return s


def watchflood(cfg: dict) -> dict:
    codes, s, epoch = Codes(), _deaf(cfg), 0
    try:
        for _ in _paced(cfg, 2.0):
            epoch += 1
            try:
                s.send_multipart([b"w", P.encoder.encode(P.WatchKeys(
                    model=MODEL, tp_ranks=[0], epoch=epoch))], zmq.NOBLOCK)
                for seen in range(0, 64, 8):   # claims: "read all of it"
                    s.send_multipart([b"w", P.encoder.encode(P.WatchKeys(
                        model=MODEL, tp_ranks=[0], epoch=epoch, renew=True, seen=seen))],
                        zmq.NOBLOCK)
                codes.add("subscribed")
            except zmq.Again:   # its own queue is full: the server is not reading it either
                codes.add("send_blocked")
    finally:
        ctx = s.context
        s.close(linger=0)
        ctx.term()
    return codes.result()


def handshakes(cfg: dict) -> dict:
    codes, held = Codes(), []
    host = cfg["url"].rsplit("://", 1)[-1].rsplit(":", 1)[0]
    while time.time() < cfg["deadline"]:
        alive = []
        for c in held:
            try:
                if c.recv(4096) == b"":   # the nonce is read and thrown away
                    c.close()
                    codes.add("closed_by_server")
                    continue
            except BlockingIOError:
                pass
            except OSError:
                c.close()
                codes.add("closed_by_server")
                continue
            alive.append(c)
        held = alive
        while len(held) < 48 and time.time() < cfg["deadline"]:
            try:
                c = socket.create_connection((host, cfg["data_port"]), timeout=1)
                c.setblocking(False)
                held.append(c)
                codes.add("opened")
            except OSError:   # a restart under way
                codes.add("refused")
                break
        time.sleep(1.0)
    for c in held:
        c.close()
    return codes.result()


def watcher(cfg: dict) -> dict:
    rng, codes = random.Random(cfg["seed"]), Codes()
    c = w = None
    for _ in _paced(cfg, 20.0):
        try:
            if c is None:
                c = _client(cfg, True)
                w = c.watch_keys(MODEL, [0])
            w.sync()
            if not w.trusted:
                codes.add("untrusted")
                continue
            k = key(rng.randrange(cfg["keys"]))
            if not w.lacks([[k]], 0):   # the connector pins it (and so hears of a restart)
                lease, _ = c.pin(MODEL, [k])
                c.unpin(lease)
                codes.add("says_there")
                continue
            if c.lookup(MODEL, [k]) == 0:
                codes.add("miss_right")
                continue
            codes.add(_judge_miss(c, w, k))
        except Exception as e:   # noqa: BLE001 - a restart: counted, then a fresh client
            codes.add(f"error:{getattr(e, 'code', type(e).__name__)}")
            if c is not None:
                c.close()
            c = w = None
            time.sleep(0.2)
    if c is not None:
        c.close()
    return codes.result()


def _judge_miss(c, w, k, rounds: int = 3) -> str:
    """The copy said "not there" for a key the server then held. The push about it left
    before the lookup's answer: a renewal answered after the lookup is behind it on the
    watch's connection (catch_up). The pool is half the working set, so the key may also be
    evicted again meanwhile: a copy that lacks it is then right, and the server is asked
    again; only a copy behind a server that still holds it, round after round, is wrong."""
    for _ in range(rounds):
        if not w.catch_up(5.0):
            return "catch_up_slow"
        if not (w.trusted and w.lacks([[k]], 0)):
            return "miss_caught_up"
        if c.lookup(MODEL, [k]) == 0:
            return "miss_evicted_since"
    return "miss_wrong"


def httpflood(cfg: dict) -> dict:
    """Unfinished request heads (70, topped up), /health probes, half-closed requests."""
    host, port = cfg["http"]
    headers = auth.bearer_header(auth.SecretSource(None, cfg.get("secret_file"),
                                                   url=cfg["url"]).read())
    codes, held = Codes(), []
    last_half = 0.0
    for _ in _paced(cfg, 2.0):
        for _ in range(20):   # churned: a whole request, then gone at once
            try:
                with socket.create_connection((host, port), timeout=2) as c:
                    c.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
            except OSError:
                break
        held = [c for c in held if c.fileno() != -1]
        while len(held) < 70:
            try:
                c = socket.create_connection((host, port), timeout=2)
                c.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                held.append(c)
            except OSError:
                break
        if len(held) > 200:
            for c in held[:-70]:
                c.close()
            held = held[-70:]
        codes.add("health:" + _http_status(host, port, "GET /health", {}, half=False))
        if time.time() - last_half > 5:
            last_half = time.time()
            codes.add("half_closed_status:" + _http_status(host, port, "GET /status", headers,
                                                           half=True))
    for c in held:
        c.close()
    return codes.result()


def _http_status(host: str, port: int, line: str, headers: dict, half: bool) -> str:
    """The status code of one request on a fresh connection ('none' without an answer);
    `half`: shut our side down after the request."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    try:
        with socket.create_connection((host, port), timeout=5) as c:
            c.sendall(f"{line} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\r\n"
                      .encode())
            if half:
                c.shutdown(socket.SHUT_WR)
            head = c.recv(64)
    except OSError:
        return "none"
    parts = head.split()
    return parts[1].decode() if len(parts) > 1 and head.startswith(b"HTTP/") else "none"


def l2poison(cfg: dict) -> dict:
    """Plant records for workers' keys in the L2 Redis without the secret: a valid checksum
    in the plain format, or the MAC'd format with a guessed key. Any of them promoted would
    be a torn read in a worker."""
    import torch
    from kvedit.server.l2_redis import RedisChunks, layout_tag, redis_key
    rng, codes = random.Random(cfg["seed"]), Codes()
    poison = torch.full(LAYOUT.chunk_shape, 7, dtype=torch.uint8).numpy().reshape(-1)
    tag = layout_tag(LAYOUT)
    for _ in _paced(cfg, 2.0):
        rc = RedisChunks(cfg["l2_url"], timeout=2.0, mac_key=rng.choice([None, b"g" * 32]))
        try:
            rc.put(redis_key("kvedit", MODEL, tag, 0, key(rng.randrange(cfg["keys"]))), poison)
            codes.add("planted")
        except Exception as e:   # noqa: BLE001 - Redis restarting: counted, not fatal
            codes.add(f"redis:{type(e).__name__}")
        finally:
            rc.close()
    return codes.result()


ROLES = {"watchflood": watchflood, "handshakes": handshakes, "watcher": watcher,
         "httpflood": httpflood, "l2poison": l2poison}

if __name__ == "__main__":
    if sys.argv[1] == "watcher":   # the KVClient: torch, seconds to import before "ready"
        import kvedit.client  # noqa: F401
    main(sys.argv[1], json.loads(sys.argv[2]), ROLES)
