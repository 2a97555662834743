"""ServerConfig: every knob of `kvedit server`, one dataclass (what /config reports).

Every resource a client can make the server hold has a bound here (models, keys per request,
message size, parked lookups, data connections, what one session holds, HTTP connections)
and a deadline (TTLs, transfer timeouts, quarantine, the HTTP head timeout). docs/protocol.md
lists them with the error code a client gets at the bound.
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import asdict, dataclass

from kvedit.layout import ModelLayout
from kvedit.protocol import MAX_KEY_BYTES, MAX_KEYS
from kvedit.query_contract import MAX_WINDOW, QueryShape
from kvedit.server import l2_url
from kvedit.server.key_feed import WatchLimits
from kvedit.server.l2_url import redacted
from kvedit.server.quota import QuotaLimits

EVICTION_POLICIES = ("LRU", "FIFO", "ARC", "none")
L2_WRITE_ON = ("commit", "evict")


def eviction_name(name: str) -> str:
    """The canonical policy name for `name` in any case ("arc" -> "ARC"); ValueError else."""
    for p in EVICTION_POLICIES:
        if name.lower() == p.lower():
            return p
    raise ValueError(f"eviction policy {name!r} is not one of "
                     f"{[p.lower() for p in EVICTION_POLICIES]}")
GIB = 1 << 30
MIB = 1 << 20


def listen_backlog() -> int:
    """The listen backlog of every TCP listener (HTTP, data link): the kernel's cap
    (net.core.somaxconn; 4096 on Linux >= 5.4). With a small one a user churning connections
    fills the accept queue and everyone else's connect waits for SYN retransmits (1 s, 3 s)."""
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return max(socket.SOMAXCONN, int(f.read()))
    except (OSError, ValueError):
        return socket.SOMAXCONN
# The queries cap for a layout that does not say its query heads (registered by a connector
# older than captured-queries shapes): the fixed default of before.
LEGACY_QUERY_BYTES = 256 * MIB


@dataclass(slots=True)
class ServerConfig:
    l1_size_gb: float                 # pool size in GiB (2**30 bytes)
    host: str = "127.0.0.1"           # every listener: ZMQ, data link, HTTP
    port: int = 6555                  # ZMQ ROUTER
    http_port: int = 8080
    data_port: int = 0                # data link (socket-mode bytes); 0 = a free port
    chunk_size: int = 256             # tokens per chunk; registered layouts must match
    eviction_policy: str = "LRU"      # LRU, FIFO, ARC, or none (refuse stores when full)
    shm_name: str = "kvedit"          # POSIX shm segment holding the pool; "" = no shm
    l1_use_lazy: bool = True          # False: allocate and pre-fault the whole pool at start
    lease_ttl: float = 300.0          # seconds a read lease lives without release
    write_ttl: float = 300.0          # seconds a prepared store lives without commit/abort
    quarantine_ttl: float = 0.0       # seconds expired slots stay unused; 0 = 4 x the longer TTL
    # ---- limits ----
    max_models: int = 64              # registered (model, tp_rank) layouts
    max_model_name: int = 256         # bytes of a model name (UTF-8)
    max_keys_per_request: int = 8192  # bounds one request's loop time (docs/protocol.md)
    max_message_bytes: int = 0        # ZMQ MAXMSGSIZE (libzmq drops the peer's connection
                                      # above); 0 = what max_keys_per_request needs
    max_waits_per_client: int = 1024  # parked lookups of one client session
    max_waits_total: int = 16384
    max_parked_keys: int = 1 << 20    # keys of all parked lookups together (their memory)
    max_wait_seconds: float = 600.0   # longest Lookup.wait_timeout
    max_data_conns: int = 256         # open data-link connections (a thread each)
    max_handshakes: int = 32          # ... of them not authenticated yet (handshakes.py; at
                                      # most half of max_data_conns)
    max_handshakes_per_peer: int = 8  # ... per peer (a local user by uid, else an address;
                                      # not the server's own user)
    max_zmq_conns_per_peer: int = 256 # ZMQ connections of one peer (peers.py); beyond, shut
    reply_queue_mb: float = 2.0       # MiB queued for one client socket, not delivered by
                                      # the kernel, at most (replies.py); beyond, it is cut
    reply_queue_total_mb: float = 32.0  # ... for all sockets; beyond, the biggest are cut
    # Largest captured-queries object (kind "queries"); 0: the largest the query contract lets
    # a client ask for the model (query_bytes).
    max_query_bytes: int = 0
    # ---- what one client session may hold (quota.py): counts, and bytes as pool fractions ----
    max_leases_per_client: int = 4096
    max_leases_total: int = 65536
    max_stores_per_client: int = 4096       # pending stores
    max_stores_total: int = 65536
    max_leased_keys_per_client: int = 1 << 18   # objects kept by a session's leases
    max_leased_keys_total: int = 1 << 21
    max_client_pool_fraction: float = 0.25  # of the pool: slot bytes one session's leases
                                            # and pending stores pin together
    max_client_total_share: float = 0.125   # of each total cap (leases, stores, leased keys,
                                            # the key watches' queue): one session's at most
    quota_reserve: float = 0.25       # of each total and of the pool: kept for sessions that
                                      # hold little (quota.py)
    fence_gone_sessions: bool = False  # quarantine also what a disconnected session held
    # ---- HTTP (http.py) ----
    http_max_conns: int = 256           # open connections; beyond, the oldest idle one goes
    http_max_conns_per_peer: int = 16   # per peer (a local user by uid, else an address)
    http_max_requests: int = 64         # in flight; beyond, 503 (not for /health, nor
                                        # requests with the right bearer token)
    http_head_timeout: float = 3.0      # seconds for a whole request head
    http_new_conns_per_peer: float = 1000.0  # new connections a second of one peer (not the
                                        # server's own user); beyond, 503 at accept. 0: no cap
    data_idle_timeout: float = 60.0   # data link: seconds without a request before closing
    handshake_timeout: float = 2.0    # data link: seconds for the whole handshake
    transfer_idle_timeout: float = 10.0  # data link: seconds without progress mid-transfer
    transfer_timeout: float = 300.0   # data link: longest single PUT/GET
    # ---- key watches (key_feed.py) ----
    max_watches: int = 64               # watches in all (a socket each)
    max_watches_per_client: int = 4     # watches of one session
    watch_ttl: float = 30.0             # seconds a watch lives without a renewal, and bytes
                                        # may wait unacknowledged before its connection is cut
    watch_queue_mb: float = 4.0         # MiB sent to one watch and not acknowledged, at most
    watch_queue_total_mb: float = 32.0  # ... to all watches together
    watch_subscribes_per_min: float = 30.0   # subscriptions of one session (a burst of 8)
    watch_slice_ms: float = 4.0         # loop time a pass spends building snapshots
    # ---- authentication ----
    secret_file: str = ""             # where the shared secret came from ("" = none / env)
    authenticated: bool = False       # a secret is in use (the secret itself is never here)
    insecure: bool = False            # allow a non-loopback host without a secret
    # ---- second tier on Redis (docs/l2.md) ----
    l2_url: str = ""                  # redis://[user:pass@]host:port/db, rediss://, unix://,
                                      # redis+cluster://h1:p1,h2:p2 (l2_url.py: all spellings)
    l2_prefix: str = "kvedit"         # first part of every Redis key
    l2_ttl: float = 0.0               # seconds a chunk lives in Redis (EX); 0 = no expiry
    l2_write_on: str = "commit"       # write behind on commit (default) or on eviction from L1
    l2_write_queue_mb: float = 0.0    # write-behind backlog bound (MiB), oldest dropped beyond;
                                      # 0: an eighth of the pool, 16 MiB to 1 GiB
    l2_lookup_wait: float = 1.0       # longest a no-wait lookup waits for promotion from L2
    l2_timeout: float = 5.0           # Redis socket timeout (seconds) before it counts as down
    l2_mac: bool = False              # records carry an HMAC of the secret (a Redis writer
                                      # without it cannot plant a chunk); needs a secret
    secret_path: str = ""             # where a secret made at start was written (rundir.py)
    secret_reused: bool = False       # ... it was an earlier server's on this port, reused

    @property
    def pool_bytes(self) -> int:
        # whole 4 KiB pages: slots are page-aligned
        return int(self.l1_size_gb * GIB) // 4096 * 4096

    @property
    def quarantine_seconds(self) -> float:
        return self.quarantine_ttl or 4 * max(self.lease_ttl, self.write_ttl)

    @property
    def message_bytes(self) -> int:
        """The ZMQ message cap: --max-message-bytes, or (0) what the largest request needs
        (max keys of MAX_KEY_BYTES each, plus a name and framing). Kept no larger than that by
        default: the loop decodes a message whole before it can refuse it."""
        return self.max_message_bytes or (self.max_keys_per_request * (MAX_KEY_BYTES + 3)
                                          + 64 * 1024)

    def query_bytes(self, layout: ModelLayout) -> int:
        """The largest captured-queries object of a model with `layout` (the pool bounds it
        too): --max-query-bytes, or (0) the largest window the query contract allows,
        MAX_WINDOW rows of the model's queries on one rank (QueryShape). A fixed default
        refused windows the contract allows: 256 MiB is 3120 rows of Qwen2.5-1.5B (28 layers
        x 12 query heads x 128 x bf16 = 86 KB a row), so KVzip's reconstruction pass of a 4k
        context (4084 rows, 351 MB) was captured by vLLM, refused here, and the SDK found no
        queries (reported as missing by modify, 60 s later, with nothing saying why)."""
        if self.max_query_bytes:
            return self.max_query_bytes
        if not layout.num_q_heads:
            return LEGACY_QUERY_BYTES
        return QueryShape.of(layout, MAX_WINDOW).nbytes

    @property
    def l2_queue_bytes(self) -> int:
        """The write-behind queue's bound: --l2-write-queue-mb, or (0) an eighth of the pool
        within 16 MiB..1 GiB (a queue of copies of evicted chunks behind a Redis that is
        down grew the server by ~1 GiB with a fixed 1 GiB default, whatever the pool)."""
        if self.l2_write_queue_mb:
            return int(self.l2_write_queue_mb * MIB)
        return min(GIB, max(16 * MIB, self.pool_bytes // 8))

    @property
    def handshakes_total(self) -> int:
        """Data-link connections in handshake at once: --max-handshakes, at most half of
        --max-data-conns (the other half is always left to authenticated clients)."""
        return max(1, min(self.max_handshakes, self.max_data_conns // 2))

    def watch_limits(self) -> WatchLimits:
        return WatchLimits(
            max_watches=self.max_watches, per_client=self.max_watches_per_client,
            ttl_s=self.watch_ttl, queued_bytes=int(self.watch_queue_mb * MIB),
            queued_total=int(self.watch_queue_total_mb * MIB),
            # a session's share of the total, but at least one watch's worth
            per_holder=max(int(self.watch_queue_total_mb * MIB * self.max_client_total_share),
                           int(self.watch_queue_mb * MIB)),
            subscribes_per_min=self.watch_subscribes_per_min,
            slice_s=self.watch_slice_ms / 1000)

    def quota_limits(self) -> QuotaLimits:
        pool = self.pool_bytes

        def share(per_client: int, total: int) -> int:   # one session: a share of the total
            return max(1, min(per_client, int(total * self.max_client_total_share)))

        return QuotaLimits(
            leases_per_client=share(self.max_leases_per_client, self.max_leases_total),
            leases_total=self.max_leases_total,
            stores_per_client=share(self.max_stores_per_client, self.max_stores_total),
            stores_total=self.max_stores_total,
            lease_keys_per_client=share(self.max_leased_keys_per_client,
                                        self.max_leased_keys_total),
            lease_keys_total=self.max_leased_keys_total,
            # 1: no share at all (the pool itself bounds a session), not "at most the pool"
            bytes_per_client=(int(pool * self.max_client_pool_fraction)
                              if self.max_client_pool_fraction < 1 else 1 << 62),
            # the pool's reserve goes with the pool share: 1 turns both off
            pool_bytes=pool if self.max_client_pool_fraction < 1 else None,
            reserve=self.quota_reserve, share=self.max_client_total_share)

    def validate(self) -> None:
        """Raise ValueError naming the bad setting and what is expected."""
        if self.pool_bytes <= 0:
            raise ValueError(f"--l1-size-gb must be > 0 (at least 4 KiB), got {self.l1_size_gb}")
        if self.chunk_size <= 0:
            raise ValueError(f"--chunk-size must be a positive token count, got {self.chunk_size}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"--eviction {self.eviction_policy!r} is not one of "
                             f"{[p.lower() for p in EVICTION_POLICIES]}")
        for name in ("lease_ttl", "write_ttl", "max_wait_seconds", "data_idle_timeout",
                     "handshake_timeout", "transfer_idle_timeout", "transfer_timeout",
                     "watch_ttl", "watch_subscribes_per_min", "watch_slice_ms"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got "
                                 f"{getattr(self, name)}")
        if not self.quarantine_ttl >= 0:
            raise ValueError(f"--quarantine-ttl must be >= 0 seconds (0 = 4 x the TTL), got "
                             f"{self.quarantine_ttl}")
        for name in ("max_models", "max_model_name", "max_keys_per_request",
                     "max_waits_per_client", "max_waits_total", "max_parked_keys",
                     "max_data_conns", "max_leases_per_client",
                     "max_leases_total", "max_stores_per_client", "max_stores_total",
                     "max_leased_keys_per_client", "max_leased_keys_total", "http_max_conns",
                     "http_max_conns_per_peer", "http_max_requests", "max_handshakes",
                     "max_handshakes_per_peer", "max_watches", "max_watches_per_client",
                     "max_zmq_conns_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.max_keys_per_request > MAX_KEYS:
            raise ValueError(f"--max-keys-per-request must be at most {MAX_KEYS} (the "
                             f"protocol's bound), got {self.max_keys_per_request}")
        if self.max_query_bytes < 0:
            raise ValueError(f"--max-query-bytes must be >= 0 (0 = the largest window the "
                             f"query contract allows), got {self.max_query_bytes}")
        if self.max_message_bytes and self.max_message_bytes < 64 * 1024:
            raise ValueError(f"--max-message-bytes must be 0 (derived) or at least 65536 (a "
                             f"request with a few keys must fit), got {self.max_message_bytes}")
        if not 0 < self.max_client_pool_fraction <= 1:
            raise ValueError(f"--max-client-pool-fraction is a fraction of the pool in (0, 1], "
                             f"got {self.max_client_pool_fraction}")
        if not 0 <= self.quota_reserve < 1:
            raise ValueError(f"--quota-reserve is a fraction of each total in [0, 1), got "
                             f"{self.quota_reserve}")
        if not 0 < self.max_client_total_share <= 1:
            raise ValueError(f"--max-client-total-share is a fraction of each total cap in "
                             f"(0, 1], got {self.max_client_total_share}")
        if not 1 <= self.watch_queue_mb <= self.watch_queue_total_mb:
            raise ValueError(f"--watch-queue-mb must be at least 1 (a snapshot part must fit) "
                             f"and at most --watch-queue-total-mb ({self.watch_queue_total_mb}),"
                             f" got {self.watch_queue_mb}")
        if not 0.25 <= self.reply_queue_mb <= self.reply_queue_total_mb:
            raise ValueError(f"--reply-queue-mb must be at least 0.25 (the largest reply must "
                             f"fit) and at most --reply-queue-total-mb "
                             f"({self.reply_queue_total_mb}), got {self.reply_queue_mb}")
        if not self.http_new_conns_per_peer >= 0:
            raise ValueError(f"--http-new-conns-per-peer must be >= 0 connections a second "
                             f"(0: no cap), got {self.http_new_conns_per_peer}")
        if not self.http_head_timeout > 0:
            raise ValueError(f"--http-head-timeout must be > 0 seconds, got "
                             f"{self.http_head_timeout}")
        if not 0 <= self.data_port < 65536:
            raise ValueError(f"--data-port must be 0 (any free port) or 1..65535, got "
                             f"{self.data_port}")
        if "/" in self.shm_name:
            raise ValueError(f"--shm-name {self.shm_name!r} must not contain '/'")
        self._validate_l2()
        if not self.authenticated and not self.insecure and not is_loopback(self.host):
            raise ValueError(
                f"--host {self.host} is reachable from other machines but no secret is set: "
                f"anyone who reaches the ports could read, change or delete every tenant's KV. "
                f"Give --secret-file PATH (or --gen-secret PATH, or $KVEDIT_SECRET / "
                f"$KVEDIT_SECRET_FILE), or pass --insecure to accept that")

    def _validate_l2(self) -> None:
        if self.l2_url:
            l2_url.parse(self.l2_url)   # a clear error for a URL the tier could not use
        if self.l2_write_on not in L2_WRITE_ON:
            raise ValueError(f"--l2-write-on {self.l2_write_on!r} is not one of "
                             f"{list(L2_WRITE_ON)}")
        if not self.l2_write_queue_mb >= 0:
            raise ValueError(f"--l2-write-queue-mb must be > 0 (or 0: an eighth of the pool), "
                             f"got {self.l2_write_queue_mb}")
        for name in ("l2_ttl", "l2_lookup_wait"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 seconds, got "
                                 f"{getattr(self, name)}")
        if 0 < self.l2_ttl < 1:
            raise ValueError(f"--l2-ttl is whole seconds (Redis EX): 0 (no expiry) or >= 1, "
                             f"got {self.l2_ttl}")
        if not self.l2_timeout > 0:
            raise ValueError(f"--l2-timeout must be > 0 seconds, got {self.l2_timeout}")
        if self.l2_mac and not self.authenticated:
            raise ValueError("--l2-mac signs L2 records with the shared secret, and this "
                             "server has none (--insecure): drop one of the two")
        if not self.l2_prefix or set(self.l2_prefix) & set(":{}"):
            raise ValueError(f"--l2-prefix must be non-empty without ':', '{{' or '}}' (a "
                             f"chunk's hash tag), got {self.l2_prefix!r}")

    def to_dict(self) -> dict:
        q = self.quota_limits()
        return asdict(self) | {"pool_bytes": self.pool_bytes,
                               "quarantine_seconds": self.quarantine_seconds,
                               "message_bytes": self.message_bytes,
                               "client_pool_bytes": q.bytes_per_client,
                               "l2_queue_bytes": self.l2_queue_bytes,
                               "handshakes_total": self.handshakes_total,
                               "client_caps": {"leases": q.leases_per_client,
                                               "stores": q.stores_per_client,
                                               "lease_keys": q.lease_keys_per_client},
                               "l2_url": redacted(self.l2_url)}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


