"""What a rank's copies cost: store and load stats, written to vLLM's log.

A line every `every` seconds while a rank stores or loads (connector setting
`stats_interval_s`, default 30; 0 logs after every store and every load, which is what
`kvedit bench connector` sets to read each load's breakdown back: `load_lines` parses them).
On a GPU the copies run on side streams, so a phase's time is what vLLM's thread spent on it:
`issue` is queueing the host->device copies and scatters (a pipelined load also waits there
for each staging half to land), `device_wait` the wait at the end for the copies still
running (the host->device copies, or the whole device with the device_wait setting; the
lease on their source is released after it).
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field

logger = logging.getLogger("vllm.kvedit")


@dataclass
class StoreStats:
    """Where a rank's store time goes: the time vLLM's thread spends in store_chunks, the
    parts of it waiting for the device (device_wait: the forward still running, not a cost
    of storing; 0 without it) and for staging slots (the background thread behind: a full
    ring), and the background thread's copy + commit time (overlapped with the next
    forward)."""
    every: float = 30.0
    stores: int = 0
    chunks: int = 0
    main_s: float = 0.0
    device_wait_s: float = 0.0
    ring_wait_s: float = 0.0
    background_s: float = 0.0
    logged_at: float = 0.0
    logged: tuple = (0, 0.0)   # (stores, background_s) of the last line

    def maybe_log(self) -> None:
        """A line if `every` passed since the last one and anything moved since it (called
        at every store and at every step: the last stores' counts are written at the next
        step past the interval, not only at the next store)."""
        now = time.monotonic()
        counts = (self.stores, self.background_s)
        if now - self.logged_at >= self.every and counts != self.logged:
            self.logged_at, self.logged = now, counts
            logger.info("kvedit: store stats: %d stores, %d chunks, vLLM thread %.1f ms "
                        "(of which waiting for the forward %.1f ms, for staging %.1f ms), "
                        "background %.1f ms",
                        self.stores, self.chunks, 1e3 * self.main_s,
                        1e3 * self.device_wait_s, 1e3 * self.ring_wait_s,
                        1e3 * self.background_s)


@dataclass(slots=True)
class LoadTiming:
    """One load_run, in milliseconds of vLLM's thread (a load runs before the forward,
    which waits for all of it)."""
    chunks: int
    nbytes: int
    map_ms: float = 0.0          # our mapping of the server's segment (page-locking: once)
    retrieve_ms: float = 0.0     # the retrieve round trip: the server leases the chunks
    issue_ms: float = 0.0        # queueing copies + scatters (pipelined: incl. half waits)
    device_wait_ms: float = 0.0  # waiting for the copies still running
    release_ms: float = 0.0      # releasing the lease
    total_ms: float = 0.0


@dataclass
class LoadStats:
    every: float = 30.0
    loads: int = 0
    chunks: int = 0
    nbytes: int = 0
    total_s: float = 0.0
    last: LoadTiming | None = None
    logged_at: float = field(default=0.0)
    logged: int = 0               # loads counted in the last line

    def add(self, t: LoadTiming) -> None:
        self.loads += 1
        self.chunks += t.chunks
        self.nbytes += t.nbytes
        self.total_s += t.total_ms / 1e3
        self.last = t
        self.maybe_log()

    def maybe_log(self) -> None:
        """As StoreStats.maybe_log: at every load and at every step."""
        now, t = time.monotonic(), self.last
        if now - self.logged_at >= self.every and self.loads != self.logged:
            self.logged_at, self.logged = now, self.loads
            logger.info("kvedit: load stats: %d loads, %d chunks, %.2f GB, %.1f ms in all; "
                        "last: %d chunks, %.1f MB in %.2f ms (map %.2f, retrieve %.2f, "
                        "issue %.2f, device wait %.2f, release %.2f)",
                        self.loads, self.chunks, self.nbytes / 1e9, 1e3 * self.total_s,
                        t.chunks, t.nbytes / 1e6, t.total_ms, t.map_ms, t.retrieve_ms,
                        t.issue_ms, t.device_wait_ms, t.release_ms)


_LAST_LOAD = re.compile(
    r"kvedit: load stats: .*?last: (?P<chunks>\d+) chunks, (?P<mb>[\d.]+) MB in "
    r"(?P<total_ms>[\d.]+) ms \(map (?P<map_ms>[\d.]+), retrieve (?P<retrieve_ms>[\d.]+), "
    r"issue (?P<issue_ms>[\d.]+), device wait (?P<device_wait_ms>[\d.]+), "
    r"release (?P<release_ms>[\d.]+)\)")


def load_lines(log_text: str) -> list[dict[str, float]]:
    """Each logged load's breakdown (the `last:` part of every load stats line), oldest
    first: chunks, mb and the *_ms fields."""
    return [{k: float(v) for k, v in m.groupdict().items()}
            for m in _LAST_LOAD.finditer(log_text)]


_STORE = re.compile(
    r"kvedit: store stats: (?P<stores>\d+) stores, (?P<chunks>\d+) chunks, vLLM thread "
    r"(?P<main_ms>[\d.]+) ms \(of which waiting for the forward (?P<device_wait_ms>[\d.]+) ms, "
    r"for staging (?P<ring_wait_ms>[\d.]+) ms\), background (?P<background_ms>[\d.]+) ms")
_LOADS = re.compile(r"kvedit: load stats: (?P<loads>\d+) loads, (?P<chunks>\d+) chunks, "
                    r"(?P<gb>[\d.]+) GB, (?P<total_ms>[\d.]+) ms in all")


def last_numbers(pattern: re.Pattern, text: str) -> dict[str, float]:
    """The named groups of `pattern`'s last match in `text` as floats ({} if none)."""
    last = None
    for last in pattern.finditer(text):
        pass
    return ({k: float(v) for k, v in last.groupdict().items() if v is not None}
            if last else {})   # an optional group that did not match is left out


def store_counters(log_text: str) -> dict[str, float]:
    """The last store stats line of `log_text` as numbers ({} if none; cumulative, so two
    readings' difference is what happened between them). One rank's: with tensor
    parallelism every rank logs its own."""
    return last_numbers(_STORE, log_text)


def load_counters(log_text: str) -> dict[str, float]:
    """The last load stats line's totals (loads, chunks, gb, total_ms), as store_counters."""
    return last_numbers(_LOADS, log_text)
