"""More child roles of `kvedit bench soak`: the attackers of the red-team run of 2026-12-06,
run as `python -m kvedit.bench.soak_bounds ROLE '<json config>'` with kvedit.bench.soak_procs's
contract (ready line, go line, one JSON line at the end).

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

import json
import secrets
import socket
import sys
import threading
import time

import zmq

from kvedit import auth
from kvedit import protocol as P
from kvedit.bench.soak_attacks import _secret
from kvedit.bench.soak_procs import Codes, RawPeer, _paced, _reply_name, main
from kvedit.layout import ModelLayout

TINY = ModelLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", chunk_size=256)


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
    from kvedit.client.http_proof import NotProven, proven
    codes = Codes()
    host, port = cfg["http"]
    r = _Relay((host, port))
    secret = None
    try:
        for _ in _paced(cfg, 2.0):
            secret = _secret(cfg) or secret
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
    for _ in _paced(cfg, cfg.get("rate", 0.5)):
        r = peer.call(P.Register(model=model, layout=TINY), 5.0)
        if not isinstance(r, P.Ok):
            codes.add("register:" + _reply_name(r))
            continue
        for start in range(0, n, 256):
            keys = [secrets.token_bytes(16) for _ in range(256)]
            s = peer.call(P.PrepareStore(model=model, keys=keys), 5.0)
            if not isinstance(s, P.StoreSlots):
                codes.add("store:" + _reply_name(s))
                break
            peer.call(P.Commit(store_id=s.store_id), 5.0)
        r = peer.call(P.Unregister(model=model), 5.0)
        codes.add("unregistered" if isinstance(r, P.Count) else _reply_name(r))
    peer.call(P.Unregister(model=model), 5.0)
    peer.close()
    return codes.result()


def _long_names(peer: RawPeer, register: bool) -> None:
    """40 models with long names: the list of models is a reply of ~13 KB."""
    for i in range(40):
        name = f"soak-nr-{i:02d}-" + "n" * 240
        peer.call(P.Register(model=name, layout=TINY) if register else
                  P.Unregister(model=name), 5.0)


def _deaf_sockets(ctx: zmq.Context, cfg: dict, n: int = 10) -> list[zmq.Socket]:
    secret = _secret(cfg)
    out = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
        s.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(16) + bytes(4))
        if secret is not None:
            auth.curve_client(s, secret)
        s.connect(cfg["url"])
        out.append(s)
    return out


def nonreading(cfg: dict) -> dict:
    """A cut socket's client, not reading, never sees the cut (its libzmq stops reading
    once its one-message queue is full) and blocks on send: fresh sockets every 10 s, so
    each server instance meets some (and the models again after a restart)."""
    peer, codes = RawPeer(cfg), Codes()
    body = P.encoder.encode(P.ListModels())
    deaf: list[zmq.Socket] = []
    try:
        for n, _ in enumerate(_paced(cfg, 40.0)):
            if n % 400 == 0:
                _long_names(peer, True)
                for s in deaf:
                    s.close(linger=0)
                deaf = _deaf_sockets(peer.ctx, cfg)
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
    for _ in _paced(cfg, 20.0):
        if not ready:   # (again after a restart) its own object, never written, never read
            peers[0].call(P.Register(model=model, layout=TINY), 5.0)
            s = peers[0].call(P.PrepareStore(model=model, keys=[k]), 5.0)
            if isinstance(s, P.StoreSlots):
                peers[0].call(P.Commit(store_id=s.store_id), 5.0)
            ready = True
        for p in peers:
            r = p.call(P.Retrieve(model=model, keys=[k]), 5.0)
            name = _reply_name(r)
            codes.add(name)
            if name in ("unknown_model", "no_reply") or isinstance(r, P.Leased) and not r.count:
                ready = False
    for p in peers:
        p.close()
    return codes.result()


ROLES = {"relay": relay, "unregister": unregister, "nonreading": nonreading,
         "fewsessions": fewsessions}

if __name__ == "__main__":
    if sys.argv[1] == "relay":   # kvedit.client: torch, seconds to import before "ready"
        import kvedit.client  # noqa: F401
    main(sys.argv[1], json.loads(sys.argv[2]), ROLES)
