"""The kvedit server: one process holding KV chunks in host memory.

config (ServerConfig) · pool (shm/anonymous arena + best-fit allocator) · index (objects,
states, holders, leases, quarantine, transfers, eviction; index_types, ordered) · waiters
(parked lookups) · peers (which client sessions are connected) · service (ZMQ ROUTER loop) ·
datalink (raw-TCP bytes for socket-mode clients) · http (+ http_state, http_openapi) · metrics
(Prometheus collector over the service's snapshot) · main (start-up, signals, shutdown) · cli
(`kvedit server`) · l2, l2_redis, l2_service (the optional Redis second tier: docs/l2.md).
Starting a server as a child process (tests, benchmarks, the demo) is kvedit/launch/server.py. Captured queries are a second object kind in the
same index and pool (docs/queries.md).
Protocol: docs/protocol.md; HTTP: docs/http.md; security: docs/security.md.
"""
