"""The kvedit server: one process holding KV chunks in host memory.

config (ServerConfig) · pool (shm/anonymous arena + best-fit allocator) · index (objects,
states, holders, leases, quarantine, transfers, eviction; index_types, ordered) · waiters
(parked lookups) · peers (which client sessions are connected) · service (ZMQ ROUTER loop) ·
datalink (raw-TCP bytes for socket-mode clients) · http (+ http_state, http_openapi) · metrics
(Prometheus collector over the service's snapshot) · main (start-up, signals, shutdown) · cli
(`kvedit server`) · launch (start_server for tests, benchmarks and the demo).
Protocol: docs/protocol.md; HTTP: docs/http.md; security: docs/security.md.
"""
