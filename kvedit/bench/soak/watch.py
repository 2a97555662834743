"""`kvedit bench soak`'s key-watch phase: what watches cost the server's loop and memory.

Run on the scaling phase's server (a million ready objects): a Hello every few milliseconds
measures the loop (a request waits behind whatever the loop is doing), first with nobody
else, then
- beside a watch attacker: one socket re-subscribing a watch of the million objects and
  never reading (its queue holds one message, its kernel buffer 4 KiB), the server's RSS
  sampled before, during and after;
- while 64 watches (16 sessions x 4) follow a model of 262,144 objects (--watch-objects):
  stores of 8,192 keys
  (each pushed to every watch) and then a DELETE /cache of the whole model.
The watchers here read and acknowledge as a connector's watch does, without keeping the keys
(64 copies of 262k keys would weigh on this process, not on the server).
On a busy box those latencies carry the scheduler's delays too; `loop_costs` measures the
same steps as the loop's own CPU time, on the server's real index and feed in-process.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Union

import msgspec
import zmq

from kvedit import protocol as P
from kvedit.bench.soak.common import RawPeer, deaf_socket
from kvedit.bench.soak.summary import pct, thin
from kvedit.client import KVClient
from kvedit.layout import ModelLayout
from kvedit.server.index import Index
from kvedit.server.key_feed import KeyFeed, WatchLimits
from kvedit.server.pool import Allocator
from kvedit.server.slices import SLICE as CLEAR_SLICE

WATCHERS, SESSIONS = 64, 16


class _Head(msgspec.Struct, tag_field="t", kw_only=True):
    """What a watcher here reads of a message: its epoch, seq and whether more parts come
    (the keys are skipped, not built: 64 watchers must not make this process the load)."""
    epoch: int = 0
    seq: int = 0          # the protocol's default: a first part (seq 0) does not send it
    more: bool = False


class _Snapshot(_Head, tag="key_snapshot"):
    pass


class _Events(_Head, tag="key_events"):
    pass


class _Ack(_Head, tag="watch_ack"):
    pass


class _Error(_Head, tag="error"):
    pass


_heads = msgspec.msgpack.Decoder(Union[_Snapshot, _Events, _Ack, _Error])
PROBE_EVERY_S = 0.005


class Prober:
    """A Hello every PROBE_EVERY_S on its own socket: (when sent, ms) samples."""

    def __init__(self, url: str, secret: bytes | None):
        self.peer = RawPeer({"url": url})
        if secret is not None and self.peer.secret is None:
            self.peer.secret = secret
            self.peer.reset()
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        self.peer.close()

    def _run(self) -> None:
        hello = P.Hello(protocol=P.PROTOCOL)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            r = self.peer.call(hello, 5.0)
            ms = (time.perf_counter() - t0) * 1e3 if r is not None else 5000.0
            self.samples.append((time.monotonic(), ms))
            time.sleep(max(0.0, PROBE_EVERY_S - ms / 1e3))

    def between(self, a: float, b: float) -> list[float]:
        return [ms for t, ms in self.samples if a <= t <= b]


def hello_stats(ms: list[float]) -> dict:
    return {"n": len(ms), "p50_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99),
            "max_ms": pct(ms, 1.0)}


def watch_attack(srv, rss, secret: bytes | None, model: str, seconds: float = 20.0,
                 idle_s: float = 5.0) -> dict:
    """One never-reading socket re-subscribing a watch of `model` ten times a second."""
    before = rss()
    peak = before
    with Prober(srv.url, secret) as probe:
        time.sleep(idle_s)
        t_attack = time.monotonic()
        d = deaf_socket(srv.url, secret)
        sent, epoch = 0, 0
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                epoch += 1
                d.send_multipart([b"w", P.encoder.encode(P.WatchKeys(
                    model=model, tp_ranks=[0], epoch=epoch))], zmq.NOBLOCK)
                sent += 1
                peak = max(peak, rss())
                time.sleep(0.1)
            t_end = time.monotonic()
            during = rss()
        finally:
            ctx = d.context
            d.close(linger=0)
            ctx.term()
    return {"objects_watched": model, "subscriptions_sent": sent, "seconds": seconds,
            "rss_mb_before": round(before, 1), "rss_growth_mb": round(during - before, 1),
            "rss_peak_growth_mb": round(peak - before, 1),
            "hello_idle": hello_stats(probe.between(t_attack - idle_s, t_attack)),
            "hello_beside_attacker": hello_stats(probe.between(t_attack, t_end))}


class _Watchers:
    """WATCHERS watches of one model over SESSIONS sessions, read and acknowledged by one
    thread (as KeyWatch.sync does: a renewal with the last seq applied)."""

    def __init__(self, url: str, secret: bytes | None, model: str):
        self.clients = [KVClient(url, secret=secret, timeout=60) for _ in range(SESSIONS)]
        self.socks = [c.open_socket(rcvhwm=100_000) for c in self.clients
                      for _ in range(WATCHERS // SESSIONS)]
        self.model = model
        self.seq = [-1] * len(self.socks)
        self.done = [False] * len(self.socks)
        self.messages = 0
        self.bytes = 0
        self.resyncs = 0
        self._stop = threading.Event()
        for i, s in enumerate(self.socks):
            self._subscribe(i, 1)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _subscribe(self, i: int, epoch: int) -> None:
        self.seq[i], self.done[i] = -1, False
        self.socks[i].send_multipart([b"w", P.encoder.encode(P.WatchKeys(
            model=self.model, tp_ranks=[0], epoch=epoch))])

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        index = {s: i for i, s in enumerate(self.socks)}
        last_ack = [0.0] * len(self.socks)
        epoch = [1] * len(self.socks)
        while not self._stop.is_set():
            for s, _ in poller.poll(100):
                i = index[s]
                while True:
                    try:
                        frames = s.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.messages += 1
                    self.bytes += len(frames[-1])
                    m = _heads.decode(frames[-1])
                    if m.epoch != epoch[i] or isinstance(m, _Error):
                        continue
                    if isinstance(m, _Ack) and m.seq < 0 or \
                            not isinstance(m, _Ack) and m.seq != self.seq[i] + 1:
                        self.resyncs += 1
                        epoch[i] += 1
                        self._subscribe(i, epoch[i])
                        continue
                    if not isinstance(m, _Ack):
                        self.seq[i] = m.seq
                        if isinstance(m, _Snapshot) and not m.more:
                            self.done[i] = True
            now = time.monotonic()
            for i, s in enumerate(self.socks):
                if self.seq[i] >= 0 and now - last_ack[i] > 0.2:
                    last_ack[i] = now
                    s.send_multipart([b"w", P.encoder.encode(P.WatchKeys(
                        model=self.model, tp_ranks=[0], epoch=epoch[i], renew=True,
                        seen=self.seq[i]))])

    def wait_synced(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end and not all(self.done):
            time.sleep(0.1)
        return all(self.done)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for c in self.clients:
            c.close()


def watched_delete(srv, client, secret: bytes | None, rss, http, objects: int) -> dict:
    """64 watches of a model of `objects` objects (whole multiples of 8,192); stores of
    8,192 keys, then the model deleted (DELETE /cache?model=...), the loop probed
    throughout."""
    tiny = ModelLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16",
                       chunk_size=256)
    model = "watched"
    client.register(model, tiny)
    for start in range(0, objects, 8192):
        client.prepare_store(model, [b"w" + i.to_bytes(15, "little")
                                     for i in range(start, min(objects, start + 8192))]
                             ).commit()
    before = rss()
    watchers = _Watchers(srv.url, secret, model)
    out: dict = {"watches": WATCHERS, "objects": objects}
    try:
        t0 = time.monotonic()
        out["synced"] = watchers.wait_synced(300)
        out["snapshots_s"] = round(time.monotonic() - t0, 1)
        with Prober(srv.url, secret) as probe:
            time.sleep(3)
            t_idle = time.monotonic()
            for n in range(10):
                client.prepare_store(model, [b"s" + (n * 8192 + i).to_bytes(15, "little")
                                             for i in range(8192)]).commit()
            t_stores = time.monotonic()
            time.sleep(1)
            t_del = time.monotonic()
            deleted = http.delete("/cache", params={"model": model}).json()["deleted"]
            t_deleted = time.monotonic()
            time.sleep(2)
        out |= {"deleted": deleted, "delete_s": round(t_deleted - t_del, 2),
                "hello_idle": hello_stats(probe.between(t_idle - 3, t_idle)),
                "hello_during_8192_key_stores": hello_stats(probe.between(t_idle, t_stores)),
                "hello_during_delete": hello_stats(probe.between(t_del, t_deleted + 0.5)),
                "hello_delete_samples_ms": thin([round(ms, 1) for ms in probe.between(
                    t_del, t_deleted + 0.5)], 60),
                "watch_messages": watchers.messages, "watch_mb": round(watchers.bytes / 2**20, 1),
                "watch_resyncs": watchers.resyncs,
                "rss_growth_mb": round(rss() - before, 1)}
    finally:
        watchers.close()
    return out


def loop_costs(objects: int = 262_144, watches: int = WATCHERS) -> dict:
    """The loop's own CPU time (thread time: what scheduling on a busy box does not inflate)
    for the watch work, on the server's real Index and KeyFeed in this process (the sends go
    nowhere): one snapshot slice, the push of an 8,192-key store to `watches` watches, one
    DELETE /cache slice (slices.SLICE objects) and its push, all snapshots of
    `objects` keys. Each figure is the most one step held the loop."""

    def cpu(fn) -> float:
        t0 = time.thread_time()
        fn()
        return (time.thread_time() - t0) * 1e3

    n = objects + 8192
    index = Index(Allocator(4096, n * 4096 + (1 << 20)), "LRU", 300, 300)
    sent = [0]

    def send(ident, rid, body):
        sent[0] += len(body)

    limits = WatchLimits(max_watches=watches, per_client=watches, queued_bytes=1 << 40,
                         queued_total=1 << 40, subscribes_per_min=1e9, subscribe_burst=watches)
    feed = KeyFeed(limits, send=send, ready_after=index.pages.after)
    index.feed = feed
    holder = b"h" * 16
    for start in range(0, objects, 8192):
        r = index.prepare("m", 0, [b"o" + i.to_bytes(15, "little")
                                   for i in range(start, min(objects, start + 8192))],
                          4096, holder)
        index.commit(r.store_id, holder)
    subscribe = [cpu(lambda i=i: feed.watch(bytes([i % 256, i // 256]) * 10, holder, b"r",
                                            P.WatchKeys(model="m", tp_ranks=[0], epoch=1)))
                 for i in range(watches)]
    passes = []
    while feed.has_work():
        passes.append(cpu(feed.work))
    keys = [os.urandom(16) for _ in range(8192)]

    def store():
        r = index.prepare("m", 0, keys, 4096, holder)
        index.commit(r.store_id, holder)

    store_ms = cpu(store)
    push_ms = cpu(feed.flush)
    upto = index.newest_ready("m")
    clears, flushes = [], []
    cursor = None
    while True:
        t0 = time.thread_time()
        _, cursor = index.clear_some("m", upto, CLEAR_SLICE, cursor=cursor)
        clears.append((time.thread_time() - t0) * 1e3)
        flushes.append(cpu(feed.flush))
        if cursor is None:
            break
    return {"objects": objects, "watches": watches, "snapshot_mb": round(sent[0] / 2**20, 1),
            "subscribe_max_ms": round(max(subscribe), 2),
            "snapshot_pass_max_ms": round(max(passes), 2), "snapshot_passes": len(passes),
            "store_8192_keys_ms": round(store_ms, 2), "push_8192_keys_to_all_ms":
            round(push_ms, 2), "delete_slice_max_ms": round(max(clears), 2),
            "delete_push_max_ms": round(max(flushes), 2), "delete_slices": len(clears)}
