"""Prometheus metrics of the server (own registry, served by GET /metrics)."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)


class Metrics:
    def __init__(self, state: Callable[[], dict]):
        """`state()` returns the current counts (called at scrape time, under the lock)."""
        r = self.registry = CollectorRegistry()
        self.hits = Counter("kvedit_hits", "keys found ready (lookup and retrieve)", registry=r)
        self.misses = Counter("kvedit_misses", "keys asked for but not ready", registry=r)
        self.evictions = Counter("kvedit_evictions", "objects evicted to make room", registry=r)
        self.expired = Counter("kvedit_expired", "leases and stores expired by TTL",
                               ["kind"], registry=r)
        self.errors = Counter("kvedit_errors", "requests answered with an error",
                              ["code"], registry=r)
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
        self._objects = Gauge("kvedit_objects", "objects by state", ["state"], registry=r)
        self._bytes = Gauge("kvedit_pool_bytes", "pool bytes by use", ["use"], registry=r)
        self._models = Gauge("kvedit_models", "registered model layouts", registry=r)
        self._state = state

    def render(self) -> bytes:
        s = self._state()
        for k in ("ready", "writing", "leased"):
            self._objects.labels(k).set(s[k])
        self._bytes.labels("used").set(s["pool_used"])
        self._bytes.labels("free").set(s["pool_free"])
        self._bytes.labels("total").set(s["pool_bytes"])
        self._models.set(s["models"])
        return generate_latest(self.registry)
