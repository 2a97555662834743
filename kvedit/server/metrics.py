"""Prometheus metrics of the server (own registry, served by GET /metrics).

Two kinds, kept apart so that nothing can drift:
- state the index already counts (objects, pool bytes, evictions, expirations, quarantine)
  is read from Service.snapshot() at scrape time by a custom collector: /metrics and /status
  read the same numbers, no mirrored counter to forget to increment;
- events only the service sees (requests by type, errors by code, hits/misses, bytes,
  latencies) are ordinary counters incremented where they happen.
No key or model name appears in any label (/metrics stays open when a secret is set); the
one address that does is an L2 node's host:port while it is down (which node to go and fix).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
TURN_OVER_MS = (10, 50)   # loop turns counted over these milliseconds of CPU time


class LoopTurns:
    """The control loop's own busy figure: the CPU time (thread time, which a busy box's
    scheduler does not inflate) of each turn of the loop, from poll's return to the next
    poll. A request that arrived during a turn waited about that long before the loop looked
    at it, whatever else runs on the machine; so a test or a bench can tell work the loop
    does in one go from a slow box. O(1) to keep and read: turns, the longest, and the
    turns over each of TURN_OVER_MS."""
    __slots__ = ("turns", "max_s", "over")

    def __init__(self):
        self.turns = 0
        self.max_s = 0.0
        self.over = [0] * len(TURN_OVER_MS)

    def observe(self, seconds: float) -> None:
        self.turns += 1
        if seconds > self.max_s:
            self.max_s = seconds
        for i, ms in enumerate(TURN_OVER_MS):
            if seconds * 1e3 <= ms:
                break
            self.over[i] += 1

    def snapshot(self) -> dict:
        return {"loop_turns": self.turns, "loop_turn_max_ms": round(self.max_s * 1e3, 2)} | {
            f"loop_turns_over_{ms}ms": n for ms, n in zip(TURN_OVER_MS, self.over)}


class _SnapshotCollector:
    """Reads the service's snapshot (O(1)) once per scrape."""

    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def describe(self):
        return []  # unknown until a scrape; keeps registration from calling collect()

    def collect(self):
        s = self._snapshot()
        objects = GaugeMetricFamily("kvedit_objects", "objects by state", labels=["state"])
        for k in ("ready", "writing", "leased"):
            objects.add_metric([k], s[k])
        yield objects
        pool = GaugeMetricFamily("kvedit_pool_bytes", "pool bytes by use", labels=["use"])
        for use, k in (("used", "pool_used"), ("free", "pool_free"), ("total", "pool_bytes"),
                       ("quarantined", "quarantined_bytes")):
            pool.add_metric([use], s[k])
        yield pool
        kinds = GaugeMetricFamily("kvedit_ready_objects", "ready objects by kind",
                                  labels=["kind"])
        kinds.add_metric(["kv"], s["ready"] - s["query_objects"])
        kinds.add_metric(["queries"], s["query_objects"])
        yield kinds
        yield GaugeMetricFamily("kvedit_query_bytes", "bytes of the ready captured-queries "
                                "objects", value=s["query_bytes"])
        yield GaugeMetricFamily("kvedit_models", "registered model layouts", value=s["models"])
        yield GaugeMetricFamily("kvedit_leases", "open read leases", value=s["leases"])
        yield GaugeMetricFamily("kvedit_pending_stores", "prepared, uncommitted stores",
                                value=s["pending_stores"])
        yield GaugeMetricFamily("kvedit_waiting_lookups", "parked lookups",
                                value=s["waiting_lookups"])
        yield GaugeMetricFamily("kvedit_data_connections", "open data-link connections",
                                value=s["data_conns"])
        yield GaugeMetricFamily("kvedit_zmq_connections", "open ZMQ control connections",
                                value=s["zmq_conns"])
        yield GaugeMetricFamily("kvedit_quarantined_objects",
                                "slots of expired leases/stores not yet reusable",
                                value=s["quarantined_objects"])
        yield CounterMetricFamily("kvedit_evictions", "objects evicted to make room",
                                  value=s["evictions"])
        yield CounterMetricFamily("kvedit_transfers_cut", "data-link transfers cut by their "
                                  "deadline (index)", value=s["cut_transfers"])
        held = GaugeMetricFamily("kvedit_held", "what client sessions hold (quota.py): "
                                 "leases and stores open or quarantined, leased keys, bytes",
                                 labels=["what"])
        for what in ("leases", "stores", "lease_keys", "lease_bytes", "store_bytes"):
            held.add_metric([what], s["held_" + what])
        yield held
        yield GaugeMetricFamily("kvedit_holders", "client sessions holding a lease or store",
                                value=s["holders"])
        yield CounterMetricFamily("kvedit_heap_trims", "times freed heap was given back after "
                                  "a burst (trim.py)", value=s["heap_trims"])
        yield CounterMetricFamily("kvedit_loop_turns", "turns of the control loop",
                                  value=s["loop_turns"])
        yield GaugeMetricFamily("kvedit_loop_turn_max_seconds", "CPU time of the longest turn "
                                "of the control loop since the start (what a request that "
                                "came then waited)", value=s["loop_turn_max_ms"] / 1e3)
        slow = CounterMetricFamily("kvedit_loop_slow_turns", "turns of the control loop "
                                   "over a CPU time", labels=["over_ms"])
        for ms in TURN_OVER_MS:
            slow.add_metric([str(ms)], s[f"loop_turns_over_{ms}ms"])
        yield slow
        expired = CounterMetricFamily("kvedit_expired", "leases and stores expired by TTL",
                                      labels=["kind"])
        expired.add_metric(["lease"], s["expired_leases"])
        expired.add_metric(["store"], s["expired_stores"])
        yield expired
        if "l2_up" in s:   # the second tier is on (--l2-url)
            yield from _l2_families(s)


def _l2_families(s: dict):
    """The L2 tier's counters (kvedit/server/l2.py counts them; the snapshot carries them)."""
    yield GaugeMetricFamily("kvedit_l2_up", "1 while the L2 Redis answers", value=s["l2_up"])
    yield GaugeMetricFamily("kvedit_l2_queue_depth", "chunks waiting to be written to L2",
                            value=s["l2_queue_depth"])
    yield GaugeMetricFamily("kvedit_l2_queue_bytes", "bytes waiting to be written to L2",
                            value=s["l2_queue_bytes"])
    down = GaugeMetricFamily("kvedit_l2_node_down_seconds", "seconds since an L2 node (host:"
                             "port; a Redis, a cluster master) stopped answering, during an "
                             "outage (no series while L2 is up)", labels=["node"])
    now = time.time()
    for node, since in s["l2_down_nodes"].items():
        down.add_metric([node], round(now - since, 3))
    yield down
    for name, key, doc in (
            ("probes", "l2_probes", "lookups that fell through to L2"),
            ("hits", "l2_hits", "chunks found in L2 and promoted into L1 (promotions)"),
            ("misses", "l2_misses", "L2 probes that stopped at a chunk L2 does not hold"),
            ("promoted_bytes", "l2_promoted_bytes", "bytes promoted from L2 into L1"),
            ("corrupt", "l2_corrupt", "L2 records with a wrong length or checksum (misses)"),
            ("writes", "l2_writes", "chunks written to L2"),
            ("write_bytes", "l2_write_bytes", "bytes written to L2"),
            ("write_seconds", "l2_write_seconds", "the writer's time spent writing to L2"),
            ("write_dropped", "l2_write_dropped", "writes dropped from the full write-behind "
                                                  "queue (oldest first)"),
            ("write_skipped", "l2_write_skipped", "writes skipped: evicted or deleted first"),
            ("errors", "l2_errors", "failed L2 operations (Redis down, timeout)"),
            ("outages", "l2_outages", "times L2 became unreachable")):
        yield CounterMetricFamily(f"kvedit_l2_{name}", doc, value=s[key])


class Metrics:
    def __init__(self, snapshot: Callable[[], dict]):
        """`snapshot()` returns the current counts; it takes the service lock itself."""
        r = self.registry = CollectorRegistry()
        self.hits = Counter("kvedit_hits", "keys found ready (lookup and retrieve)", registry=r)
        self.misses = Counter("kvedit_misses", "keys asked for but not ready", registry=r)
        self.errors = Counter("kvedit_errors", "requests answered with an error (ZMQ control "
                              "and data link)", ["code"], registry=r)
        self.store_bytes = Counter("kvedit_store_bytes", "bytes committed", registry=r)
        self.retrieve_bytes = Counter("kvedit_retrieve_bytes", "bytes leased to readers",
                                      registry=r)
        self.store_latency = Histogram(
            "kvedit_store_seconds", "prepare-store to commit, per store", registry=r,
            buckets=_LATENCY_BUCKETS)
        self.retrieve_latency = Histogram(
            "kvedit_retrieve_seconds", "retrieve to release (or data sent), per lease",
            registry=r, buckets=_LATENCY_BUCKETS)
        self.requests = Counter("kvedit_requests", "requests handled", ["type"], registry=r)
        self.transfers_failed = Counter("kvedit_transfers_failed", "data-link transfers that "
                                        "did not complete (peer gone, idle timeout, cut)",
                                        ["op"], registry=r)
        r.register(_SnapshotCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
