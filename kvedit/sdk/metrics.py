"""Metrics of one batch phase (prefill, modify, decode) or of a run, and the one assembly of
a run's Metrics from its phases (`RunMetrics`)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvedit.sdk.modify import ModifyResult
    from kvedit.sdk.stream import Generation


def percentiles(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (linear interpolation); {} when there are no values."""
    if not values:
        return {}
    xs = sorted(values)

    def q(p: float) -> float:
        pos = p * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": sum(xs) / len(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


@dataclass(kw_only=True)
class ModifyCounts:
    """What one modify did, and the same summed over a phase's streams (Metrics): one list of
    fields for both. The seconds are summed over streams (they overlap, so a phase's sum can
    exceed its duration); retrieve_s excludes the lookup wait."""
    tokens_before: int = 0
    tokens_after: int = 0
    bytes_retrieved: int = 0
    bytes_stored: int = 0
    chunks_stored: int = 0
    chunks_reused: int = 0
    chunks_deleted: int = 0
    chunks_compared: int = 0  # present chunks whose bytes had to be compared
    retrieve_s: float = 0.0
    fn_s: float = 0.0
    store_s: float = 0.0     # compare with present chunks + copy into shm + commit


@dataclass
class Metrics(ModifyCounts):
    """Counters and timings of one phase; `parts` holds the phases of a pipelined run.

    `duration` is wall-clock seconds of the phase. Throughputs are tokens per second of that
    wall time. `ttft`/`tpot` are per stream (seconds to first token, seconds per later token).
    `cached_tokens` sums what the engine reported as prompt tokens served from cache (vLLM
    with --enable-prompt-tokens-details), None when it reports nothing.
    """
    phase: str
    num_streams: int = 0
    duration: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    # modify (the ModifyCounts fields come after these, as keywords)
    salt_changes: int = 0
    streams_skipped: int = 0
    edit_rounds: int = 0     # budgeted run: edits made during decode (kvedit.sdk.driver)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    parts: dict[str, Metrics] = field(default_factory=dict)

    @property
    def input_tput(self) -> float:
        return self.input_tokens / self.duration if self.duration > 0 else 0.0

    @property
    def output_tput(self) -> float:
        return self.output_tokens / self.duration if self.duration > 0 else 0.0

    @property
    def ttft_stats(self) -> dict[str, float]:
        return percentiles(self.ttft)

    @property
    def tpot_stats(self) -> dict[str, float]:
        return percentiles(self.tpot)

    def add_cached(self, n: int | None) -> None:
        if n is not None:
            self.cached_tokens = (self.cached_tokens or 0) + n

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("ttft", "tpot", "parts")}
        d.update(input_tput=self.input_tput, output_tput=self.output_tput,
                 ttft=self.ttft_stats, tpot=self.tpot_stats)
        if self.parts:
            d["parts"] = {k: m.to_dict() for k, m in self.parts.items()}
        return d

    def table(self) -> str:
        """A readable two-column table of the non-empty fields."""
        rows = [("phase", self.phase), ("streams", self.num_streams),
                ("duration", f"{self.duration:.3f} s")]
        if self.input_tokens:
            rows += [("input tokens", self.input_tokens),
                     ("input throughput", f"{self.input_tput:,.1f} tok/s")]
        if self.output_tokens:
            rows += [("output tokens", self.output_tokens),
                     ("output throughput", f"{self.output_tput:,.1f} tok/s")]
        if self.cached_tokens is not None:
            rows.append(("cached prompt tokens", self.cached_tokens))
        if self.bytes_retrieved or self.tokens_before:
            gbs = self.bytes_retrieved / self.duration / 1e9 if self.duration > 0 else 0.0
            rows += [("tokens before -> after", f"{self.tokens_before} -> {self.tokens_after}"),
                     ("retrieved", f"{self.bytes_retrieved / 1e9:.3f} GB ({gbs:.2f} GB/s)"),
                     ("stored", f"{self.bytes_stored / 1e9:.3f} GB"),
                     ("chunks stored / reused / deleted",
                      f"{self.chunks_stored} / {self.chunks_reused} / {self.chunks_deleted}"),
                     ("chunks byte-compared", self.chunks_compared),
                     ("salt changes", self.salt_changes),
                     ("retrieve / fn / store (summed)",
                      f"{self.retrieve_s:.3f} / {self.fn_s:.3f} / {self.store_s:.3f} s")]
            if self.streams_skipped:
                rows.append(("streams skipped (no full chunk)", self.streams_skipped))
        for name, stats in (("TTFT", self.ttft_stats), ("TPOT", self.tpot_stats)):
            if stats:
                rows.append((f"{name} mean/p50/p90/p99",
                             " / ".join(f"{stats[k] * 1e3:.1f}" for k in ("mean", "p50", "p90",
                                                                           "p99")) + " ms"))
        width = max(len(str(k)) for k, _ in rows)
        out = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
        for name, part in self.parts.items():
            out += f"\n-- {name}\n" + part.table()
        return out

    def __str__(self) -> str:
        return self.table()


class Span:
    """Wall time from the first start to the last end of a phase across streams."""

    def __init__(self):
        self.start: float | None = None
        self.end: float | None = None

    def __enter__(self):
        now = time.perf_counter()
        self.start = now if self.start is None else min(self.start, now)

    def __exit__(self, *exc):
        now = time.perf_counter()
        self.end = now if self.end is None else max(self.end, now)

    @property
    def seconds(self) -> float:
        return 0.0 if self.start is None else (self.end or time.perf_counter()) - self.start


class Busy:
    """Wall time during which at least one stream was in the phase (phases overlap across
    streams; the union of their intervals, where Span is first start to last end)."""

    def __init__(self):
        self.running, self.since, self.seconds = 0, 0.0, 0.0

    def __enter__(self):
        if self.running == 0:
            self.since = time.perf_counter()
        self.running += 1

    def __exit__(self, *exc):
        self.running -= 1
        if self.running == 0:
            self.seconds += time.perf_counter() - self.since


PHASES = ("prefill", "modify", "decode")


class RunMetrics:
    """The Metrics of one run (`BatchedStream.run`, with or without a budget), assembled in
    one place: a part per phase, each phase's `Span`, and the run's totals from its parts.
    `close` (also when the run failed) sets each part's duration: its span, unless given;
    `result` fills the run's totals. `ttft_of`: the part whose first tokens are the run's
    (decode; prefill where one request per stream does both)."""

    def __init__(self, num_streams: int):
        self.parts = {p: Metrics(p, num_streams=num_streams) for p in PHASES}
        self.spans = {p: Span() for p in PHASES}
        self.run = Metrics("run", num_streams=num_streams, parts=self.parts)

    def close(self, **durations: float) -> None:
        for p in PHASES:
            self.parts[p].duration = durations.get(p, self.spans[p].seconds)

    def result(self, ttft_of: str = "decode") -> Metrics:
        run, parts = self.run, self.parts
        run.input_tokens = parts["prefill"].input_tokens
        run.output_tokens = parts["prefill"].output_tokens + parts["decode"].output_tokens
        run.edit_rounds = parts["modify"].edit_rounds
        run.ttft, run.tpot = parts[ttft_of].ttft, parts["decode"].tpot
        return run


def add_generation(m: Metrics, g: Generation) -> None:
    m.input_tokens += g.prompt_tokens
    m.output_tokens += len(g.token_ids)
    m.add_cached(g.cached_tokens)
    if g.ttft is not None:
        m.ttft.append(g.ttft)
    if g.tpot is not None:
        m.tpot.append(g.tpot)


# ModifyResult (one stream) fields whose batch total in Metrics has another name.
def add_modify(m: Metrics, r: ModifyResult) -> None:
    for f in dataclasses.fields(ModifyCounts):
        setattr(m, f.name, getattr(m, f.name) + getattr(r, f.name))
    m.salt_changes += r.salt_changed
    m.streams_skipped += r.skipped
