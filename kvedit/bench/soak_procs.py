"""The child processes of `kvedit bench soak`: one role each, one JSON line on stdout at the end.

Run as `python -m kvedit.bench.soak_procs ROLE '<json config>'`: the child imports what it
needs, prints {"ready": ROLE} and waits for one JSON line on stdin (the rest of its config,
with its `deadline`), so that slow imports on a busy machine do not eat the run. Every loop
is bounded by `deadline` (time.time()) and an op count; the parent SIGKILLs what outlives it.
Roles:
  worker    store / lookup / retrieve / delete of random keys, every chunk read checked
  laggard   a writer past the write TTL and a reader past the lease TTL (the fence, item 2)
  victim    prepares a store, takes a lease or stores in a loop, says so, waits for SIGKILL
  pinger    a small Hello every ~10 ms on its own socket: the control loop's latency
  stall     a raw data-link GET (or PUT) that stops reading (writing) half-way
  oversized one request over the server's key limit, one over its message size, one as large
            as allowed made of one-byte keys
  leaseflood  leases one key x the key limit in a loop and never releases (must meet
            over_quota, and nothing else)
  poolpin   prepares stores until refused (over_quota), commits and leases them, again and
            again: one session pinning all it may of the pool
  httpflood, l2poison, watchflood, handshakes, watcher: kvedit/bench/soak_attacks.py;
  relay, unregister, nonreading, fewsessions: kvedit/bench/soak_bounds.py (each module has
            its own entry point)
The secret: the `secret_file` given, else (a server that made its own) the file of the
server's port in the runtime directory, read again after a restart (kvedit.auth).
Each chunk's bytes derive from its key (`expected`), so any reader can verify any chunk.
"""
from __future__ import annotations

import hashlib
import json
import random
import secrets
import socket
import sys
import time

import numpy as np
import zmq

from kvedit import auth
from kvedit import protocol as P
from kvedit import wire
from kvedit.bench.soak_summary import pct, thin  # noqa: F401  (used here and re-exported)
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


def chunk(k: bytes):
    import torch
    return torch.from_numpy(expected(k).copy()).reshape(LAYOUT.chunk_shape)


def intact(k: bytes, t) -> bool:
    return np.array_equal(t.reshape(-1).numpy(), expected(k))


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


def _client(cfg: dict, shm: bool):
    from kvedit.client import KVClient
    c = KVClient(cfg["url"], use_shm=shm, timeout=cfg.get("timeout", 5.0),
                 secret_file=cfg.get("secret_file"))
    c.register(MODEL, LAYOUT)
    return c


def _guard(t: Tally, fn) -> None:
    from kvedit.client.handles import KVError
    try:
        fn()
    except KVError as e:
        t.error(e.code, str(e))
    except Exception as e:  # noqa: BLE001 - every failure is counted, named and kept
        t.error(f"exception:{type(e).__name__}", str(e))


def _read_and_check(t: Tally, c, keys: list[bytes], hold: float = 0.0) -> bool:
    """Retrieve, check every chunk (again after `hold` s), release. False: the lease expired
    (the server said so at release, so the bytes read are not to be used, and are not torn)."""
    from kvedit.client.handles import KVError
    r = c.retrieve(MODEL, keys)
    bad = sum(not intact(k, x) for k, x in zip(keys, r.tensors))
    t.chunks_checked += len(r.tensors)
    if hold:
        time.sleep(hold)
        bad += sum(not intact(k, x) for k, x in zip(keys, r.tensors))
        t.op_started = time.time()   # the release is the call that may fail now
    try:
        r.release()
    except KVError as e:
        if e.code != "lease_expired":
            raise
        t.stale_detected += bad
        if bad:   # when: to tell a server restart from slots reused while quarantined
            t.notes.setdefault("stale_at", []).append(round(time.time(), 3))
        t.error(e.code, str(e))
        return False
    t.torn_reads += bad
    return True


def _idle_until(windows: list[list[float]]) -> float | None:
    """The end of the idle window now falls in, if any."""
    now = time.time()
    return next((end for start, end in windows if start <= now < end), None)


def worker(cfg: dict) -> dict:
    rng = random.Random(cfg["seed"])
    t = Tally()
    c = None
    deadline, nkeys = cfg["deadline"], cfg["keys"]
    while time.time() < deadline and t.ops < cfg["max_ops"]:
        if (end := _idle_until(cfg.get("idle_windows", []))) is not None:
            time.sleep(max(0.0, min(end, deadline) - time.time()))   # longer than the
            t.notes["idle_periods"] = t.notes.get("idle_periods", 0) + 1   # data link keeps
            continue
        if c is None:
            t.op_started = time.time()
            try:
                c = _client(cfg, cfg["shm"])
            except Exception as e:  # noqa: BLE001 - the server may be restarting
                t.error(f"connect:{getattr(e, 'code', type(e).__name__)}", str(e))
                time.sleep(0.2)
                continue
        # a run of consecutive keys, as a prompt's chunks are: retrieves then find prefixes
        start = rng.randrange(nkeys)
        keys = [key((start + j) % nkeys) for j in range(rng.randint(1, 8))]
        op = rng.choices(("store", "lookup", "retrieve", "delete"), (4, 3, 4, 1))[0]
        t.op_started = time.time()
        t.by_kind[op] = t.by_kind.get(op, 0) + 1
        if op == "store":
            _guard(t, lambda: c.store(MODEL, keys, [chunk(k) for k in keys]))
        elif op == "lookup":
            _guard(t, lambda: c.lookup(MODEL, keys))
        elif op == "retrieve":
            hold = rng.random() * 0.02 if rng.random() < 0.2 else 0.0
            _guard(t, lambda: _read_and_check(t, c, keys, hold))
        else:
            _guard(t, lambda: c.delete(MODEL, keys))
        t.ops += 1
    t.notes["stopped_at"] = round(time.time(), 3)
    t.notes["transport"] = "shm" if cfg["shm"] else "socket"
    if c is not None:
        t.notes["client_counters"] = c.counters()
        c.close()
    return t.result()


def laggard(cfg: dict) -> dict:
    """A writer that commits after its write TTL and a reader that releases after its lease
    TTL, while workers reuse the slots: the late writer must be refused (store_expired) and
    must not have corrupted anyone; the late reader must be told (lease_expired)."""
    from kvedit.client.handles import KVError
    rng = random.Random(cfg["seed"])
    t = Tally()
    late = {"late_commits_refused": 0, "late_commits_accepted": 0,
            "late_releases_refused": 0, "late_releases_accepted": 0}
    deadline = cfg["deadline"]
    c = None
    while time.time() + cfg["ttl"] + 1 < deadline and t.ops < cfg["max_ops"]:
        t.op_started = time.time()
        try:
            c = c or _client(cfg, cfg["shm"])
            keys = [key(cfg["keys"] + rng.randrange(1 << 30)) for _ in range(2)]
            h = c.prepare_store(MODEL, keys)
            time.sleep(cfg["ttl"] + 0.5)
            t.op_started = time.time()
            try:
                h.commit([chunk(k) for k in keys])
                late["late_commits_accepted"] += 1
            except KVError as e:
                late["late_commits_refused"] += e.code == "store_expired"
                t.error(e.code, str(e))
            old = [key(rng.randrange(cfg["keys"])) for _ in range(4)]
            if _read_and_check(t, c, old, hold=cfg["ttl"] + 0.5):
                late["late_releases_accepted"] += 1
            else:
                late["late_releases_refused"] += 1
        except KVError as e:
            t.error(e.code, str(e))
            c = None if e.code == "timeout" else c
        t.ops += 1
    t.notes.update(late)
    if c is not None:
        c.close()
    return t.result()


def victim(cfg: dict) -> dict:
    c = _client(cfg, cfg["shm"])
    rng = random.Random(cfg["seed"])
    keys = [key(rng.randrange(cfg["keys"])) for _ in range(8)]
    if cfg["what"] == "lease":
        c.store(MODEL, keys, [chunk(k) for k in keys])
        r = c.retrieve(MODEL, keys)
        print(json.dumps({"ready": "lease", "count": len(r)}), flush=True)
    elif cfg["what"] == "storing":   # killed in the middle of copying / sending chunk bytes
        many = [key(cfg["keys"] + rng.randrange(1 << 30)) for _ in range(32)]
        data = [chunk(k) for k in many]
        print(json.dumps({"ready": "storing"}), flush=True)
        while time.time() < cfg["deadline"]:
            c.store(MODEL, many, data)
            c.delete(MODEL, many)
    else:
        c.prepare_store(MODEL, [key(cfg["keys"] + rng.randrange(1 << 30)) for _ in range(8)])
        print(json.dumps({"ready": "store"}), flush=True)
    time.sleep(max(0.0, cfg["deadline"] - time.time()))  # until SIGKILL
    return {"killed": False}


class RawPeer:
    """A DEALER speaking the protocol directly (what an odd or hostile client can send)."""

    def __init__(self, cfg: dict):
        self.ctx = zmq.Context()
        self.session = secrets.token_bytes(auth.SESSION_BYTES)
        self.secret = auth.SecretSource(None, cfg.get("secret_file"), url=cfg["url"]).read()
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


def pinger(cfg: dict) -> dict:
    peer = RawPeer(cfg)
    samples, failures = [], []
    while time.time() < cfg["deadline"] and len(samples) < cfg["max_ops"]:
        sent, t0 = round(time.time(), 3), time.perf_counter()
        reply = peer.call(P.Hello(protocol=P.PROTOCOL), timeout=1.0)
        ms = (time.perf_counter() - t0) * 1e3
        (samples.append([sent, round(ms, 3)]) if reply is not None else failures.append(sent))
        time.sleep(max(0.0, 0.01 - ms / 1e3))
    peer.close()
    return {"samples": samples, "failures": failures}


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


def _reply_name(r) -> str:
    return "no_reply" if r is None else r.code if isinstance(r, P.Error) else type(r).__name__


def _paced(cfg: dict, rate: float):
    """Yield until the deadline, about `rate` times a second."""
    while time.time() < cfg["deadline"]:
        yield
        time.sleep(1.0 / rate)


def leaseflood(cfg: dict) -> dict:
    """Lease one ready key x the server's key limit, over and over, never releasing."""
    peer, codes = RawPeer(cfg), Codes()
    k = key(cfg["keys"] + (1 << 40))   # outside the workers' keys: its bytes are not checked
    flood = None
    for _ in _paced(cfg, cfg.get("rate", 10.0)):
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
        codes.add(_reply_name(r))
        if isinstance(r, P.Leased) and r.count == 0 or _reply_name(r) in ("unknown_model",
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
    for _ in _paced(cfg, cfg.get("rate", 20.0)):
        keys = [key(cfg["keys"] + (1 << 41) + rng.randrange(1 << 30)) for _ in range(8)]
        r = peer.call(P.PrepareStore(model=MODEL, keys=keys), 2.0)
        codes.add(_reply_name(r))
        if isinstance(r, P.StoreSlots):
            stores.append((r.store_id, keys))
            continue
        if _reply_name(r) == "unknown_model":
            peer.call(P.Register(model=MODEL, layout=LAYOUT), 2.0)
        done = []
        for sid, ks in stores:   # at its limit: publish and lease what it has, keep going
            c = peer.call(P.Commit(store_id=sid), 2.0)
            codes.add("commit:" + _reply_name(c))
            if isinstance(c, P.Committed):
                done += ks
        stores = []
        for lid in leases:
            codes.add("release:" + _reply_name(peer.call(P.Release(lease_id=lid), 2.0)))
        leases = []
        if done:
            lr = peer.call(P.Retrieve(model=MODEL, keys=done), 2.0)
            codes.add("retrieve:" + _reply_name(lr))
            if isinstance(lr, P.Leased):
                leases.append(lr.lease_id)
    peer.close()
    return codes.result()


ROLES = {"worker": worker, "laggard": laggard, "victim": victim, "pinger": pinger,
         "stall": stall, "oversized": oversized, "leaseflood": leaseflood,
         "poolpin": poolpin}

def main(role: str, cfg: dict, roles: dict = ROLES) -> None:
    if role in ("worker", "laggard", "victim"):   # the KVClient: torch, seconds to import
        import kvedit.client  # noqa: F401
    print(json.dumps({"ready": role}), flush=True)
    go = sys.stdin.readline()
    if not go:   # the parent is gone
        return
    print(json.dumps(roles[role](cfg | json.loads(go))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
