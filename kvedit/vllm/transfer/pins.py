"""Pins: the chunks the scheduler side reported as hits stay readable until they are loaded.

Why a module of its own: between the lookup (vLLM's scheduling of a new request) and the
load (the workers, before that step's forward) other clients' stores can evict the chunks
the lookup counted, and the load then finds fewer. kvedit turns that into a recompute (a
miss, never wrong bytes), but a hit that disappears under load is a hit lost exactly when
the pool is busiest. So the lookup pins what it reports: a read lease on those chunks (the
server never evicts a leased object), released once the step that loads them has come back
(`step_done`), when the request ends, or when the pin is older than `ttl_s`. Bounded on its
own: at most `max_chunks` chunks pinned at once (a lookup beyond it is answered unpinned, as
without pins) and `ttl_s` well under the server's lease TTL (an expired lease would
quarantine its chunks). A pin the server refuses (a lease cap, an outage) is a hit reported
unpinned, never an error.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("vllm.kvedit")


@dataclass(slots=True)
class Pin:
    leases: list[int]                 # one read lease per tensor-parallel rank
    chunks: int                       # chunks held per rank
    since: float
    load_step: int | None = None      # the step whose metadata carries the load


@dataclass(slots=True)
class PinStats:
    pinned: int = 0        # lookups answered with a pin
    unpinned: int = 0      # hits answered without one (bound reached or refused)
    shorter: int = 0       # pins that held fewer chunks than the lookup counted (evicted)
    expired: int = 0       # pins released by their deadline
    release_failed: int = 0


class Pins:
    def __init__(self, max_chunks: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.max_chunks, self.ttl_s, self.clock = max_chunks, ttl_s, clock
        self.held: dict[str, Pin] = {}   # by request id
        self.chunks = 0                  # pinned chunks per rank, all requests
        self.steps_done = 0              # step outputs come back so far
        self.stats = PinStats()

    def pin(self, client, model: str, req_id: str, keys: list[list[bytes]],
            counted: int, looked_up: bool = True) -> int | None:
        """Pin the first `counted` chunks of `keys` (per rank) for `req_id` -> how many are
        held on every rank now (fewer when some were evicted since the lookup), or None
        when nothing is pinned (off, over the bound, refused: report `counted` unpinned).
        looked_up=False: no lookup counted them (the pin is the lookup: fewer held is no
        eviction)."""
        self.release(client, req_id)   # a request asked again (not scheduled last time)
        if counted <= 0 or self.max_chunks <= 0:
            return None
        if self.chunks + counted > self.max_chunks:
            self.stats.unpinned += 1
            return None
        leases, held, most = [], counted, 0
        try:
            for rank, k in enumerate(keys):
                if held == 0 and rank:   # rank 0 holds none: nothing to keep elsewhere
                    break
                lease_id, n = client.pin(model, k[:held], tp_rank=rank)   # what all hold
                leases.append(lease_id)
                held, most = min(held, n), max(most, n)
        except Exception as e:   # refused (e.g. a lease cap) or the server went away
            self._release_leases(client, leases)
            self.stats.unpinned += 1
            logger.debug("kvedit: pin for %s refused (%s); hit reported unpinned", req_id, e)
            return None
        if held < counted and looked_up:
            self.stats.shorter += 1
        self.held[req_id] = Pin(leases, most, self.clock())   # what the leases keep
        self.chunks += most
        self.stats.pinned += 1
        return held

    def loading(self, req_id: str, step: int) -> None:
        """The request's load goes out in the metadata of step `step` (0-based)."""
        pin = self.held.get(req_id)
        if pin is not None:
            pin.load_step = step

    def step_done(self, client) -> None:
        """One more step's output came back (in step order): pins whose load ran are let go."""
        self.steps_done += 1
        for req_id in [r for r, p in self.held.items()
                       if p.load_step is not None and p.load_step < self.steps_done]:
            self.release(client, req_id)

    def expire(self, client) -> None:
        """Let go of pins older than ttl_s (a load that never came)."""
        now = self.clock()
        for req_id in [r for r, p in self.held.items() if now - p.since > self.ttl_s]:
            self.stats.expired += 1
            self.release(client, req_id)

    def release(self, client, req_id: str) -> None:
        pin = self.held.pop(req_id, None)
        if pin is None:
            return
        self.chunks -= pin.chunks
        self._release_leases(client, pin.leases)

    def release_all(self, client) -> None:
        for req_id in list(self.held):
            self.release(client, req_id)

    def _release_leases(self, client, leases: list[int]) -> None:
        if client is None:   # an outage: the server expires them (its lease TTL)
            self.stats.release_failed += len(leases)
            return
        for lease_id in leases:
            try:
                client.unpin(lease_id)
            except Exception:   # expired or the server restarted: nothing is held any more
                self.stats.release_failed += 1
