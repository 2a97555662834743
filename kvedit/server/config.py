"""ServerConfig: every knob of `kvedit server`, one dataclass (what /config reports)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

EVICTION_POLICIES = ("LRU", "FIFO", "none")
GIB = 1 << 30


@dataclass(slots=True)
class ServerConfig:
    l1_size_gb: float                 # pool size in GiB (2**30 bytes)
    host: str = "127.0.0.1"
    port: int = 6555                  # ZMQ ROUTER
    http_port: int = 8080
    chunk_size: int = 256             # tokens per chunk; registered layouts must match
    eviction_policy: str = "LRU"      # LRU, FIFO, or none (refuse stores when full)
    shm_name: str = "kvedit"          # POSIX shm segment holding the pool; "" = no shm
    l1_use_lazy: bool = True          # False: allocate and pre-fault the whole pool at start
    lease_ttl: float = 300.0          # seconds a read lease lives without release
    write_ttl: float = 300.0          # seconds a prepared store lives without commit/abort

    @property
    def pool_bytes(self) -> int:
        # whole 4 KiB pages: slots are page-aligned
        return int(self.l1_size_gb * GIB) // 4096 * 4096

    def validate(self) -> None:
        """Raise ValueError naming the bad setting and what is expected."""
        if self.pool_bytes <= 0:
            raise ValueError(f"--l1-size-gb must be > 0 (at least 4 KiB), got {self.l1_size_gb}")
        if self.chunk_size <= 0:
            raise ValueError(f"--chunk-size must be a positive token count, got {self.chunk_size}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"--eviction-policy {self.eviction_policy!r} is not one of "
                             f"{list(EVICTION_POLICIES)}")
        for name in ("lease_ttl", "write_ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds")
        if "/" in self.shm_name:
            raise ValueError(f"--shm-name {self.shm_name!r} must not contain '/'")

    def to_dict(self) -> dict:
        return asdict(self) | {"pool_bytes": self.pool_bytes}
