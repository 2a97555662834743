"""The connector's stats lines that `kvedit bench serve` reads back from vLLM's log: what
they log parses back to the numbers logged, the last line wins, and a log without one
gives nothing."""
from __future__ import annotations

import logging

from kvedit.vllm.scheduler_stats import SchedulerStats, scheduler_counters
from kvedit.vllm.transfer.copier_stats import (
    LoadStats,
    LoadTiming,
    StoreStats,
    load_counters,
    store_counters,
)


def test_stats_lines_parse_back_to_what_was_logged(caplog):
    s = SchedulerStats(every=0.0, steps=12, lookups=5, local_misses=7, asked_again=3,
                       lookup_s=0.0042,
                       server_s=0.003, meta_s=0.0011, watch_s=0.0004, take_s=0.0002,
                       finished_s=0.0005, alloc_s=0.0001)
    st = StoreStats(every=0.0, stores=4, chunks=17, main_s=0.0123, device_wait_s=0.0001,
                    ring_wait_s=0.002, background_s=0.5)
    with caplog.at_level(logging.INFO, logger="vllm.kvedit"):
        s.maybe_log()
        st.maybe_log()
    got = scheduler_counters(caplog.text)
    assert got == {"steps": 12, "hooks_ms": 6.1, "lookups": 5, "lookup_ms": 4.2,
                   "local_misses": 7, "asked_again": 3, "server_ms": 3.0, "meta_ms": 1.1, "watch_ms": 0.6,
                   "finished_ms": 0.5, "alloc_ms": 0.1}
    assert store_counters(caplog.text) == {"stores": 4, "chunks": 17, "main_ms": 12.3,
                                           "device_wait_ms": 0.1, "ring_wait_ms": 2.0,
                                           "background_ms": 500.0}
    assert scheduler_counters("nothing logged") == {}
    with caplog.at_level(logging.INFO, logger="vllm.kvedit"):
        s.steps, s.lookups = 20, 9
        s.maybe_log()                                 # cumulative: the last line counts
        loads = LoadStats(every=0.0)
        loads.add(LoadTiming(chunks=3, nbytes=2_500_000_000, total_ms=7.5))
        loads.add(LoadTiming(chunks=2, nbytes=500_000_000, total_ms=2.5))
    assert scheduler_counters(caplog.text)["steps"] == 20
    assert scheduler_counters(caplog.text)["lookups"] == 9
    assert "events_ms" not in scheduler_counters(caplog.text)   # KV events off: not logged
    with caplog.at_level(logging.INFO, logger="vllm.kvedit"):
        s.events_s = 0.0023
        s.maybe_log()
    got = scheduler_counters(caplog.text)
    assert got["events_ms"] == 2.3 and got["hooks_ms"] == 8.4   # and counted in the hooks
    assert load_counters(caplog.text) == {"loads": 2, "chunks": 5, "gb": 3.0, "total_ms": 10.0}


def test_the_last_stores_and_loads_are_logged_at_the_next_step_past_the_interval(caplog):
    """A line comes at most every `every` seconds; the counts of stores and loads made within
    it are written by the next step past it (log_stats, every step), not only by the next
    store or load, which may never come (`kvedit bench long` reads an arm's last counts
    after a 1-token step that stores and loads nothing)."""
    import time

    st, loads = StoreStats(every=0.2), LoadStats(every=0.2)
    with caplog.at_level(logging.INFO, logger="vllm.kvedit"):
        st.stores, st.chunks = 1, 2
        st.maybe_log()                                   # the first: logged
        loads.add(LoadTiming(chunks=3, nbytes=1_000_000, total_ms=1.0))
        st.stores, st.chunks = 2, 5
        st.maybe_log()                                   # within the interval: not yet
        loads.add(LoadTiming(chunks=4, nbytes=1_000_000, total_ms=1.0))
        assert store_counters(caplog.text)["stores"] == 1
        assert load_counters(caplog.text)["loads"] == 1
        time.sleep(0.25)
        st.maybe_log(), loads.maybe_log()                # the next step: the last counts
    assert store_counters(caplog.text)["chunks"] == 5
    assert load_counters(caplog.text) == {"loads": 2, "chunks": 7, "gb": 0.0, "total_ms": 2.0}
    n = caplog.text.count("kvedit:")
    time.sleep(0.25)
    with caplog.at_level(logging.INFO, logger="vllm.kvedit"):
        st.maybe_log(), loads.maybe_log()                # nothing moved: no line
    assert caplog.text.count("kvedit:") == n
