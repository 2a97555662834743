"""What the connector costs vLLM's scheduler: time in kvedit's scheduler hooks, in vLLM's log.

vLLM's scheduler shares the engine-core process with a single GPU's worker and, unless it
schedules asynchronously, runs between forwards: a millisecond in these hooks is then a
millisecond added to a step. A line every `every` seconds while the engine steps (connector setting `stats_interval_s`); the counts are
cumulative, so two lines' difference is what happened between them (`kvedit bench serve`
reads them at its workload boundaries: `scheduler_counters`).
"""
from __future__ import annotations

import logging
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass

from kvedit.vllm.transfer.copier_stats import last_numbers

logger = logging.getLogger("vllm.kvedit")


@dataclass
class SchedulerStats:
    every: float = 30.0
    steps: int = 0
    lookups: int = 0          # lookups that asked the server
    local_misses: int = 0     # lookups answered "none" from the copy of the server's keys
    asked_again: int = 0      # a waiting request's hit answered again from its pin, no trip
    lookup_s: float = 0.0     # get_num_new_matched_tokens, the server round trips included
    server_s: float = 0.0     # ... of which the server round trips (lookup and pin)
    meta_s: float = 0.0       # build_connector_meta
    watch_s: float = 0.0      # ... of which store mode "evict"'s due chunks (Admission.due)
    take_s: float = 0.0       # store mode "evict" in vLLM's get_new_blocks (Admission)
    finished_s: float = 0.0   # request_finished
    alloc_s: float = 0.0      # update_state_after_alloc
    events_s: float = 0.0     # take_events (KV events for routers, tier_events.py)
    logged_at: float = 0.0

    @contextmanager
    def timed(self, part: str):
        """Add the time the block takes to the field `part` (e.g. "lookup_s")."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, part, getattr(self, part) + time.perf_counter() - t0)

    @property
    def total_s(self) -> float:
        return (self.lookup_s + self.meta_s + self.finished_s + self.alloc_s + self.take_s
                + self.events_s)

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.logged_at < self.every:
            return
        self.logged_at = now
        logger.info("kvedit: scheduler stats: %d steps, %.1f ms in kvedit's hooks (lookups %d "
                    "in %.1f ms, %d answered here, %d asked again, server %.1f ms; step metadata %.1f ms, "
                    "evict watch %.1f ms; request ends %.1f ms; after alloc %.1f ms%s)",
                    self.steps, 1e3 * self.total_s, self.lookups, 1e3 * self.lookup_s,
                    self.local_misses, self.asked_again, 1e3 * self.server_s, 1e3 * self.meta_s,
                    1e3 * (self.watch_s + self.take_s), 1e3 * self.finished_s, 1e3 * self.alloc_s,
                    f"; kv events {1e3 * self.events_s:.1f} ms" if self.events_s else "")


_LINE = re.compile(
    r"kvedit: scheduler stats: (?P<steps>\d+) steps, (?P<hooks_ms>[\d.]+) ms in kvedit's hooks "
    r"\(lookups (?P<lookups>\d+) in (?P<lookup_ms>[\d.]+) ms, "
    r"(?P<local_misses>\d+) answered here, (?:(?P<asked_again>\d+) asked again, )?"
    r"server (?P<server_ms>[\d.]+) ms; "
    r"step metadata (?P<meta_ms>[\d.]+) ms, evict watch (?P<watch_ms>[\d.]+) ms; "
    r"request ends (?P<finished_ms>[\d.]+) ms; after alloc (?P<alloc_ms>[\d.]+) ms"
    r"(?:; kv events (?P<events_ms>[\d.]+) ms)?\)")


def scheduler_counters(log_text: str) -> dict[str, float]:
    """The last scheduler stats line of `log_text` as numbers ({} if there is none)."""
    return last_numbers(_LINE, log_text)
