"""LMCacheBatchedStream (LMCache SDK 0.5.x's `batch` module) over kvedit's BatchedStream.

Each phase runs the selected streams as one kvedit batch phase (runner.py): concurrent
requests on kvedit's event loop, modify with kvedit's bounded CPU concurrency, server-side
waits instead of polling. The reports have LMCache's titles, sections and keys
(report.py), their values from kvedit's Metrics (kept in `report.kvedit`).
"""
from __future__ import annotations

from typing import Any

from kvedit.compat.lmcache import runner
from kvedit.compat.lmcache.context import ModifyFnType
from kvedit.compat.lmcache.errors import LMCacheBatchedStreamError
from kvedit.compat.lmcache.perf import StreamPerfMetrics
from kvedit.compat.lmcache.report import Metrics, StreamHandler, get_formatter
from kvedit.compat.lmcache.request import LMCacheRequestStream

__all__ = ["LMCacheBatchedStream", "LMCacheBatchedStreamError"]
MODES = ("prefill", "decode")


class LMCacheBatchedStream:
    """Request streams run together: prefill → modify → decode, each returning a report."""

    def __init__(self) -> None:
        self.request_streams: dict[str, LMCacheRequestStream] = {}
        self.perf_metrics: dict[str, StreamPerfMetrics] = {}   # the last run's, per stream

    def add(self, request_stream: LMCacheRequestStream) -> None:
        if not isinstance(request_stream, LMCacheRequestStream):
            raise TypeError(f"add() takes a stream from create_request, got "
                            f"{type(request_stream).__name__}")
        sid = request_stream.request_stream_id
        if sid in self.request_streams:
            raise LMCacheBatchedStreamError(f"RequestStream {sid} already exists.")
        self.request_streams[sid] = request_stream

    def get_request_stream(self, stream_id: str) -> LMCacheRequestStream:
        if stream_id not in self.request_streams:
            raise LMCacheBatchedStreamError(f"RequestStream with id {stream_id} does not exist.")
        return self.request_streams[stream_id]

    def _select(self, stream_ids: list[str] | None) -> list[str]:
        ids = list(self.request_streams) if stream_ids is None else list(stream_ids)
        for sid in ids:
            if sid not in self.request_streams:
                raise LMCacheBatchedStreamError(f"RequestStream {sid} does not exist.")
        return ids

    def _run(self, sampling_params: dict[str, Any], stream_ids: list[str] | None,
             prefill: bool) -> tuple[float, list]:
        """Requests for the selected streams -> (duration, kvedit Metrics); perf_metrics
        holds each stream that ran (all of them, unless some failed)."""
        ids = self._select(stream_ids)
        if not ids:
            return 0.0, []
        self.perf_metrics.clear()
        states = {sid: self.request_streams[sid].state for sid in ids}
        try:
            m = runner.generate(list(states.values()), sampling_params, prefill=prefill)
        finally:
            self.perf_metrics.update({sid: st.last_perf for sid, st in states.items()
                                      if st.last_perf is not None})
        return m.duration, [m]

    def run_request_streams(self, sampling_params: dict[str, Any],
                            stream_ids: list[str] | None = None) -> float:
        """One request per selected stream, concurrently -> wall seconds (0.0 for none).
        Never asks for query capture (prefill() does)."""
        return self._run(sampling_params, stream_ids, prefill=False)[0]

    def modify_request_streams(self, fn: ModifyFnType, stream_ids: list[str] | None = None,
                               timeout: float = 30.0, poll_interval: float = 0.2) -> float:
        """fn over each selected stream's mapping of kinds -> wall seconds. kvedit waits up
        to `timeout` server-side for the chunks; `poll_interval` is not used."""
        return self._modify(fn, stream_ids, timeout, poll_interval)[0]

    def _modify(self, fn, stream_ids, timeout, poll_interval) -> tuple[float, list]:
        runner.check_seconds(poll_interval, "poll_interval")
        ids = self._select(stream_ids)
        if not ids:
            return 0.0, []
        return runner.modify([self.request_streams[sid].state for sid in ids], fn, timeout)

    def get_perf_metrics(self, duration: float, fmt: str, width: int, mode: str,
                         stream_ids: list[str] | None = None) -> Metrics:
        """perf_metrics of the selected streams summed into a prefill or decode report."""
        if mode not in MODES:
            raise LMCacheBatchedStreamError(f"Invalid mode {mode}; expected one of {MODES}.")
        ids = set(self.request_streams if stream_ids is None else stream_ids)
        chosen = [p for sid, p in self.perf_metrics.items() if sid in ids]
        report = _report(f"Batched Stream Metrics ({mode})", fmt, width)
        report.add_section("config", "Configuration").add(
            "num_request_streams", "Number of Request Streams", len(self.request_streams))
        results = report.add_section("results", "Results")
        results.add("duration", "Total Duration (s)", duration)
        if mode == "prefill":
            n = sum(p.input_tokens for p in chosen)
            results.add("input_tokens", "Total Input Tokens", n)
            results.add("input_tput", "Input Throughput (tokens/s)",
                        n / duration if duration > 0 else 0.0)
        else:
            n = sum(p.output_tokens for p in chosen)
            results.add("output_tokens", "Total Output Tokens", n)
            results.add("output_tput", "Decode Throughput (tokens/s)",
                        n / duration if duration > 0 else 0.0)
        return report

    def prefill(self, sampling_params: dict[str, Any], fmt: str = "terminal", width: int = 80,
                stream_ids: list[str] | None = None) -> Metrics:
        """Each selected stream once with max_tokens 1; streams holding a QUERY context ask
        vLLM to capture their prompt's queries."""
        get_formatter(fmt, width)   # a bad fmt/width fails before the engine work
        duration, kv_metrics = self._run(sampling_params, stream_ids, prefill=True)
        report = self.get_perf_metrics(duration, fmt, width, "prefill", stream_ids)
        report.kvedit = kv_metrics
        return report

    def modify(self, fn: ModifyFnType, fmt: str = "terminal", width: int = 80,
               timeout: float = 30.0, poll_interval: float = 0.2,
               stream_ids: list[str] | None = None) -> Metrics:
        """fn over every selected stream's mapping of kinds; the report's duration is the
        wall time of the whole edit."""
        get_formatter(fmt, width)
        duration, kv_metrics = self._modify(fn, stream_ids, timeout, poll_interval)
        report = _report("Batched Stream Modify Metrics", fmt, width)
        report.add_section("results", "Results").add("duration", "Total Duration (s)",
                                                     duration)
        report.kvedit = kv_metrics
        return report

    def decode(self, sampling_params: dict[str, Any], fmt: str = "terminal", width: int = 80,
               stream_ids: list[str] | None = None) -> Metrics:
        """One request per selected stream with the given sampling params."""
        get_formatter(fmt, width)
        duration, kv_metrics = self._run(sampling_params, stream_ids, prefill=False)
        report = self.get_perf_metrics(duration, fmt, width, "decode", stream_ids)
        report.kvedit = kv_metrics
        return report


def _report(title: str, fmt: str, width: int) -> Metrics:
    report = Metrics(title)
    report.add_handler(StreamHandler(get_formatter(fmt, width)))
    return report
