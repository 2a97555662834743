"""The failover phase of `kvedit bench l2 --cluster`: a master of the L2 cluster fails under
load (SIGKILL, or SIGSTOP for 10 s), its replica is promoted by the cluster, and nothing the
clients see may go wrong.

Load, on two kvedit servers with default L2 settings sharing the cluster: client W stores
batches of two 7 MiB chunks (Qwen2.5-1.5B-shaped) on server A every 0.25 s, each chunk's bytes
derived from its key; client R looks up on server B (whose L1 starts empty, so lookups fall
through to the cluster) the batch W stored a second before and a key stored nowhere, retrieves
what it finds and compares it byte for byte. Every lookup is timed; every exception is a client
error. After the run a fresh server promotes every stored batch and compares again.
Reported: wrong_bytes, client_errors, longest_lookup_s (vs lookup_wait_s), replaced_after_s
(failure to promotion, as the cluster reports it), l2_serving_again_s (promotion, or the
paused node's resumption when that came later, to both servers' tier being up again).
"""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.request

import torch

from kvedit.client import KVClient
from kvedit.launch.server import start_server
from kvedit.layout import ModelLayout

PAUSE_S = 10.0
LOAD_AFTER_S = 3.0


def _layout():
    return ModelLayout(num_layers=28, num_kv_heads=2, head_dim=128, dtype="bfloat16",
                       chunk_size=256)


def _content(k: bytes, nbytes: int):
    """A chunk's bytes, derived from its key (a torn or swapped read shows)."""
    return torch.frombuffer(bytearray(k * (nbytes // len(k))), dtype=torch.uint8)


def _wrong(k: bytes, t) -> int:
    got = t.reshape(-1).view(torch.uint8)
    want = _content(k, got.numel())
    return int((got != want).sum())


class _Load:
    """W stores on A, R looks up on B what W stored a second before (see module doc)."""

    def __init__(self, a_url: str, b_url: str, layout):
        self.a_url, self.b_url, self.layout = a_url, b_url, layout
        self.stop = threading.Event()
        self.stored: list[tuple[float, list[bytes]]] = []
        self.lookups: list[float] = []
        self.errors: list[str] = []
        self.wrong = 0
        self.threads = [threading.Thread(target=self._guard, args=(f,), daemon=True)
                        for f in (self._write, self._read)]

    def _guard(self, f) -> None:
        try:
            f()
        except Exception as e:   # any exception a client sees is a client error
            self.errors.append(f"{type(e).__name__}: {e}")

    def _write(self) -> None:
        nbytes = self.layout.chunk_bytes
        with KVClient(self.a_url, timeout=30) as w:
            w.register("fo", self.layout)
            while not self.stop.is_set():
                keys = [os.urandom(16) for _ in range(2)]
                w.store("fo", keys, [_content(k, nbytes).view(self._dtype())
                                     .view(self.layout.chunk_shape) for k in keys])
                self.stored.append((time.monotonic(), keys))
                time.sleep(0.25)   # 2 chunks every 0.25 s: ~56 MB/s into the cluster

    def _dtype(self):
        return getattr(torch, self.layout.dtype)

    def _read(self) -> None:
        with KVClient(self.b_url, timeout=30) as r:
            r.register("fo", self.layout)
            i = 0
            while not self.stop.is_set():
                ready = [s for s in self.stored[i:] if time.monotonic() - s[0] > 1.0]
                if not ready:
                    time.sleep(0.02)
                    continue
                i += len(ready)
                keys = ready[-1][1]
                n = self._timed(r, keys)
                self._timed(r, [os.urandom(16)])   # stored nowhere: a miss in both tiers
                if n:
                    with r.retrieve("fo", keys[:n]) as got:
                        self.wrong += sum(_wrong(k, t) for k, t in zip(keys, got.tensors))


    def _timed(self, client, keys: list[bytes]) -> int:
        t0 = time.monotonic()
        n = client.lookup("fo", keys)
        self.lookups.append(time.monotonic() - t0)
        return n


class _UpWatch(threading.Thread):
    """The servers' l2_up every 20 ms: when the tier went down and came back on each."""

    def __init__(self, urls: list[str]):
        super().__init__(daemon=True)
        self.urls, self.stop = urls, threading.Event()
        self.down_at: dict[str, float] = {}
        self.went_up: dict[str, float] = {}
        self.down_nodes: dict[str, list] = {}

    def settled(self) -> bool:
        """Some server saw the outage, and every one that did is up again."""
        return bool(self.down_at) and all(self.went_up.get(u, 0) > t
                                          for u, t in self.down_at.items())

    def run(self) -> None:
        clients = [KVClient(u) for u in self.urls]
        up = {u: True for u in self.urls}
        try:
            while not self.stop.is_set():
                for u, c in zip(self.urls, clients):
                    st = c.stats()
                    if st["l2_down_nodes"]:
                        self.down_nodes[u] = sorted(st["l2_down_nodes"])
                    now = st["l2_up"] == 1
                    if now != up[u]:
                        (self.went_up if now else self.down_at)[u] = time.monotonic()
                    up[u] = now
                time.sleep(0.02)
        finally:
            for c in clients:
                c.close()


def failover(cluster, mode: str) -> dict:
    """One failure under load: mode "kill" (SIGKILL, restarted once replaced) or "pause"
    (SIGSTOP for PAUSE_S, then SIGCONT)."""
    layout = _layout()
    cluster.wait_ok()
    cluster.flushall()
    args = ["--l2-url", cluster.url]
    with start_server(0.5, extra_args=args) as a, start_server(0.5, extra_args=args) as b:
        load, watch = _Load(a.url, b.url, layout), _UpWatch([a.url, b.url])
        lookup_wait = _get_json(a.http_url + "/config")["l2_lookup_wait"]
        for t in load.threads:
            t.start()
        try:
            time.sleep(3.0)
            victim = cluster.masters()[0]
            watch.start()
            t_fail = time.monotonic()
            (victim.kill if mode == "kill" else victim.pause)()
            replaced_after = cluster.wait_replaced(victim, timeout=60)
            t_promoted = time.monotonic()
            if mode == "kill":
                victim.start()                     # rejoins as a replica, empty
                t_back = t_promoted
            else:
                time.sleep(max(0.0, t_fail + PAUSE_S - time.monotonic()))
                victim.resume()
                t_back = time.monotonic()
            _until(watch.settled, 60)
            time.sleep(LOAD_AFTER_S)
        finally:
            load.stop.set()
            watch.stop.set()
            for t in [*load.threads, watch]:
                if t.ident is not None:
                    t.join(60)
        cluster.wait_ok(60)
        stats = {"a": _l2_counters(a), "b": _l2_counters(b)}
        _until(lambda: _l2_counters(a)["l2_queue_depth"] == 0, 60)
    wrong_after = _verify(cluster.url, layout, [k for _, ks in load.stored for k in ks])
    up_at = max(watch.went_up.values())
    return {"mode": mode, "victim": f"127.0.0.1:{victim.port}",
            "wrong_bytes": load.wrong + wrong_after["wrong_bytes"],
            "client_errors": len(load.errors), "errors": load.errors[:5],
            "longest_lookup_s": max(load.lookups), "lookup_wait_s": lookup_wait,
            "lookups": len(load.lookups), "chunks_stored": 2 * len(load.stored),
            "replaced_after_s": replaced_after,
            "l2_serving_again_s": up_at - t_promoted,
            "l2_serving_again_after_resume_s": up_at - t_back if mode == "pause" else None,
            "down_nodes_seen": watch.down_nodes, "verified_after": wrong_after,
            "servers": stats}


def _verify(url: str, layout, keys: list[bytes]) -> dict:
    """A fresh server promotes every stored chunk still in L2 and compares it."""
    found = wrong = 0
    with start_server(0.5, extra_args=["--l2-url", url, "--l2-lookup-wait", "30"]) as s, \
            KVClient(s.url, timeout=60) as c:
        c.register("fo", layout)
        for i in range(0, len(keys), 2):
            ks = keys[i:i + 2]
            for k in ks:
                if c.lookup("fo", [k]):
                    found += 1
                    with c.retrieve("fo", [k]) as got:
                        wrong += _wrong(k, got.tensors[0])
            c.delete("fo", ks)
    return {"chunks": len(keys), "found_in_l2": found, "wrong_bytes": wrong}


def _l2_counters(server) -> dict:
    return {k: v for k, v in _get_json(server.http_url + "/status")["counters"].items()
            if k.startswith("l2_")}


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def _until(pred, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError("bench l2 --cluster: the failover phase did not settle in time")
        time.sleep(0.05)
