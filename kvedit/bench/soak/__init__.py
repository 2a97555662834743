"""`kvedit bench soak`: minutes or hours of mixed, hostile and unlucky load on a loopback server.

Shared-memory and socket clients (separate processes, procs.py) store,
look up, retrieve and delete random keys of a working set larger than the pool (eviction
pressure), checking every chunk they read against bytes derived from its key. Meanwhile, in
every cycle of the run: clients SIGKILLed mid-store and mid-lease, a writer past its write
TTL and a reader past its lease TTL, data-link GET and PUT transfers that stall half-way,
oversized requests, a restart of the L2 Redis, and idle periods longer than the data link's
idle timeout; one server restart early and, in runs of several cycles, one half-way. All run
long: a client sending a small Hello every ~10 ms (the control loop's latency) and, at a low
rate, the attacks of outside red-team runs: a lease flood of one key x the key limit, a
session pinning all the pool it may, unfinished HTTP heads and churned connections beside
/health probes and half-closed requests, records planted in the L2 Redis without the secret,
a key watch re-subscribed and never read, a stranger holding data-link handshakes, a relay
of /health to the server (it must get no token), a model of
thousands of objects unregistered again and again, sockets that never read their replies,
and 8 sessions together leasing up to the leases' total; a connector-style key watch
checks every miss it answers. The server runs with the secret it
made itself (the default): its restarts reuse it, and every client finds it in the runtime
directory. The server's RSS and its queues (L2 write-behind, key watches) are sampled
throughout. After every client has stopped and the TTLs have passed, the server's /status
must show no lease and, once the cache is deleted, no slot in use; its memory is measured
once the L2 queue has drained. Then a scaling phase: the latency of a small request while
/metrics (and /status, /cache pages) are scraped with 1M objects in the index (4 KiB chunks,
lazy pool, never written), beside the same request with nobody scraping; the key-watch
phase on that server (watch.py); stores evicting 8,192 objects each from
the full pool, and the Unregister of the million (scale.py).
Everything is bounded in time and count and stops every process it started.

The modules: cli (options; light), run (the phases in order, the targets), mixed (the mixed
phase: its server, processes, timeline and leak check), common (what every child shares),
procs (the clients' roles), attacks (every attacker's role), summary (what the children's
results add up to), scale (the million-object phase), watch (the key-watch phase),
restart (`--restart-vllm`).
"""
from kvedit.bench.soak.cli import register

__all__ = ["register"]
