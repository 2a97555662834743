"""The attackers of `kvedit bench soak`, and the unlucky clients that stall or send too
much: one role each, run as `python -m kvedit.bench.soak.attacks ROLE '<json config>'` with
common.py's contract. Raw protocol, sockets and HTTP only (no KVClient, so no torch): each
starts in a second. Every role counts what it was answered (common.Codes); summary.py says
what each may get and must meet.

  stall       a raw data-link GET (or PUT) that stops reading (writing) half-way
  oversized   requests over the key limit and the message size, one of one-byte keys
  leaseflood  leases one key x the key limit in a loop, never releasing (meets over_quota)
  poolpin     prepares stores until refused (over_quota), commits and leases them, again
              and again: one session pinning all it may of the pool
  watchflood  re-subscribes a key watch twice a second and never reads (its queue holds one
              message, its kernel buffer 4 KiB), with renewals claiming it read everything:
              the server must keep what it queues for it bounded (RSS) and the loop quick
              (the pinger's Hello)
  handshakes  keeps 48 data-link connections in their handshake, never answering, topped up
              every second (a stranger without the secret, more than the server lets wait):
              no socket-mode client may get `busy`
  httpflood   unfinished HTTP request heads topped up, connections churned (a whole request,
              closed at once), /health probed (every probe answered), half-closed /status
              requests (answered)
  l2poison    plants records without the secret in the L2 Redis (never to be promoted)
  relay       a squatter on a free port that relays HTTP to the server (as one on a stopped
              server's port, or on [::1], would relay to a server sharing the secret), and a
              client with the secret that asks it to prove itself: every proof must be
              refused ("refused") and nothing relayed may hold the secret, its HTTP token or
              an Authorization header ("leaked" is never allowed)
  unregister  registers a model of its own, stores 2,048 objects (4 KiB, never written: its
              own model, nobody reads them) and unregisters it, over and over: the loop must
              go on answering (the pinger's Hello) while the objects go in slices
  nonreading  10 sockets (fresh ones every 10 s) that send requests with replies of ~13 KB
              (the list of 40 models with long names it registered) and never read: the
              server cuts each one past its reply bound instead of growing (its RSS is
              sampled by the soak)
  fewsessions 8 sessions that each lease one object of a model of its own over and over,
              never releasing, until refused (over_quota): together they reach the reserve
              line of the leases' total (the soak sets --max-leases-total 256), and no other
              client may be refused a lease for it (those get over_quota as unexpected)
"""
from __future__ import annotations

import random
import secrets
import socket
import threading
import time

import numpy as np
import zmq

from kvedit import auth
from kvedit import protocol as P
from kvedit import wire
from kvedit.bench.soak.common import (LAYOUT, MODEL, Codes, RawPeer, deaf_socket, key, main,
                                      paced, reply_name, secret_of)
from kvedit.layout import ModelLayout

TINY = ModelLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", chunk_size=256)


def stall(cfg: dict) -> dict:
    """Take a lease (GET) or a pending store (PUT), start its data-link transfer with a 4 KiB
    receive buffer, stop, and see whether the server cuts it and frees what it held."""
    peer = RawPeer(cfg)
    out: dict = {"kind": cfg["what"]}
    peer.call(P.Register(model=MODEL, layout=LAYOUT))
    rng = random.Random(cfg["seed"])
    # a GET must outgrow the server's socket send buffer (up to 8 MiB on Linux) to stall it
    n = cfg["stall_chunks"] if cfg["what"] == "get" else 32
    for _ in range(20):   # other clients' leases may hold the pool for a moment
        keys = [key(cfg["keys"] + rng.randrange(1 << 30)) for _ in range(n)]
        slots = peer.call(P.PrepareStore(model=MODEL, keys=keys))
        if isinstance(slots, P.StoreSlots):
            break
        time.sleep(0.1)
    else:
        return out | {"setup_failed": repr(slots)[:200]}
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    conn.settimeout(10)
    host = cfg["url"].rsplit("://", 1)[-1].rsplit(":", 1)[0]
    conn.connect((host, cfg["data_port"]))
    auth.client_handshake(conn, peer.secret, peer.session)
    payload = bytes(len(slots.missing) * LAYOUT.chunk_bytes)
    if cfg["what"] == "put":
        conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.PUT, slots.store_id, len(payload)))
        conn.sendall(payload[: len(payload) // 2])   # ... and the rest never comes
        ident = slots.store_id
    else:
        done = peer.call(P.Commit(store_id=slots.store_id))
        leased = peer.call(P.Retrieve(model=MODEL, keys=keys, with_data=True))
        if not isinstance(leased, P.Leased) or not isinstance(done, P.Committed):
            return out | {"setup_failed": f"{done!r} {leased!r}"[:200]}
        conn.sendall(wire.REQUEST.pack(wire.MAGIC, wire.GET, leased.lease_id, 0))
        out["chunks"] = leased.count
        ident = leased.lease_id
    t0 = time.monotonic()
    closed = False
    while time.monotonic() - t0 < cfg["stall_seconds"]:   # neither read nor write: stalled
        time.sleep(0.25)
    # Did the server give up on us? Drain: a cut connection ends in EOF (or a reset).
    conn.settimeout(1.0)
    try:
        while conn.recv(1 << 20):
            pass
        closed = True
    except (TimeoutError, socket.timeout):
        closed = False
    except OSError:
        closed = True
    conn.close()
    out["server_closed_it"] = closed
    late = peer.call(P.Commit(store_id=ident) if cfg["what"] == "put"
                     else P.Release(lease_id=ident))
    out["late_reply"] = late.code if isinstance(late, P.Error) else type(late).__name__
    peer.close()
    return out


def oversized(cfg: dict) -> dict:
    peer = RawPeer(cfg)
    peer.call(P.Register(model=MODEL, layout=LAYOUT))
    out = {}
    info = peer.call(P.Hello(protocol=P.PROTOCOL))
    many = P.Retrieve(model=MODEL, keys=[i.to_bytes(16, "little")
                                         for i in range(info.max_keys_per_request + 1)])
    r = peer.call(many, timeout=30)
    out["too_many_keys"] = r.code if isinstance(r, P.Error) else repr(r)[:100]
    cap = info.max_message_bytes
    tiny = P.encoder.encode(P.Lookup(model=MODEL, keys=[b"x"] * ((cap - 200) // 3)))
    t0 = time.perf_counter()
    r = peer.call(tiny, timeout=30)
    out["tiny_keys_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    out["tiny_keys"] = r.code if isinstance(r, P.Error) else repr(r)[:100]
    big = P.encoder.encode(P.Lookup(model=MODEL, keys=[bytes(16)])) + bytes(32 << 20)
    r = peer.call(big, timeout=10)   # over MAXMSGSIZE: libzmq drops us, no reply
    out["over_message_size"] = "no reply (dropped)" if r is None else (
        r.code if isinstance(r, P.Error) else repr(r)[:100])
    for _ in range(3):   # the server must still answer (a restart may be under way)
        hello = peer.call(P.Hello(protocol=P.PROTOCOL), timeout=5)
        if hello is not None:
            break
    out["hello_after"] = type(hello).__name__ if hello is not None else None
    peer.close()
    return out


def leaseflood(cfg: dict) -> dict:
    """Lease one ready key x the server's key limit, over and over, never releasing."""
    peer, codes = RawPeer(cfg), Codes()
    k = key(cfg["keys"] + (1 << 40))   # outside the workers' keys: its bytes are not checked
    flood = None
    for _ in paced(cfg, cfg.get("rate", 10.0)):
        if flood is None:
            info = peer.call(P.Hello(protocol=P.PROTOCOL), 2.0)
            if info is None:
                codes.add("no_reply")
                continue
            peer.call(P.Register(model=MODEL, layout=LAYOUT), 2.0)
            slots = peer.call(P.PrepareStore(model=MODEL, keys=[k]), 2.0)
            if isinstance(slots, P.StoreSlots):
                peer.call(P.Commit(store_id=slots.store_id), 2.0)
            flood = P.encoder.encode(P.Retrieve(model=MODEL,
                                                keys=[k] * info.max_keys_per_request))
        r = peer.call(flood, 5.0)
        codes.add(reply_name(r))
        if isinstance(r, P.Leased) and r.count == 0 or reply_name(r) in ("unknown_model",
                                                                          "no_reply"):
            flood = None   # evicted, or a restarted server: store it again
    peer.close()
    return codes.result()


def poolpin(cfg: dict) -> dict:
    """Prepare stores of fresh keys until the server refuses, then commit them and lease
    what was committed, and start again: all the pool one session may pin, all the time."""
    peer, codes = RawPeer(cfg), Codes()
    rng = random.Random(cfg["seed"])
    stores: list[tuple[int, list[bytes]]] = []
    leases: list[int] = []
    peer.call(P.Register(model=MODEL, layout=LAYOUT), 2.0)
    for _ in paced(cfg, cfg.get("rate", 20.0)):
        keys = [key(cfg["keys"] + (1 << 41) + rng.randrange(1 << 30)) for _ in range(8)]
        r = peer.call(P.PrepareStore(model=MODEL, keys=keys), 2.0)
        codes.add(reply_name(r))
        if isinstance(r, P.StoreSlots):
            stores.append((r.store_id, keys))
            continue
        if reply_name(r) == "unknown_model":
            peer.call(P.Register(model=MODEL, layout=LAYOUT), 2.0)
        done = []
        for sid, ks in stores:   # at its limit: publish and lease what it has, keep going
            c = peer.call(P.Commit(store_id=sid), 2.0)
            codes.add("commit:" + reply_name(c))
            if isinstance(c, P.Committed):
                done += ks
        stores = []
        for lid in leases:
            codes.add("release:" + reply_name(peer.call(P.Release(lease_id=lid), 2.0)))
        leases = []
        if done:
            lr = peer.call(P.Retrieve(model=MODEL, keys=done), 2.0)
            codes.add("retrieve:" + reply_name(lr))
            if isinstance(lr, P.Leased):
                leases.append(lr.lease_id)
    peer.close()
    return codes.result()


def watchflood(cfg: dict) -> dict:
    codes, s, epoch = Codes(), deaf_socket(cfg["url"], secret_of(cfg)), 0
    try:
        for _ in paced(cfg, 2.0):
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


def httpflood(cfg: dict) -> dict:
    """Unfinished request heads (70, topped up), /health probes, half-closed requests."""
    host, port = cfg["http"]
    headers = auth.bearer_header(auth.SecretSource(None, cfg.get("secret_file"),
                                                   url=cfg["url"]).read())
    codes, held = Codes(), []
    last_half = 0.0
    for _ in paced(cfg, 2.0):
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
    from kvedit.server.l2_redis import RedisChunks, layout_tag, redis_key   # redis: seconds
    rng, codes = random.Random(cfg["seed"]), Codes()
    poison = np.full(LAYOUT.chunk_bytes, 7, dtype=np.uint8)   # uint8: a byte an element
    tag = layout_tag(LAYOUT)
    for _ in paced(cfg, 2.0):
        rc = RedisChunks(cfg["l2_url"], timeout=2.0, mac_key=rng.choice([None, b"g" * 32]))
        try:
            rc.put(redis_key("kvedit", MODEL, tag, 0, key(rng.randrange(cfg["keys"]))), poison)
            codes.add("planted")
        except Exception as e:   # noqa: BLE001 - Redis restarting: counted, not fatal
            codes.add(f"redis:{type(e).__name__}")
        finally:
            rc.close()
    return codes.result()


class _Relay:
    """A TCP listener on a free loopback port piping every connection to `target` both
    ways, recording what clients send."""

    def __init__(self, target: tuple[str, int]):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.target, self.sent, self.down = target, bytearray(), 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:   # the server is restarting
                self.down += 1
                client.close()
                continue
            for a, b, rec in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, rec), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def relay(cfg: dict) -> dict:
    # kvedit.client loads torch (seconds): only this role pays for it, after "ready"
    from kvedit.client.http_proof import NotProven, proven
    codes = Codes()
    host, port = cfg["http"]
    r = _Relay((host, port))
    secret = None
    try:
        for _ in paced(cfg, 2.0):
            secret = secret_of(cfg) or secret
            try:
                conn, _ = proven(f"http://127.0.0.1:{r.port}", secret, timeout=5)
                conn.close()
                codes.add("proven_through_relay")   # never allowed
            except NotProven:
                codes.add("refused")
            except OSError:
                codes.add("relay_down")
    finally:
        r.close()
    sent = bytes(r.sent)
    if secret is not None and (secret in sent or auth.http_token(secret).encode() in sent
                               or b"authorization" in sent.lower()):
        codes.add("leaked")
    return codes.result() | {"relayed_bytes": len(sent)}


def unregister(cfg: dict) -> dict:
    peer, codes = RawPeer(cfg), Codes()
    model = f"soak-unreg-{secrets.token_hex(4)}"
    n = cfg.get("objects", 2048)
    for _ in paced(cfg, cfg.get("rate", 0.5)):
        r = peer.call(P.Register(model=model, layout=TINY), 5.0)
        if not isinstance(r, P.Ok):
            codes.add("register:" + reply_name(r))
            continue
        for start in range(0, n, 256):
            keys = [secrets.token_bytes(16) for _ in range(256)]
            s = peer.call(P.PrepareStore(model=model, keys=keys), 5.0)
            if not isinstance(s, P.StoreSlots):
                codes.add("store:" + reply_name(s))
                break
            peer.call(P.Commit(store_id=s.store_id), 5.0)
        r = peer.call(P.Unregister(model=model), 5.0)
        codes.add("unregistered" if isinstance(r, P.Count) else reply_name(r))
    peer.call(P.Unregister(model=model), 5.0)
    peer.close()
    return codes.result()


def _long_names(peer: RawPeer, register: bool) -> None:
    """40 models with long names: the list of models is a reply of ~13 KB."""
    for i in range(40):
        name = f"soak-nr-{i:02d}-" + "n" * 240
        peer.call(P.Register(model=name, layout=TINY) if register else
                  P.Unregister(model=name), 5.0)


def nonreading(cfg: dict) -> dict:
    """A cut socket's client, not reading, never sees the cut (its libzmq stops reading
    once its one-message queue is full) and blocks on send: fresh sockets every 10 s, so
    each server instance meets some (and the models again after a restart)."""
    peer, codes = RawPeer(cfg), Codes()
    body = P.encoder.encode(P.ListModels())
    deaf: list[zmq.Socket] = []
    try:
        for n, _ in enumerate(paced(cfg, 40.0)):
            if n % 400 == 0:
                _long_names(peer, True)
                for s in deaf:
                    s.close(linger=0)
                secret = secret_of(cfg)
                deaf = [deaf_socket(cfg["url"], secret, peer.ctx) for _ in range(10)]
            for s in deaf:
                try:
                    s.send_multipart([b"r", body], zmq.NOBLOCK)
                    codes.add("sent")
                except zmq.Again:
                    codes.add("send_blocked")
    finally:
        for s in deaf:
            s.close(linger=0)
        _long_names(peer, False)
        peer.close()
    return codes.result()


def fewsessions(cfg: dict) -> dict:
    codes = Codes()
    peers = [RawPeer(cfg) for _ in range(8)]
    model, k = f"soak-few-{secrets.token_hex(4)}", secrets.token_bytes(16)
    ready = False
    for _ in paced(cfg, 20.0):
        if not ready:   # (again after a restart) its own object, never written, never read
            peers[0].call(P.Register(model=model, layout=TINY), 5.0)
            s = peers[0].call(P.PrepareStore(model=model, keys=[k]), 5.0)
            if isinstance(s, P.StoreSlots):
                peers[0].call(P.Commit(store_id=s.store_id), 5.0)
            ready = True
        for p in peers:
            r = p.call(P.Retrieve(model=model, keys=[k]), 5.0)
            name = reply_name(r)
            codes.add(name)
            if name in ("unknown_model", "no_reply") or isinstance(r, P.Leased) and not r.count:
                ready = False
    for p in peers:
        p.close()
    return codes.result()


ROLES = {"stall": stall, "oversized": oversized, "leaseflood": leaseflood, "poolpin": poolpin,
         "watchflood": watchflood, "handshakes": handshakes, "httpflood": httpflood,
         "l2poison": l2poison, "relay": relay, "unregister": unregister,
         "nonreading": nonreading, "fewsessions": fewsessions}

if __name__ == "__main__":
    main(ROLES)
