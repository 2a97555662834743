"""What every child process of `kvedit bench soak` shares: the model, the keys and their bytes,
the tallies, a raw protocol peer, and the child's contract with the parent.

Why a module of its own: the clients (procs.py, which load the KVClient and so torch) and
the attackers (attacks.py, raw protocol only, started in a second) both need these, and
neither may import the other. Light on purpose: numpy, zmq and the protocol, no torch.

The contract (`main`): a child is run as `python -m kvedit.bench.soak.procs ROLE '<json
config>'` (or `.attacks`), imports what it needs, prints {"ready": ROLE} and waits for one
JSON line on stdin (the rest of its config, with its `deadline`), so that slow imports on a
busy machine do not eat the run; at the end it prints one JSON line. Every loop is bounded
by `deadline` (time.time()) and an op count; the parent SIGKILLs what outlives it.
The secret: the `secret_file` given, else (a server that made its own) the file of the
server's port in the runtime directory, read again after a restart (kvedit.auth).
Each chunk's bytes derive from its key (`expected`), so any reader can verify any chunk.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import sys
import time

import numpy as np
import zmq

from kvedit import auth
from kvedit import protocol as P
from kvedit.layout import ModelLayout

MODEL = "soak"
# 64 KiB a chunk (2 x 2 layers x 256 tokens x 64 bytes): pools of a few MiB feel pressure
LAYOUT = ModelLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype="uint8", chunk_size=256)
# codes a healthy server gives a client of a busy, small pool with short TTLs
EXPECTED = frozenset({"pool_full", "store_expired", "lease_expired", "unknown_model"})
MAX_ODD = 50   # unexpected errors kept verbatim per process (all are counted)


def key(i: int) -> bytes:
    return hashlib.blake2b(f"soak/{i}".encode(), digest_size=16).digest()


def expected(k: bytes, nbytes: int = LAYOUT.chunk_bytes) -> np.ndarray:
    return np.frombuffer(hashlib.blake2b(k, digest_size=64).digest() * (nbytes // 64), np.uint8)


def secret_of(cfg: dict) -> bytes | None:
    """The server's secret for a child's config (read again on every call: a restart)."""
    return auth.SecretSource(None, cfg.get("secret_file"), url=cfg["url"]).read()


class Tally:
    def __init__(self):
        self.ops = 0
        self.errors: dict[str, int] = {}
        self.odd: list[list] = []     # [time, code, message] of codes outside EXPECTED
        self.odd_count = 0
        self.torn_reads = 0           # bytes that were not the key's, on a lease that held
        self.stale_detected = 0       # bad bytes on a lease the server said had expired
        self.chunks_checked = 0
        self.notes: dict[str, object] = {}
        self.by_kind: dict[str, int] = {}
        self.op_started = time.time()  # errors are dated by the start of their operation

    def error(self, code: str, message: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1
        if code not in EXPECTED:
            self.odd_count += 1
            if len(self.odd) < MAX_ODD:
                self.odd.append([round(self.op_started, 3), code, message[:200]])

    def result(self) -> dict:
        return {"ops": self.ops, "by_kind": self.by_kind, "errors": self.errors, "odd": self.odd,
                "odd_count": self.odd_count, "torn_reads": self.torn_reads,
                "stale_detected": self.stale_detected, "chunks_checked": self.chunks_checked,
                "notes": self.notes}


class Codes:
    """What an attacker's requests got: replies by type or error code, each with the times
    it happened (kept for the first few, to tell a server restart from a real failure)."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.when: dict[str, list[float]] = {}

    def add(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        times = self.when.setdefault(what, [])
        if len(times) < MAX_ODD:
            times.append(round(time.time(), 3))

    def result(self) -> dict:
        return {"counts": self.counts, "when": self.when}


def reply_name(r) -> str:
    return "no_reply" if r is None else r.code if isinstance(r, P.Error) else type(r).__name__


def paced(cfg: dict, rate: float):
    """Yield until the deadline, about `rate` times a second."""
    while time.time() < cfg["deadline"]:
        yield
        time.sleep(1.0 / rate)


class RawPeer:
    """A DEALER speaking the protocol directly (what an odd or hostile client can send)."""

    def __init__(self, cfg: dict):
        self.ctx = zmq.Context()
        self.session = secrets.token_bytes(auth.SESSION_BYTES)
        self.secret = secret_of(cfg)
        self.url = cfg["url"]
        self.sock = None
        self.rid = 0
        self.reset()

    def reset(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, self.session + (0).to_bytes(4, "big"))
        if self.secret is not None:
            auth.curve_client(self.sock, self.secret)
        self.sock.connect(self.url)

    def call(self, msg, timeout: float = 5.0):
        """The reply, or None when none came within `timeout` (then the socket is fresh)."""
        self.rid += 1
        rid = self.rid.to_bytes(8, "little")
        self.sock.send_multipart([rid, msg if isinstance(msg, bytes) else P.encoder.encode(msg)])
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0 and self.sock.poll(int(left * 1000) + 1):
            frames = self.sock.recv_multipart()
            if frames[0] == rid:
                return P.reply_decoder.decode(frames[1])
        self.reset()
        return None

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def deaf_socket(url: str, secret: bytes | None, ctx: zmq.Context | None = None) -> zmq.Socket:
    """A DEALER of a fresh session that will never read: its queue holds one message, its
    kernel buffer 4 KiB (a new context unless `ctx` is given)."""
    s = (ctx or zmq.Context()).socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(16) + bytes(4))
    if secret is not None:
        auth.curve_client(s, secret)
    s.connect(url)
    return s


def main(roles: dict) -> None:
    """A child's life (the module docstring): `roles[ROLE]` run with its config."""
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps({"ready": role}), flush=True)
    go = sys.stdin.readline()
    if not go:   # the parent is gone
        return
    print(json.dumps(roles[role](cfg | json.loads(go))), flush=True)
