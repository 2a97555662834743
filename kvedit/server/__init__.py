"""The kvedit server: one process holding KV chunks in host memory.

config (ServerConfig) · pool (shm/anonymous arena + allocator) · index (objects, states,
leases, eviction) · waiters (parked lookups) · service (ZMQ ROUTER loop) · datalink (raw-TCP
bytes for socket-mode clients) · http (health/status/config/metrics/cache) · metrics
(Prometheus) · main (start-up, signals, shutdown) · cli (`kvedit server`) · launch
(start_server for tests, benchmarks and the demo). Protocol: docs/protocol.md.
"""
