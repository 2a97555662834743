"""The well-behaved child processes of `kvedit bench soak`: one role each, one JSON line on
stdout at the end (the contract: common.py).

Run as `python -m kvedit.bench.soak.procs ROLE '<json config>'`. These use the KVClient (and
so torch, seconds to import: they say "ready" only after it); the attackers, raw protocol
only, are in attacks.py. Roles:
  worker    store / lookup / retrieve / delete of random keys, every chunk read checked
  laggard   a writer past the write TTL and a reader past the lease TTL (the fence)
  victim    prepares a store, takes a lease or stores in a loop, says so, waits for SIGKILL
  pinger    a small Hello every ~10 ms on its own socket: the control loop's latency
  watcher   a connector's key watch: every miss its copy answers is checked against the
            server; a key the server held ready while the copy, caught up past that lookup
            (KeyWatch.catch_up), still said "not there" is a wrong answer (the copy may only
            err towards "there")
"""
from __future__ import annotations

import json
import random
import time

import numpy as np
import torch

from kvedit import protocol as P
from kvedit.bench.soak.common import (LAYOUT, MODEL, Codes, RawPeer, Tally, expected, key,
                                      main, paced)
from kvedit.client import KVClient
from kvedit.client.handles import KVError


def chunk(k: bytes) -> torch.Tensor:
    return torch.from_numpy(expected(k).copy()).reshape(LAYOUT.chunk_shape)


def intact(k: bytes, t) -> bool:
    return np.array_equal(t.reshape(-1).numpy(), expected(k))


def client(cfg: dict, shm: bool) -> KVClient:
    c = KVClient(cfg["url"], use_shm=shm, timeout=cfg.get("timeout", 5.0),
                 secret_file=cfg.get("secret_file"))
    c.register(MODEL, LAYOUT)
    return c


def _guard(t: Tally, fn) -> None:
    try:
        fn()
    except KVError as e:
        t.error(e.code, str(e))
    except Exception as e:  # noqa: BLE001 - every failure is counted, named and kept
        t.error(f"exception:{type(e).__name__}", str(e))


def _read_and_check(t: Tally, c, keys: list[bytes], hold: float = 0.0) -> bool:
    """Retrieve, check every chunk (again after `hold` s), release. False: the lease expired
    (the server said so at release, so the bytes read are not to be used, and are not torn)."""
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
                c = client(cfg, cfg["shm"])
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
    rng = random.Random(cfg["seed"])
    t = Tally()
    late = {"late_commits_refused": 0, "late_commits_accepted": 0,
            "late_releases_refused": 0, "late_releases_accepted": 0}
    deadline = cfg["deadline"]
    c = None
    while time.time() + cfg["ttl"] + 1 < deadline and t.ops < cfg["max_ops"]:
        t.op_started = time.time()
        try:
            c = c or client(cfg, cfg["shm"])
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
    c = client(cfg, cfg["shm"])
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


def watcher(cfg: dict) -> dict:
    rng, codes = random.Random(cfg["seed"]), Codes()
    c = w = None
    for _ in paced(cfg, 20.0):
        try:
            if c is None:
                c = client(cfg, True)
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


ROLES = {"worker": worker, "laggard": laggard, "victim": victim, "pinger": pinger,
         "watcher": watcher}

if __name__ == "__main__":
    main(ROLES)
